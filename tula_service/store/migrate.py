"""Schema migrations (Alembic), applied at start-up.

`upgrade_to_head(engine)` brings any database to the newest revision in one transaction. A database
made before migrations existed (tables created by `create_all`, no `alembic_version`) is stamped
as revision 0001, the schema it has, and then upgraded. On PostgreSQL a transaction-scoped advisory
lock serializes servers that start at the same moment against one database.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection, Engine

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
PRE_ALEMBIC_REVISION = "0001"
MIGRATION_LOCK_ID = 0x7475_6C61  # "tula": the PostgreSQL advisory lock key


def alembic_config(connection: Connection | None = None) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def current_revision(connection: Connection) -> str | None:
    return MigrationContext.configure(connection).get_current_revision()


def upgrade_to_head(engine: Engine) -> None:
    with engine.begin() as connection:
        if connection.dialect.name == "postgresql":
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_ID})
        config = alembic_config(connection)
        tables = set(inspect(connection).get_table_names())
        if "jobs" in tables and "alembic_version" not in tables:
            command.stamp(config, PRE_ALEMBIC_REVISION)
        command.upgrade(config, "head")
