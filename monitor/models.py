"""Typed SQLAlchemy models of Regatta's metrics tables.

Each row type a producer sends (``run``, ``step``, ``event``, ``host``, ``metric``) maps to
one model here, and its fields are the model's columns: the models are the one definition
of the schema (monitor.schema derives its checks from them, each column's ``info`` giving
ranges, lengths and choices). Columns marked ``derived`` are kept by the store itself
(the per-run summary that makes the runs list fast) and are never sent by a producer.

Changing a model needs a migration in monitor/migrations/versions (see monitor.migrate).
"""
from __future__ import annotations

from typing import Any, Optional

from sqlalchemy import JSON, BigInteger, Float, Index, Integer, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

RUN_STATUSES = ("running", "finished", "failed", "stopped")   # stopped: on a signal, checkpointed
READ_STATUSES = RUN_STATUSES + ("lost",)   # lost: running, but silent (computed on read)
# SQLite only auto-numbers an INTEGER PRIMARY KEY; PostgreSQL wants 64 bits.
ROW_ID = BigInteger().with_variant(Integer, "sqlite")
IDENT = {"min_len": 1, "max_len": 200}
HOST = {"min_len": 1, "max_len": 255}
NON_NEGATIVE = {"min": 0}
# Bounds that keep every sum and ratio the queries take finite on every database
# (PostgreSQL raises on a float overflow instead of returning infinity).
SECONDS = {"min": 0, "max": 1e7}
WALL = {"min": 0, "max": 1e11}
SCALAR = {"min": -1e100, "max": 1e100}


def derived(**kw) -> Any:
    """A summary column the store keeps up to date; producers cannot send it."""
    return mapped_column(info={"derived": True}, **kw)


class Base(DeclarativeBase):
    """Declarative base of every Regatta table: ints are 64-bit everywhere."""

    type_annotation_map = {int: BigInteger, float: Float, str: String}


class Run(Base):
    """One training run; later ``run`` rows update its status, finish time and error."""

    __tablename__ = "run"
    id: Mapped[str] = mapped_column(String, primary_key=True, info=IDENT)
    job: Mapped[str] = mapped_column(info=IDENT)
    status: Mapped[str] = mapped_column(info={"choices": RUN_STATUSES})
    started_at: Mapped[float] = mapped_column(info=WALL)
    finished_at: Mapped[Optional[float]] = mapped_column(info=WALL)
    config: Mapped[str] = mapped_column(Text, default="{}", info={"json": "object"})
    launcher: Mapped[str] = mapped_column(default="local", info={"min_len": 1, "max_len": 50})
    name: Mapped[Optional[str]] = mapped_column(info=IDENT)
    tags: Mapped[str] = mapped_column(Text, default="[]", info={"json": "tags"})
    notes: Mapped[str] = mapped_column(Text, default="", info={"max_len": 10_000})
    error: Mapped[Optional[str]] = mapped_column(Text, info={"max_len": 10_000})
    code_revision: Mapped[Optional[str]] = mapped_column(info={"max_len": 100})
    # The summary of its rows, updated with every batch written (monitor.rollup).
    step_rows: Mapped[int] = derived(default=0)
    last_step: Mapped[Optional[int]] = derived()
    first_step_at: Mapped[Optional[float]] = derived()
    last_step_at: Mapped[Optional[float]] = derived()
    last_seen_at: Mapped[Optional[float]] = derived()   # newest wall time of any row
    world_size: Mapped[Optional[int]] = derived()       # at the newest step row
    world_size_min: Mapped[Optional[int]] = derived()
    world_size_max: Mapped[Optional[int]] = derived()
    samples_done: Mapped[int] = derived(default=0)      # replayed steps counted once
    __table_args__ = (Index("ix_run_started", "started_at"),)


class StepMetric(Base):
    """What one rank measured during one optimizer step."""

    __tablename__ = "step_metric"
    id: Mapped[int] = mapped_column(ROW_ID, primary_key=True)
    run_id: Mapped[str] = mapped_column(info=IDENT)
    step: Mapped[int] = mapped_column(info=NON_NEGATIVE)
    wall_time: Mapped[float] = mapped_column(info=WALL)
    rank: Mapped[int] = mapped_column(info=NON_NEGATIVE)
    world_size: Mapped[int] = mapped_column(info={"min": 1})
    host: Mapped[str] = mapped_column(info=HOST)
    slot: Mapped[int] = mapped_column(default=0, info=NON_NEGATIVE)
    stage: Mapped[int] = mapped_column(default=0, info=NON_NEGATIVE)
    step_time: Mapped[float] = mapped_column(info=SECONDS)
    data_time: Mapped[float] = mapped_column(default=0.0, info=SECONDS)
    compute_time: Mapped[float] = mapped_column(default=0.0, info=SECONDS)
    comm_time: Mapped[float] = mapped_column(default=0.0, info=SECONDS)
    wait_time: Mapped[float] = mapped_column(default=0.0, info=SECONDS)
    samples: Mapped[int] = mapped_column(default=0, info=NON_NEGATIVE)
    bytes_sent: Mapped[int] = mapped_column(default=0, info=NON_NEGATIVE)
    loss: Mapped[Optional[float]] = mapped_column(info=SCALAR)
    lr: Mapped[Optional[float]] = mapped_column(info=SCALAR)
    uid: Mapped[Optional[str]] = mapped_column(unique=True, info=IDENT)
    replica: Mapped[Optional[int]] = mapped_column(info=NON_NEGATIVE)
    bubble: Mapped[Optional[float]] = mapped_column(info={"min": 0, "max": 1})
    overlap: Mapped[Optional[float]] = mapped_column(info={"min": 0, "max": 1})
    __table_args__ = (
        Index("ix_step_run_step", "run_id", "step"),
        Index("ix_step_run_host_slot", "run_id", "host", "slot"),
    )


class Event(Base):
    """Something that happened to the run: commit, restore, reset, failure, ...
    (the kinds and how the dashboard draws them: monitor.event_kinds)."""

    __tablename__ = "event"
    id: Mapped[int] = mapped_column(ROW_ID, primary_key=True)
    run_id: Mapped[str] = mapped_column(info=IDENT)
    wall_time: Mapped[float] = mapped_column(info=WALL)
    step: Mapped[Optional[int]] = mapped_column(info=NON_NEGATIVE)
    kind: Mapped[str] = mapped_column(info={"pattern": r"[a-z][a-z0-9_]{0,39}"})
    host: Mapped[Optional[str]] = mapped_column(info=HOST)
    rank: Mapped[Optional[int]] = mapped_column(info=NON_NEGATIVE)
    detail: Mapped[str] = mapped_column(Text, default="{}", info={"json": "object"})
    uid: Mapped[Optional[str]] = mapped_column(unique=True, info=IDENT)
    __table_args__ = (
        Index("ix_event_run_time", "run_id", "wall_time"),
        Index("ix_event_run_kind", "run_id", "kind"),
    )


class HostSample(Base):
    """A periodic resource sample taken by one worker process: its host's CPU %, its own
    memory (``slot`` says which process on the host; a host's memory is their sum)."""

    __tablename__ = "host_sample"
    id: Mapped[int] = mapped_column(ROW_ID, primary_key=True)
    run_id: Mapped[str] = mapped_column(info=IDENT)
    host: Mapped[str] = mapped_column(info=HOST)
    slot: Mapped[Optional[int]] = mapped_column(info=NON_NEGATIVE)
    wall_time: Mapped[float] = mapped_column(info=WALL)
    cpu_percent: Mapped[float] = mapped_column(info={"min": 0, "max": 1e6})
    rss_bytes: Mapped[int] = mapped_column(info=NON_NEGATIVE)
    gpu_util: Mapped[Optional[float]] = mapped_column(info={"min": 0, "max": 1e6})
    gpu_mem: Mapped[Optional[int]] = mapped_column(info=NON_NEGATIVE)
    uid: Mapped[Optional[str]] = mapped_column(unique=True, info=IDENT)
    __table_args__ = (Index("ix_host_run_host_time", "run_id", "host", "wall_time"),)


class CustomMetric(Base):
    """A scalar the user's code logged (an eval loss, an accuracy, a temperature)."""

    __tablename__ = "custom_metric"
    id: Mapped[int] = mapped_column(ROW_ID, primary_key=True)
    run_id: Mapped[str] = mapped_column(info=IDENT)
    name: Mapped[str] = mapped_column(info={"pattern": r"(?!\.)[A-Za-z0-9_./:-]{1,100}"})
    step: Mapped[Optional[int]] = mapped_column(info=NON_NEGATIVE)
    value: Mapped[float] = mapped_column(info=SCALAR)
    rank: Mapped[Optional[int]] = mapped_column(info=NON_NEGATIVE)
    host: Mapped[Optional[str]] = mapped_column(info=HOST)
    wall_time: Mapped[float] = mapped_column(info=WALL)
    uid: Mapped[Optional[str]] = mapped_column(unique=True, info=IDENT)
    __table_args__ = (Index("ix_metric_run_name", "run_id", "name", "id"),)


class RunProcess(Base):
    """Per run and process (host, slot): how far it got and its newest step row. Kept by
    the store (monitor.rollup): replayed steps count once, and /metrics reads it."""

    __tablename__ = "run_process"
    run_id: Mapped[str] = mapped_column(String, primary_key=True)
    host: Mapped[str] = mapped_column(String, primary_key=True)
    slot: Mapped[int] = mapped_column(primary_key=True)
    last_step: Mapped[int]
    last_rank: Mapped[int]
    last_wall_time: Mapped[float]
    last_step_time: Mapped[float]
    last_samples: Mapped[int]
    step_rows: Mapped[int]


MODELS = {"run": Run, "step": StepMetric, "event": Event, "host": HostSample,
          "metric": CustomMetric}
TABLES = {kind: model.__table__ for kind, model in MODELS.items()}
