"""The schema of the first release: run, step_metric, event, host_sample.

Revision ID: 0001
Revises:
"""
import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

ROW_ID = sa.BigInteger().with_variant(sa.Integer, "sqlite")


def upgrade() -> None:
    op.create_table(
        "run",
        sa.Column("id", sa.String, primary_key=True),
        sa.Column("job", sa.String, nullable=False),
        sa.Column("status", sa.String, nullable=False),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("finished_at", sa.Float),
        sa.Column("config", sa.Text, nullable=False),
        sa.Column("launcher", sa.String, nullable=False))
    op.create_table(
        "step_metric",
        sa.Column("id", ROW_ID, primary_key=True),
        sa.Column("run_id", sa.String, nullable=False),
        sa.Column("step", sa.BigInteger, nullable=False),
        sa.Column("wall_time", sa.Float, nullable=False),
        sa.Column("rank", sa.BigInteger, nullable=False),
        sa.Column("world_size", sa.BigInteger, nullable=False),
        sa.Column("host", sa.String, nullable=False),
        sa.Column("slot", sa.BigInteger, nullable=False),
        sa.Column("stage", sa.BigInteger, nullable=False),
        *[sa.Column(name, sa.Float, nullable=False)
          for name in ("step_time", "data_time", "compute_time", "comm_time", "wait_time")],
        sa.Column("samples", sa.BigInteger, nullable=False),
        sa.Column("bytes_sent", sa.BigInteger, nullable=False),
        sa.Column("loss", sa.Float),
        sa.Column("lr", sa.Float),
        sa.Column("uid", sa.String, unique=True))
    op.create_index("ix_step_run_step", "step_metric", ["run_id", "step"])
    op.create_index("ix_step_run_host_slot", "step_metric", ["run_id", "host", "slot"])
    op.create_table(
        "event",
        sa.Column("id", ROW_ID, primary_key=True),
        sa.Column("run_id", sa.String, nullable=False),
        sa.Column("wall_time", sa.Float, nullable=False),
        sa.Column("step", sa.BigInteger),
        sa.Column("kind", sa.String, nullable=False),
        sa.Column("host", sa.String),
        sa.Column("rank", sa.BigInteger),
        sa.Column("detail", sa.Text, nullable=False),
        sa.Column("uid", sa.String, unique=True))
    op.create_index("ix_event_run_time", "event", ["run_id", "wall_time"])
    op.create_index("ix_event_run_kind", "event", ["run_id", "kind"])
    op.create_table(
        "host_sample",
        sa.Column("id", ROW_ID, primary_key=True),
        sa.Column("run_id", sa.String, nullable=False),
        sa.Column("host", sa.String, nullable=False),
        sa.Column("wall_time", sa.Float, nullable=False),
        sa.Column("cpu_percent", sa.Float, nullable=False),
        sa.Column("rss_bytes", sa.BigInteger, nullable=False),
        sa.Column("gpu_util", sa.Float),
        sa.Column("gpu_mem", sa.BigInteger),
        sa.Column("uid", sa.String, unique=True))
    op.create_index("ix_host_run_host_time", "host_sample", ["run_id", "host", "wall_time"])
