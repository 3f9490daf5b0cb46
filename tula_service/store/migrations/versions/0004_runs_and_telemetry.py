"""Runs: a training run that follows a job's recommendation, its telemetry and the decisions taken on it.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("job_id", sa.String(32), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("options", sa.JSON(), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("decisions", sa.JSON(), nullable=False),
        sa.Column("records", sa.Integer(), nullable=False),
        sa.Column("last_step", sa.Integer()),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.Column("idempotency_key", sa.String(255)),
        sa.Column("request_sha256", sa.String(64)),
        sa.UniqueConstraint("idempotency_key", name="uq_runs_idempotency_key"),
    )
    op.create_index("ix_runs_job_id", "runs", ["job_id"])
    op.create_table(
        "run_telemetry",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.String(32), sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("record", sa.JSON(), nullable=False),
        sa.UniqueConstraint("run_id", "step", name="uq_run_telemetry_step"),
    )
    op.create_index("ix_run_telemetry_run_id", "run_telemetry", ["run_id"])


def downgrade() -> None:
    op.drop_table("run_telemetry")
    op.drop_table("runs")
