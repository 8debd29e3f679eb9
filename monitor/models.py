"""Typed SQLAlchemy models of Regatta's metrics tables.

Each row type a producer sends (``run``, ``step``, ``event``, ``host``) maps to one model
here, and its fields are exactly the model's columns: the models are the one definition
of the schema (monitor.store.validate_row derives its checks from them). The indexes
serve the dashboard's queries: a run's steps in order, and one host's slots.
"""
from __future__ import annotations

from typing import Optional

from sqlalchemy import Index, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

RUN_STATUSES = ("running", "finished", "failed")


class Base(DeclarativeBase):
    """Declarative base of every Regatta table."""


class Run(Base):
    """One training run; later ``run`` rows update its status and finish time."""

    __tablename__ = "run"
    id: Mapped[str] = mapped_column(String, primary_key=True)
    job: Mapped[str]
    status: Mapped[str] = mapped_column(info={"choices": RUN_STATUSES})
    started_at: Mapped[float]
    finished_at: Mapped[Optional[float]]
    config: Mapped[str] = mapped_column(Text, default="{}", info={"json": True})
    launcher: Mapped[str] = mapped_column(default="local")


class StepMetric(Base):
    """What one rank measured during one optimizer step."""

    __tablename__ = "step_metric"
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[str]
    step: Mapped[int]
    wall_time: Mapped[float]
    rank: Mapped[int]
    world_size: Mapped[int]
    host: Mapped[str]
    slot: Mapped[int] = mapped_column(default=0)
    stage: Mapped[int] = mapped_column(default=0)
    step_time: Mapped[float]
    data_time: Mapped[float] = mapped_column(default=0.0)
    compute_time: Mapped[float] = mapped_column(default=0.0)
    comm_time: Mapped[float] = mapped_column(default=0.0)
    wait_time: Mapped[float] = mapped_column(default=0.0)
    samples: Mapped[int] = mapped_column(default=0)
    bytes_sent: Mapped[int] = mapped_column(default=0)
    loss: Mapped[Optional[float]]
    lr: Mapped[Optional[float]]
    uid: Mapped[Optional[str]] = mapped_column(unique=True)
    __table_args__ = (
        Index("ix_step_run_step", "run_id", "step"),
        Index("ix_step_run_host_slot", "run_id", "host", "slot"),
    )


class Event(Base):
    """Something that happened to the run: commit, restore, reset, failure, ..."""

    __tablename__ = "event"
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[str]
    wall_time: Mapped[float]
    step: Mapped[Optional[int]]
    kind: Mapped[str]
    host: Mapped[Optional[str]]
    rank: Mapped[Optional[int]]
    detail: Mapped[str] = mapped_column(Text, default="{}", info={"json": True})
    uid: Mapped[Optional[str]] = mapped_column(unique=True)
    __table_args__ = (
        Index("ix_event_run_time", "run_id", "wall_time"),
        Index("ix_event_run_kind", "run_id", "kind"),
    )


class HostSample(Base):
    """A periodic resource sample of one host."""

    __tablename__ = "host_sample"
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[str]
    host: Mapped[str]
    wall_time: Mapped[float]
    cpu_percent: Mapped[float]
    rss_bytes: Mapped[int]
    gpu_util: Mapped[Optional[float]]
    gpu_mem: Mapped[Optional[int]]
    uid: Mapped[Optional[str]] = mapped_column(unique=True)
    __table_args__ = (Index("ix_host_run_host_time", "run_id", "host", "wall_time"),)


MODELS = {"run": Run, "step": StepMetric, "event": Event, "host": HostSample}
