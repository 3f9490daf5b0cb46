from pathlib import Path

import pytest

from benchmarks.live_server import REPO, LiveServer, free_port  # noqa: F401 (the tests import them from here)
from tests import pg_server


@pytest.fixture(scope="session")
def live_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("server")
    server = LiveServer(folder / "tula.db", folder / "server.log").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def api_only(tmp_path_factory):
    """A server with no executor (`--executor none`: jobs stay queued), one per test module."""
    folder = tmp_path_factory.mktemp("api-only")
    server = LiveServer(folder / "tula.db", folder / "server.log", ("--executor", "none")).start()
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


@pytest.fixture
def jobs_database_url(tmp_path) -> str:
    """A fresh SQLite file in tmp_path (jobs.db), as a database URL."""
    return f"sqlite:///{tmp_path / 'jobs.db'}"


@pytest.fixture
def store(jobs_database_url):
    """The real store on `jobs_database_url`: what the executor tests submit to and wait on."""
    from tests.api_fixtures import store_for  # here, not at the top: the store's imports take seconds

    return store_for(jobs_database_url)
