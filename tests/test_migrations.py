"""Schema migrations on SQLite and PostgreSQL: a fresh database reaches the newest revision with
exactly the models' schema, a database from before migrations keeps its rows, servers starting at
once on one PostgreSQL database both come up, and the revisions go down and up again."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from tula_service.store.db import Base, make_engine, make_session_factory
from tula_service.store.job_store import Store
from tula_service.store.migrate import alembic_config, current_revision, head_revision, upgrade_to_head

MODEL_TABLES = {"jobs", "points", "api_tokens", "runs", "run_telemetry"}
JOB_ID = "a" * 32


def schema_differences(engine: sa.Engine) -> list:
    """What Alembic's autogenerate would change to make the database match the models: tables,
    columns, types, nullability, server defaults, indexes, unique constraints and foreign keys."""
    with engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True, "compare_server_default": True})
        return compare_metadata(context, Base.metadata)


def tables(engine: sa.Engine) -> set[str]:
    return set(sa.inspect(engine).get_table_names())


def test_a_fresh_database_migrates_to_the_newest_revision(database_url):
    engine = make_engine(database_url)

    with engine.connect() as connection:
        assert current_revision(connection) == head_revision()
    assert tables(engine) == MODEL_TABLES | {"alembic_version"}
    engine.dispose()


def test_the_migrated_schema_is_exactly_the_models_schema(database_url):
    engine = make_engine(database_url)

    assert schema_differences(engine) == []
    engine.dispose()


def test_starting_again_on_a_migrated_database_changes_nothing(database_url):
    make_engine(database_url).dispose()
    engine = make_engine(database_url)

    with engine.connect() as connection:
        assert current_revision(connection) == head_revision()
        assert connection.scalar(sa.text("SELECT count(*) FROM alembic_version")) == 1
    engine.dispose()


# --- a database from before migrations -------------------------------------------------------------

LEGACY = sa.MetaData()  # the tables `Base.metadata.create_all` made before Alembic (revision 0001)
sa.Table(
    "jobs", LEGACY,
    sa.Column("id", sa.String(32), primary_key=True),
    sa.Column("name", sa.String(200)),
    sa.Column("state", sa.String(16), nullable=False, index=True),
    sa.Column("spec", sa.JSON, nullable=False),
    sa.Column("recommendation", sa.JSON),
    sa.Column("error", sa.Text),
    sa.Column("created_at", sa.DateTime, nullable=False),
    sa.Column("updated_at", sa.DateTime, nullable=False),
    sa.Column("finished_at", sa.DateTime),
)  # fmt: skip
sa.Table(
    "points", LEGACY,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("job_id", sa.String(32), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False, index=True),
    sa.Column("kind", sa.String(8), nullable=False),
    sa.Column("batch_size", sa.Integer),
    sa.Column("state", sa.String(16), nullable=False, index=True),
    sa.Column("attempts", sa.Integer, nullable=False),
    sa.Column("measurement", sa.JSON),
    sa.Column("error", sa.Text),
    sa.Column("started_at", sa.DateTime),
    sa.Column("finished_at", sa.DateTime),
    sa.Column("duration_s", sa.Float),
)  # fmt: skip


def insert_a_finished_job(connection: sa.Connection) -> None:
    created = dt.datetime(2024, 5, 1, 12, 0, 0)
    connection.execute(
        LEGACY.tables["jobs"].insert().values(
            id=JOB_ID, name="from-before", state="done", spec={"model": "small_cnn"},
            recommendation={"knee": {"device_batch": 64}}, created_at=created, updated_at=created, finished_at=created,
        )
    )  # fmt: skip
    connection.execute(
        LEGACY.tables["points"].insert().values(
            job_id=JOB_ID, kind="grid", batch_size=64, state="done", attempts=1, measurement={"batch_size": 64},
            started_at=created, finished_at=created, duration_s=2.5,
        )
    )  # fmt: skip


@pytest.fixture
def pre_alembic_database(database_url) -> str:
    """A database with the tables of revision 0001 and one finished job with one point, made the
    way the server made them before migrations existed: no alembic_version table."""
    engine = sa.create_engine(database_url)
    LEGACY.create_all(engine)
    with engine.begin() as connection:
        insert_a_finished_job(connection)
    engine.dispose()
    return database_url


def test_a_database_from_before_migrations_is_stamped_and_upgraded(pre_alembic_database):
    engine = make_engine(pre_alembic_database)

    with engine.connect() as connection:
        assert current_revision(connection) == head_revision()
    assert schema_differences(engine) == []
    engine.dispose()


def test_a_database_from_before_migrations_keeps_its_jobs_and_points(pre_alembic_database):
    engine = make_engine(pre_alembic_database)

    job = Store(make_session_factory(engine)).get_job(JOB_ID)
    assert (job.name, job.state, job.recommendation) == ("from-before", "done", {"knee": {"device_batch": 64}})
    assert (job.idempotency_key, job.spec_sha256) == (None, None)
    assert [(p.batch_size, p.state, p.measurement, p.duration_s, p.attempt_errors) for p in job.points] == [
        (64, "done", {"batch_size": 64}, 2.5, None)
    ]
    engine.dispose()


# --- concurrent start-up ---------------------------------------------------------------------------


@pytest.fixture
def fresh_postgres_database(postgres_server):
    name = postgres_server.create_database()
    yield postgres_server.url(name)
    postgres_server.drop_database(name)


STARTING_SERVER = """
import sys
from tula_service.store.db import make_engine
print("ready", flush=True)
sys.stdin.readline()
make_engine(sys.argv[1]).dispose()
"""


def test_servers_starting_at_once_on_one_fresh_postgresql_database_all_migrate_it(fresh_postgres_database):
    """Separate processes, as servers are (Alembic's context is one per process), each released to
    migrate at the same moment. The advisory lock serializes them: one creates the tables, the
    others find them made."""
    servers = [
        subprocess.Popen(
            [sys.executable, "-c", STARTING_SERVER, fresh_postgres_database],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        for _ in range(4)
    ]
    try:
        for server in servers:
            assert server.stdout.readline().strip() == "ready"
        for server in servers:
            server.stdin.write("go\n")
            server.stdin.flush()
        outcomes = [(server.wait(timeout=60), server.stdout.read()) for server in servers]
    finally:
        for server in servers:
            server.kill()
            server.wait()

    assert [code for code, _ in outcomes] == [0] * len(servers), "\n".join(output for _, output in outcomes)
    engine = sa.create_engine(fresh_postgres_database)
    with engine.connect() as connection:
        assert current_revision(connection) == head_revision()
        assert connection.scalar(sa.text("SELECT count(*) FROM alembic_version")) == 1
    assert schema_differences(engine) == []
    engine.dispose()


# --- downgrades ------------------------------------------------------------------------------------


def migrate_to(engine: sa.Engine, revision: str, *, down: bool) -> None:
    with engine.begin() as connection:
        (command.downgrade if down else command.upgrade)(alembic_config(connection), revision)


def test_downgrading_to_base_and_upgrading_again_gives_the_same_schema(database_url):
    engine = make_engine(database_url)

    migrate_to(engine, "base", down=True)
    assert tables(engine) <= {"alembic_version"}
    with engine.connect() as connection:
        assert current_revision(connection) is None

    upgrade_to_head(engine)
    with engine.connect() as connection:
        assert current_revision(connection) == head_revision()
    assert schema_differences(engine) == []
    engine.dispose()


def test_downgrading_one_revision_keeps_jobs_and_points(database_url):
    engine = make_engine(database_url)
    with engine.begin() as connection:
        insert_a_finished_job(connection)

    migrate_to(engine, "0001", down=True)

    with engine.connect() as connection:
        assert current_revision(connection) == "0001"
        assert connection.execute(sa.text("SELECT id, state FROM jobs")).all() == [(JOB_ID, "done")]
        assert connection.execute(sa.text("SELECT job_id, batch_size FROM points")).all() == [(JOB_ID, 64)]
    assert "api_tokens" not in tables(engine)
    engine.dispose()
