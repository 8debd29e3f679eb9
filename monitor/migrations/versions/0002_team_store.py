"""A store a team shares: run names, tags, notes, error, code revision and the per-run
summary; per-stage step fields; user-logged metrics; per-process progress.

Revision ID: 0002
Revises: 0001
"""
import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

ROW_ID = sa.BigInteger().with_variant(sa.Integer, "sqlite")


def upgrade() -> None:
    for column in (
            sa.Column("name", sa.String),
            sa.Column("tags", sa.Text, nullable=False, server_default="[]"),
            sa.Column("notes", sa.Text, nullable=False, server_default=""),
            sa.Column("error", sa.Text),
            sa.Column("code_revision", sa.String),
            sa.Column("step_rows", sa.BigInteger, nullable=False, server_default="0"),
            sa.Column("last_step", sa.BigInteger),
            sa.Column("first_step_at", sa.Float),
            sa.Column("last_step_at", sa.Float),
            sa.Column("last_seen_at", sa.Float),
            sa.Column("world_size", sa.BigInteger),
            sa.Column("world_size_min", sa.BigInteger),
            sa.Column("world_size_max", sa.BigInteger),
            sa.Column("samples_done", sa.BigInteger, nullable=False, server_default="0")):
        op.add_column("run", column)
    op.create_index("ix_run_started", "run", ["started_at"])
    op.add_column("step_metric", sa.Column("replica", sa.BigInteger))
    op.add_column("step_metric", sa.Column("bubble", sa.Float))
    op.add_column("step_metric", sa.Column("overlap", sa.Float))
    op.create_table(
        "custom_metric",
        sa.Column("id", ROW_ID, primary_key=True),
        sa.Column("run_id", sa.String, nullable=False),
        sa.Column("name", sa.String, nullable=False),
        sa.Column("step", sa.BigInteger),
        sa.Column("value", sa.Float, nullable=False),
        sa.Column("rank", sa.BigInteger),
        sa.Column("host", sa.String),
        sa.Column("wall_time", sa.Float, nullable=False),
        sa.Column("uid", sa.String, unique=True))
    op.create_index("ix_metric_run_name", "custom_metric", ["run_id", "name", "id"])
    op.create_table(
        "run_process",
        sa.Column("run_id", sa.String, primary_key=True),
        sa.Column("host", sa.String, primary_key=True),
        sa.Column("slot", sa.BigInteger, primary_key=True),
        sa.Column("last_step", sa.BigInteger, nullable=False),
        sa.Column("last_rank", sa.BigInteger, nullable=False),
        sa.Column("last_wall_time", sa.Float, nullable=False),
        sa.Column("last_step_time", sa.Float, nullable=False),
        sa.Column("last_samples", sa.BigInteger, nullable=False),
        sa.Column("step_rows", sa.BigInteger, nullable=False))
    # The summaries of the runs already stored, from their rows.
    from monitor import rollup
    conn = op.get_bind()
    rollup.rebuild(conn)
    rollup.refresh_last_seen(conn)
