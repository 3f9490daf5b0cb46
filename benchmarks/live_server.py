"""A real `tula serve` for benchmarks: a free loopback port, its own SQLite file unless a database URL is given."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def api_server(
    database_url: str | None, log_path: Path, executor: str = "none", extra_args: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[tuple[str, str]]:
    """`python -m tula_service serve --executor EXECUTOR`; yields (base URL, database URL), stops it afterwards."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="tula-bench-") as folder:
        url_of_db = database_url or f"sqlite:///{Path(folder) / 'tula.db'}"
        command = [sys.executable, "-m", "tula_service", "serve", "--port", str(port),
                   "--database-url", url_of_db, "--executor", executor, *(extra_args or [])]  # fmt: skip
        with log_path.open("wb") as log:
            process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(process, url, log_path)
            yield url, url_of_db
        finally:
            process.terminate()
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_healthy(process: subprocess.Popen, url: str, log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{log_path.read_text()}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not answer within {START_TIMEOUT_S} s:\n{log_path.read_text()}")
        time.sleep(0.2)
