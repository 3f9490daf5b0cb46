"""Durable jobs: idempotency keys, worker identity and attempt history per point; API tokens.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("idempotency_key", sa.String(255)))
        batch.add_column(sa.Column("spec_sha256", sa.String(64)))
        batch.create_unique_constraint("uq_jobs_idempotency_key", ["idempotency_key"])
    with op.batch_alter_table("points") as batch:
        batch.add_column(sa.Column("worker", sa.String(255)))
        batch.add_column(sa.Column("worker_pid", sa.Integer()))
        batch.add_column(sa.Column("attempt_errors", sa.JSON()))
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("token_sha256", sa.String(64), nullable=False, unique=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("last_used_at", sa.DateTime()),
        sa.Column("revoked_at", sa.DateTime()),
    )


def downgrade() -> None:
    op.drop_table("api_tokens")
    with op.batch_alter_table("points") as batch:
        batch.drop_column("attempt_errors")
        batch.drop_column("worker_pid")
        batch.drop_column("worker")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_constraint("uq_jobs_idempotency_key", type_="unique")
        batch.drop_column("spec_sha256")
        batch.drop_column("idempotency_key")
