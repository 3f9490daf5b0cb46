"""A real `tula serve` (uvicorn) on a free loopback port: started, waited on until /healthz answers,
stopped. The benchmarks use `api_server`; the tests' fixtures (tests/conftest.py) use `LiveServer`.

It lives here rather than in tests/ because a benchmark never imports the test suite, while the tests
can import this folder (`benchmarks.live_server`).
"""

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
START_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LiveServer:
    """`python -m tula_service serve` on a free loopback port, on its own SQLite file (`database_path`)
    or on any database (`database_url`, e.g. one on the test PostgreSQL server), or, with
    `database_from_environment`, on the one TULA_DATABASE_URL in `env` names (no --database-url, as the
    compose file runs it); its output is appended to `log_path`; it runs in `cwd` (the repository root
    by default)."""

    def __init__(
        self,
        database_path: Path | None,
        log_path: Path,
        extra_args: tuple[str, ...] = (),
        env: dict | None = None,
        database_url: str | None = None,
        cwd: Path = REPO,
        database_from_environment: bool = False,
    ):
        given = (database_path is not None) + (database_url is not None) + database_from_environment
        if given != 1:
            raise ValueError("give a LiveServer one of database_path, database_url or database_from_environment")
        if database_from_environment and not (env or {}).get("TULA_DATABASE_URL"):
            raise ValueError("database_from_environment needs TULA_DATABASE_URL in env")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.database_url = (env or {}).get("TULA_DATABASE_URL") if database_from_environment else database_url or f"sqlite:///{database_path}"
        self.database_flag = () if database_from_environment else ("--database-url", self.database_url)
        self.cwd = cwd
        self.log_path = log_path
        self.extra_args = extra_args
        self.env = env or {}
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = START_TIMEOUT_S) -> LiveServer:
        """Launch the server and return once GET /healthz answers 200; RuntimeError with the log when it
        exits first or does not answer in `timeout_s` (then it is stopped)."""
        command = [
            sys.executable, "-m", "tula_service", "serve",
            "--port", str(self.port), *self.database_flag, *self.extra_args,
        ]  # fmt: skip
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(command, cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env})
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
        self.stop()
        raise RuntimeError(f"server did not answer in {timeout_s:g} s:\n{self.log_path.read_text()}")

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@contextmanager
def api_server(
    database_url: str | None, log_path: Path, executor: str = "none", extra_args: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[tuple[str, str]]:
    """`python -m tula_service serve --executor EXECUTOR`, logging to a fresh `log_path`, on `database_url`
    or else its own SQLite file in a temporary folder; yields (base URL, database URL), stops it afterwards."""
    with tempfile.TemporaryDirectory(prefix="tula-bench-") as folder:
        log_path.write_bytes(b"")
        database_path = None if database_url else Path(folder) / "tula.db"
        server = LiveServer(database_path, log_path, ("--executor", executor, *(extra_args or [])), env, database_url)
        try:
            yield server.start().url, server.database_url
        finally:
            server.stop()


def plan_answers(server_url: str) -> dict[str, float]:
    """The server's GET /v1/runs/{id}/plan answers so far by how they were made (computed, cached, not_modified), from
    its /metrics."""
    lines = httpx.get(f"{server_url}/metrics", timeout=10).text.splitlines()
    return {line.split('"')[1]: float(line.split()[-1]) for line in lines if line.startswith("tula_run_plan_answers_total{")}
