"""Read-side helpers of the Store: what the dashboard and the API ask for.

Every helper returns plain dicts and lists (JSON-ready). Series are downsampled in SQL:
when a run has more steps than ``max_points``, consecutive steps are grouped into buckets
of equal width and each bucket becomes one point (the mean of its steps, at the bucket's
first step), so a browser never receives more than ``max_points`` points per series.

A step can be recorded twice by the same rank when an elastic restore rolls training back
to the last commit; every helper first averages such repeats per (rank, step) so that a
replayed step counts once.
"""
from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from typing import Optional

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from monitor.models import MODELS, Event, Run, StepMetric

MAX_POINTS = 500

# metric -> (how it is computed from one step row, how ranks on one host combine)
_HOST_SUM = ("samples", "bytes_sent", "samples_per_s")
SERIES_METRICS = ("step_time", "data_time", "compute_time", "comm_time", "wait_time",
                  "samples", "bytes_sent", "loss", "lr", "world_size", "stage",
                  "samples_per_s", "comm_fraction", "bus_bandwidth")


def _metric_expr(s, metric: str):
    """SQL expression of a (possibly derived) metric over StepMetric columns ``s``."""
    if metric not in SERIES_METRICS:
        raise ValueError(f"unknown metric {metric!r}; expected one of {SERIES_METRICS}")
    if metric == "samples_per_s":
        return s.samples * 1.0 / func.nullif(s.step_time, 0)
    if metric == "comm_fraction":
        return s.comm_time / func.nullif(s.step_time, 0)
    if metric == "bus_bandwidth":  # NCCL's bus bandwidth of a ring allreduce
        return (s.bytes_sent * 2.0 * (s.world_size - 1) / s.world_size
                / func.nullif(s.comm_time, 0))
    return getattr(s, metric)


def _bucket_width(lo: Optional[int], hi: Optional[int], max_points: int) -> int:
    """Steps per point so that lo..hi fits in max_points points."""
    if lo is None or hi is None:
        return 1
    return max(1, math.ceil((hi - lo + 1) / max(1, max_points)))


class Queries:
    """Mixed into Store; needs ``self.engine``."""

    def _all(self, stmt) -> list:
        with self.engine.connect() as conn:
            return list(conn.execute(stmt))

    def runs(self) -> list[dict]:
        """Every run, newest first, with its last recorded step."""
        last = (select(StepMetric.run_id, func.max(StepMetric.step).label("last_step"))
                .group_by(StepMetric.run_id).subquery())
        stmt = (select(Run, last.c.last_step).outerjoin(last, last.c.run_id == Run.id)
                .order_by(Run.started_at.desc(), Run.id))
        return [_run_dict(run, last_step) for run, last_step in self._all_orm(stmt)]

    def _all_orm(self, stmt) -> list:
        with Session(self.engine) as session:
            return [tuple(row) for row in session.execute(stmt)]

    def run(self, run_id: str) -> Optional[dict]:
        """One run with a summary of what was recorded, or None if it is unknown."""
        rows = self._all_orm(select(Run).where(Run.id == run_id))
        if not rows:
            return None
        s = StepMetric
        summary = self._all(select(func.max(s.step), func.count(), func.count(s.rank.distinct()))
                            .where(s.run_id == run_id))[0]
        hosts = self._all(select(s.host).where(s.run_id == run_id).distinct().order_by(s.host))
        n_events = self._all(select(func.count()).select_from(Event)
                             .where(Event.run_id == run_id))[0][0]
        out = _run_dict(rows[0][0], summary[0])
        out.update(step_rows=summary[1], ranks=summary[2], hosts=[h for (h,) in hosts],
                   events=n_events)
        return out

    def count(self, kind: str, run_id: Optional[str] = None) -> int:
        """Number of stored rows of one type (``run``, ``step``, ``event``, ``host``)."""
        model = MODELS[kind]
        stmt = select(func.count()).select_from(model)
        if run_id is not None:
            stmt = stmt.where((model.id if kind == "run" else model.run_id) == run_id)
        return self._all(stmt)[0][0]

    def step_series(self, run_id: str, metric: str, by: str = "rank",
                    since_step: Optional[int] = None, max_points: int = MAX_POINTS) -> dict:
        """One series per rank (or per host) of a step metric, downsampled by step bucket.

        By host, additive metrics (samples, bytes_sent, samples_per_s) are summed over the
        host's ranks and the others averaged. ``since_step`` keeps steps strictly after it.
        Returns {"metric", "by", "bucket", "series": [{"key", "step": [], "value": []}]}.
        """
        s = StepMetric
        if by not in ("rank", "host"):
            raise ValueError(f"by must be 'rank' or 'host', got {by!r}")
        expr = _metric_expr(s, metric)
        where = [s.run_id == run_id, expr.isnot(None)]
        if since_step is not None:
            where.append(s.step > since_step)
        lo, hi = self._all(select(func.min(s.step), func.max(s.step)).where(*where))[0]
        width = _bucket_width(lo, hi, max_points)
        # 1: one value per (rank, step), folding replayed steps together.
        per_rank = (select(s.host, s.rank, s.step, func.avg(expr).label("v")).where(*where)
                    .group_by(s.host, s.rank, s.step).subquery())
        # 2: one value per (key, step).
        if by == "rank":
            key, step, value, src = per_rank.c.rank, per_rank.c.step, per_rank.c.v, per_rank
        else:
            agg = func.sum if metric in _HOST_SUM else func.avg
            src = (select(per_rank.c.host.label("key"), per_rank.c.step, agg(per_rank.c.v)
                          .label("v")).group_by(per_rank.c.host, per_rank.c.step).subquery())
            key, step, value = src.c.key, src.c.step, src.c.v
        # 3: one value per (key, bucket of steps).
        bucket = (step - (lo or 0)) // width
        stmt = (select(key, func.min(step).label("first"), func.avg(value))
                .group_by(key, bucket).order_by(key, "first"))
        series: dict = {}
        for k, first, v in self._all(stmt):
            entry = series.setdefault(k, {"key": k, "step": [], "value": []})
            entry["step"].append(first)
            entry["value"].append(v)
        return {"metric": metric, "by": by, "bucket": width, "series": list(series.values())}

    def throughput(self, run_id: str, **kw) -> dict:
        """Samples per second per host and step: sum over the host's ranks of samples/step_time."""
        return self.step_series(run_id, "samples_per_s", by="host", **kw)

    def comm_fraction(self, run_id: str, by: str = "rank", **kw) -> dict:
        """comm_time / step_time per rank (or host mean) and step."""
        return self.step_series(run_id, "comm_fraction", by=by, **kw)

    def bus_bandwidth(self, run_id: str, by: str = "rank", **kw) -> dict:
        """Effective bus bandwidth bytes*2(p-1)/p/comm_time in bytes/s, per rank and step."""
        return self.step_series(run_id, "bus_bandwidth", by=by, **kw)

    def imbalance(self, run_id: str, since_step: Optional[int] = None,
                  max_points: int = MAX_POINTS) -> dict:
        """Per step, max/median across ranks of step_time and of compute_time.

        1.0 means perfectly balanced. Returns {"bucket", "step": [], "step_time": [],
        "compute_time": []} (None where the median is 0), downsampled like step_series.
        """
        s = StepMetric
        where = [s.run_id == run_id] + ([s.step > since_step] if since_step is not None else [])
        stmt = (select(s.step, func.avg(s.step_time), func.avg(s.compute_time)).where(*where)
                .group_by(s.step, s.rank).order_by(s.step))
        per_step: dict = defaultdict(lambda: ([], []))
        for step, step_time, compute_time in self._all(stmt):
            per_step[step][0].append(step_time)
            per_step[step][1].append(compute_time)
        steps = sorted(per_step)
        width = _bucket_width(steps[0] if steps else None, steps[-1] if steps else None,
                              max_points)
        buckets: dict = {}
        for step in steps:
            b = buckets.setdefault((step - steps[0]) // width, (step, [], []))
            for values, out in zip(per_step[step], b[1:]):
                out.append(_max_over_median(values))
        out = {"bucket": width, "step": [], "step_time": [], "compute_time": []}
        for first, st, ct in buckets.values():
            out["step"].append(first)
            out["step_time"].append(_mean(st))
            out["compute_time"].append(_mean(ct))
        return out

    def events(self, run_id: str, kinds: Optional[list[str]] = None) -> list[dict]:
        """The run's events in time order, ``detail`` decoded; optionally only some kinds."""
        e = Event
        stmt = select(e).where(e.run_id == run_id).order_by(e.wall_time, e.id)
        if kinds:
            stmt = stmt.where(e.kind.in_(list(kinds)))
        return [{"id": ev.id, "run_id": ev.run_id, "wall_time": ev.wall_time, "step": ev.step,
                 "kind": ev.kind, "host": ev.host, "rank": ev.rank,
                 "detail": json.loads(ev.detail), "uid": ev.uid}
                for (ev,) in self._all_orm(stmt)]


def _max_over_median(values: list) -> Optional[float]:
    med = statistics.median(values)
    return max(values) / med if med > 0 else None


def _mean(values: list) -> Optional[float]:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def _run_dict(run, last_step) -> dict:
    return {"id": run.id, "job": run.job, "status": run.status, "started_at": run.started_at,
            "finished_at": run.finished_at, "config": json.loads(run.config),
            "launcher": run.launcher, "last_step": last_step}
