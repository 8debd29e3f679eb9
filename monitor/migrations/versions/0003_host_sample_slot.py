"""Host samples say which worker process on the host took them (``slot``), so the
dashboard can add up a host's memory; samples stored before have none.

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
    op.add_column("host_sample", sa.Column("slot", sa.BigInteger))
