import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LiveServer:
    """A real `tula serve` (uvicorn) process on a free loopback port with its own SQLite file."""

    def __init__(self, database_path: Path, log_path: Path, extra_args: tuple[str, ...] = (), env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.database_url = f"sqlite:///{database_path}"
        self.log_path = log_path
        self.extra_args = extra_args
        self.env = env or {}
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60.0) -> "LiveServer":
        command = [
            sys.executable, "-m", "tula_service", "serve",
            "--port", str(self.port), "--database-url", self.database_url, *self.extra_args,
        ]  # fmt: skip
        self.process = subprocess.Popen(
            command, cwd=REPO, stdout=self.log_path.open("ab"), stderr=subprocess.STDOUT, env={**os.environ, **self.env}
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log_path.read_text()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server did not answer in {timeout_s} s:\n{self.log_path.read_text()}")

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="session")
def live_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("server")
    server = LiveServer(folder / "tula.db", folder / "server.log").start()
    yield server
    server.stop()


@pytest.fixture
def make_server(tmp_path):
    servers = []

    def _make(*extra_args: str, database_path: Path | None = None, env: dict | None = None) -> LiveServer:
        server = LiveServer(database_path or tmp_path / "tula.db", tmp_path / "server.log", extra_args, env)
        servers.append(server)
        return server.start()

    yield _make
    for server in servers:
        server.stop()
