"""Step points: the placement (GPUs used on each node) of a data-parallel step point.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("points") as batch:
        batch.add_column(sa.Column("placement", sa.JSON()))


def downgrade() -> None:
    with op.batch_alter_table("points") as batch:
        batch.drop_column("placement")
