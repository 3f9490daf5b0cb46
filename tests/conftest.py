import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests import pg_server

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LiveServer:
    """A real `tula serve` (uvicorn) process on a free loopback port, on its own SQLite file
    (`database_path`) or on any database (`database_url`, e.g. one on the test PostgreSQL server)."""

    def __init__(
        self,
        database_path: Path | None,
        log_path: Path,
        extra_args: tuple[str, ...] = (),
        env: dict | None = None,
        database_url: str | None = None,
    ):
        if (database_path is None) == (database_url is None):
            raise ValueError("give a LiveServer either database_path or database_url")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.database_url = database_url or f"sqlite:///{database_path}"
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
    """Start servers for one test: on `database_path` (an SQLite file), on `database_url`, or on a
    fresh SQLite file in tmp_path; all are stopped after the test."""
    servers = []

    def _make(
        *extra_args: str, database_path: Path | None = None, env: dict | None = None, database_url: str | None = None
    ) -> LiveServer:
        if database_path is not None and database_url is not None:
            raise ValueError("give make_server database_path or database_url, not both")
        if database_url is None:
            database_path = database_path or tmp_path / "tula.db"
        server = LiveServer(database_path, tmp_path / "server.log", extra_args, env, database_url=database_url)
        servers.append(server)
        return server.start()

    yield _make
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def postgres_server():
    """A real PostgreSQL server for the session (tests/pg_server.py): a private one, or the one
    TULA_TEST_POSTGRES_URL names. Without either the tests that need it fail, saying why."""
    try:
        server = pg_server.start()
    except pg_server.PostgresUnavailable as error:
        pytest.fail(f"PostgreSQL is needed for these tests and none is available: {error}", pytrace=False)
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path):
    """A fresh, empty database for each backend: an SQLite file in tmp_path, or a database created
    for this test on the PostgreSQL server (dropped afterwards, open connections and all)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'database.db'}"
        return
    server = request.getfixturevalue("postgres_server")
    name = server.create_database()
    yield server.url(name)
    server.drop_database(name)
