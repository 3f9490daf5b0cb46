"""A real PostgreSQL server for the test session, and a fresh database per test.

By default a private server: `initdb` into a temporary folder, listening on 127.0.0.1 on a free
port with its unix socket in that folder, trust authentication, and fsync off (its data is thrown
away, so it may as well be fast). PostgreSQL refuses to run as root, so as root the folder belongs
to the `postgres` OS user and initdb / pg_ctl run as that user (`runuser -u postgres --`). The
binaries come from Debian's `postgresql` package, which `make test` installs when it is missing.

With TULA_TEST_POSTGRES_URL set (e.g. `postgresql://tula:secret@db.example:5432/postgres`), the
tests use that server instead: its user must be allowed to create and drop databases.

Anything that stops both from working raises PostgresUnavailable, and the tests that need the
server fail with its message: a PostgreSQL test is never skipped.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
from psycopg import sql
from sqlalchemy.engine import URL, make_url

URL_ENV = "TULA_TEST_POSTGRES_URL"
SERVER_GLOB = "/usr/lib/postgresql/*/bin/postgres"  # Debian's layout: one folder per major version
OS_USER = "postgres"
START_ATTEMPTS = 3  # a free port can be taken by someone else before the server binds it
SETTINGS = {
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "300",  # every test's engines keep a pool (10 + 20 overflow) open
}


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL server for the tests; the message says what to install or set."""


@dataclass
class PostgresServer:
    """A server the tests may create and drop databases on.

    `base_url` is a SQLAlchemy URL without a database (`postgresql+psycopg://postgres@127.0.0.1:PORT`);
    `url(name)` names one; `admin_database` is where CREATE / DROP DATABASE run.
    """

    base_url: str
    admin_database: str = "postgres"
    stop_actions: list = field(default_factory=list)

    def url(self, database: str) -> str:
        return make_url(self.base_url).set(database=database).render_as_string(hide_password=False)

    def _admin_connection(self) -> psycopg.Connection:
        admin = make_url(self.url(self.admin_database)).set(drivername="postgresql")
        return psycopg.connect(admin.render_as_string(hide_password=False), autocommit=True, connect_timeout=10)

    def create_database(self) -> str:
        """A new, empty database with a unique name; returns the name."""
        name = f"tula_test_{uuid.uuid4().hex[:16]}"
        with self._admin_connection() as connection:
            connection.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return name

    def drop_database(self, name: str) -> None:
        """Drop it, ending whatever connections the test left open (PostgreSQL 13+)."""
        with self._admin_connection() as connection:
            connection.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))

    def check(self) -> None:
        try:
            with self._admin_connection() as connection:
                connection.execute("SELECT 1")
        except psycopg.Error as error:
            raise PostgresUnavailable(f"cannot connect to PostgreSQL at {self.base_url}: {error}") from error

    def stop(self) -> None:
        for action in reversed(self.stop_actions):
            action()
        self.stop_actions.clear()


def external_server(url: str) -> PostgresServer:
    """The server at TULA_TEST_POSTGRES_URL; its database (default `postgres`) is the admin one."""
    parsed = make_url(url)
    if not parsed.drivername.startswith("postgres"):
        raise PostgresUnavailable(f"{URL_ENV}={url!r} is not a postgresql:// URL")
    base = URL.create("postgresql+psycopg", parsed.username, parsed.password, parsed.host, parsed.port, query=parsed.query)
    server = PostgresServer(base_url=base.render_as_string(hide_password=False), admin_database=parsed.database or "postgres")
    server.check()
    return server


def _major_version(server_binary: str) -> int:
    version = Path(server_binary).parts[-3]  # /usr/lib/postgresql/VERSION/bin/postgres
    return int(version) if version.isdigit() else 0


def server_bindir() -> Path:
    """The newest installed PostgreSQL's bin folder."""
    binaries = sorted(glob.glob(SERVER_GLOB), key=_major_version)
    if binaries:
        return Path(binaries[-1]).parent
    on_path = shutil.which("pg_ctl")
    if on_path and shutil.which("initdb"):
        return Path(on_path).parent
    raise PostgresUnavailable(
        f"no PostgreSQL server binaries ({SERVER_GLOB} or initdb/pg_ctl on PATH): run the tests with "
        "`make test`, which installs Debian's `postgresql` package, or `apt-get install postgresql`, "
        f"or set {URL_ENV} to a server the tests may create databases on"
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(command: list[str], what: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise PostgresUnavailable(f"{what} failed ({' '.join(command)}):\n{result.stdout}{result.stderr}")


def private_server() -> PostgresServer:
    """initdb + pg_ctl start of a throw-away server; `stop()` stops it and removes its folder."""
    bindir = server_bindir()
    as_owner: list[str] = []
    root = Path(tempfile.mkdtemp(prefix="tula-pg-"))  # under /tmp: the postgres user can reach it
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(OS_USER)
        except KeyError:
            shutil.rmtree(root)
            raise PostgresUnavailable(
                f"running as root and there is no '{OS_USER}' OS user to run PostgreSQL as "
                "(Debian's postgresql package creates it)"
            ) from None
        if not shutil.which("runuser"):
            shutil.rmtree(root)
            raise PostgresUnavailable("running as root and `runuser` (util-linux) is missing")
        shutil.chown(root, OS_USER, OS_USER)
        as_owner = ["runuser", "-u", OS_USER, "--"]
    data = root / "data"
    log_path = root / "server.log"
    server = PostgresServer(base_url="")
    server.stop_actions.append(lambda: shutil.rmtree(root, ignore_errors=True))
    try:
        _run(
            [*as_owner, str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust",
             "--encoding=UTF8", "--locale=C", "--no-sync"],
            "initdb",
        )  # fmt: skip
        for attempt in range(1, START_ATTEMPTS + 1):
            port = free_port()
            settings = {**SETTINGS, "listen_addresses": "'127.0.0.1'", "port": str(port), "unix_socket_directories": f"'{root}'"}
            with (data / "postgresql.auto.conf").open("a") as conf:  # the last setting of a name wins
                conf.writelines(f"{name} = {value}\n" for name, value in settings.items())
            start = subprocess.run(
                [*as_owner, str(bindir / "pg_ctl"), "-D", str(data), "-l", str(log_path), "-w", "-t", "60", "start"],
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            if start.returncode == 0:
                break
            if attempt == START_ATTEMPTS:
                log = log_path.read_text() if log_path.exists() else ""
                raise PostgresUnavailable(f"pg_ctl start failed {START_ATTEMPTS} times:\n{start.stdout}{start.stderr}\n{log}")
        server.stop_actions.append(
            lambda: subprocess.run(
                [*as_owner, str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"],
                capture_output=True, timeout=60,
            )  # fmt: skip
        )
        server.base_url = f"postgresql+psycopg://postgres@127.0.0.1:{port}"
        server.check()
    except BaseException:
        server.stop()
        raise
    return server


def start() -> PostgresServer:
    """The server named by TULA_TEST_POSTGRES_URL, else a private one."""
    url = os.environ.get(URL_ENV)
    return external_server(url) if url else private_server()
