"""Alembic environment: runs on the connection `tula_service.store.migrate` hands over (never a URL here).

On SQLite, Alembic alters a table by copying it and dropping the old one; with foreign keys on,
that drop would cascade to every point of every job. So foreign keys are off while migrating (the
pragma takes effect here because pysqlite has not begun a transaction yet), checked afterwards, and
turned on again by `tula_service.store.db`'s checkout listener the next time the connection is used.
"""

from alembic import context

from tula_service.store.db import Base

connection = context.config.attributes["connection"]
sqlite = connection.dialect.name == "sqlite"
if sqlite:
    connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
if sqlite:
    broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
    if broken:
        raise RuntimeError(f"migration left rows with broken foreign keys: {broken[:5]}")
