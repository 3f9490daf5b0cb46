"""Alembic environment: runs on the connection `tula_service.migrate` hands over (never a URL here)."""

from alembic import context

from tula_service.db import Base

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
