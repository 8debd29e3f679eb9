"""Step-metric series of one run: per rank, process, host or the whole run; imbalance;
world size over time; pipeline stages. Each function takes the Store first (they are the
Store's read methods, see monitor.queries) and returns JSON-ready dicts.

Series are downsampled in SQL: when a run has more steps than ``max_points``, consecutive
steps are grouped into buckets of equal width and each bucket becomes one point (the
mean of its steps, at the bucket's first step). A step one process recorded twice (an
elastic restore replays the steps since the last commit) is first folded into one value.
A process is (host, slot): that survives the renumbering of ranks at a reset.
"""
from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Optional

from sqlalchemy import Float, String, case, cast, func, literal, null, select

from monitor.models import StepMetric

MAX_POINTS = 500
BY = ("rank", "slot", "host", "all")
HOST_SUM = ("samples", "bytes_sent", "samples_per_s")   # summed over processes, not averaged
SERIES_METRICS = ("step_time", "data_time", "compute_time", "comm_time", "wait_time",
                  "samples", "bytes_sent", "loss", "lr", "world_size", "stage", "replica",
                  "bubble", "overlap", "samples_per_s", "comm_fraction", "bus_bandwidth")


def avg(expr):
    """AVG as a float on every database (PostgreSQL's AVG of integers is numeric)."""
    return cast(func.avg(expr), Float)


def total(expr):
    return cast(func.sum(expr), Float)


def _divisor(seconds):
    """A time to divide by, or NULL below a picosecond: with the stored values' bounds
    (monitor.models) no ratio can then overflow, which PostgreSQL would raise."""
    return case((seconds >= 1e-12, seconds), else_=null())


def metric_expr(s, metric: str):
    """SQL expression of a (possibly derived) metric over StepMetric columns ``s``."""
    if metric not in SERIES_METRICS:
        raise ValueError(f"unknown metric {metric!r}; expected one of {SERIES_METRICS}")
    if metric == "samples_per_s":
        return cast(s.samples, Float) / _divisor(s.step_time)
    if metric == "comm_fraction":
        return s.comm_time / _divisor(s.step_time)
    if metric == "bus_bandwidth":  # NCCL's bus bandwidth of a ring allreduce
        size = cast(s.world_size, Float)
        return cast(s.bytes_sent, Float) * 2.0 * (size - 1.0) / size / _divisor(s.comm_time)
    return getattr(s, metric)


def bucket_width(lo: Optional[int], hi: Optional[int], max_points: int) -> int:
    """Steps per point so that lo..hi fits in max_points points."""
    if lo is None or hi is None:
        return 1
    return max(1, math.ceil((hi - lo + 1) / max(1, max_points)))


def _where(run_id: str, since=None, start=None, stop=None) -> list:
    s = StepMetric
    where = [s.run_id == run_id]
    if since is not None:
        where.append(s.step > since)
    if start is not None:
        where.append(s.step >= start)
    if stop is not None:
        where.append(s.step <= stop)
    return where


def series(store, run_id: str, metric: str, by: str = "rank", since: Optional[int] = None,
           start: Optional[int] = None, stop: Optional[int] = None,
           max_points: int = MAX_POINTS, fold_by_rank: bool = False) -> dict:
    """One series per rank, process ("host:slot"), host, or the whole run ("all").

    Each point is (first step of its bucket, wall time of that step, mean value over the
    bucket, and for processes the highest rank it had there: ranks change only at a
    reset); the time of a step is its latest execution. ``cursor`` is the last step the answer covers: poll with since=cursor.
    ``fold_by_rank`` folds replays per (host, rank) instead of per process.
    """
    s = StepMetric
    if by not in BY:
        raise ValueError(f"by must be one of {BY}, got {by!r}")
    expr = metric_expr(s, metric)
    where = _where(run_id, since, start, stop) + [expr.isnot(None)]
    lo, hi = store.first(select(func.min(s.step), func.max(s.step)).where(*where))
    width = bucket_width(lo, hi, max_points)
    # 1: one value per process and step, folding a replayed step into one.
    ident = [s.host, s.rank] if by == "rank" or fold_by_rank else [s.host, s.slot]
    per = (select(s.host, func.max(s.slot).label("slot"), func.max(s.rank).label("rank"), s.step,
                  avg(expr).label("v"), func.max(s.wall_time).label("t"))
           .where(*where).group_by(*ident, s.step).subquery())
    if by == "rank":
        src = select(per.c.rank.label("key"), per.c.step, per.c.v, per.c.t,
                     per.c.rank.label("r")).subquery()
    else:
        # 2: one value per (key, step): additive metrics summed over processes.
        agg = total if metric in HOST_SUM else avg
        key, group = {"slot": (per.c.host + ":" + cast(per.c.slot, String),
                               [per.c.host, per.c.slot]),
                      "host": (per.c.host, [per.c.host]),
                      "all": (literal("all", String), [])}[by]
        src = (select(key.label("key"), per.c.step, agg(per.c.v).label("v"),
                      func.max(per.c.t).label("t"), func.max(per.c.rank).label("r"))
               .group_by(*group, per.c.step).subquery())
    bucket = (src.c.step - (lo or 0)) // width   # 3: one value per (key, bucket of steps)
    stmt = (select(src.c.key, func.min(src.c.step).label("first"), func.min(src.c.t),
                   avg(src.c.v), func.max(src.c.r))
            .group_by(src.c.key, bucket).order_by(src.c.key, "first"))
    out: dict = {}
    for key, first, t, v, rank in store.all(stmt):
        entry = out.setdefault(key, {"key": key, "step": [], "time": [], "value": []})
        entry["step"].append(first)
        entry["time"].append(t)
        entry["value"].append(v)
        if by == "slot":
            entry.setdefault("rank", []).append(rank)
    return {"metric": metric, "by": by, "bucket": width,
            "cursor": hi if hi is not None else since, "series": list(out.values())}


def step_series(store, run_id: str, metric: str, by: str = "rank",
                since_step: Optional[int] = None, max_points: int = MAX_POINTS) -> dict:
    """One series per rank (or per host) without wall times: {"metric", "by", "bucket",
    "series": [{"key", "step", "value"}]}; replays folded per (host, rank)."""
    if by not in ("rank", "host"):
        raise ValueError(f"by must be 'rank' or 'host', got {by!r}")
    out = series(store, run_id, metric, by, since=since_step, max_points=max_points,
                 fold_by_rank=True)
    return {"metric": metric, "by": by, "bucket": out["bucket"],
            "series": [{"key": e["key"], "step": e["step"], "value": e["value"]}
                       for e in out["series"]]}


def step_times(store, run_id: str, steps: list[int]) -> list[Optional[float]]:
    """Wall time at which each of ``steps`` was last completed (None if never)."""
    if not steps:
        return []
    s = StepMetric
    found = dict(store.all(select(s.step, func.max(s.wall_time))
                           .where(s.run_id == run_id, s.step.in_(sorted(set(steps))))
                           .group_by(s.step)))
    return [found.get(step) for step in steps]


def imbalance(store, run_id: str, since: Optional[int] = None,
              max_points: int = MAX_POINTS) -> dict:
    """Per step, max/median across ranks of step_time and of compute_time (1.0: perfectly
    balanced; None where the median is 0), downsampled like series, with wall times."""
    s = StepMetric
    stmt = (select(s.step, avg(s.step_time), avg(s.compute_time))
            .where(*_where(run_id, since)).group_by(s.step, s.rank).order_by(s.step))
    per_step: dict = defaultdict(lambda: ([], []))
    for step, step_time, compute_time in store.all(stmt):
        per_step[step][0].append(step_time)
        per_step[step][1].append(compute_time)
    steps = sorted(per_step)
    width = bucket_width(steps[0] if steps else None, steps[-1] if steps else None, max_points)
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
    out["time"] = step_times(store, run_id, out["step"])
    out["cursor"] = steps[-1] if steps else since
    return out


def timeline(store, run_id: str, since: Optional[int] = None,
             max_points: int = MAX_POINTS) -> dict:
    """World size over time: one point per executed (step, world size), in wall-time order.

    A replayed step appears again at its later time (the step axis goes back: those are
    the steps a failure cost). Thinned to about ``max_points`` points, always keeping the
    points where the world size changes, so resizes stay exact.
    """
    s = StepMetric
    rows = store.all(select(s.step, func.min(s.wall_time).label("t"), s.world_size)
                     .where(*_where(run_id, since)).group_by(s.step, s.world_size)
                     .order_by("t"))
    keep_every = max(1, len(rows) // max(1, max_points))
    out = {"step": [], "time": [], "world_size": [], "cursor": since}
    for i, (step, t, size) in enumerate(rows):
        changed = i == 0 or i == len(rows) - 1 or size != rows[i - 1][2] \
            or (i + 1 < len(rows) and size != rows[i + 1][2])
        if changed or i % keep_every == 0:
            out["step"].append(step)
            out["time"].append(t)
            out["world_size"].append(size)
    if rows:
        out["cursor"] = max(step for step, _, _ in rows)
    return out


def pipeline(store, run_id: str, max_points: int = MAX_POINTS) -> Optional[dict]:
    """Per pipeline stage and step bucket: busy time (compute+comm, mean over the stage's
    ranks), step time and bubble = 1 - busy/step_time (or the stage's own ``bubble``
    when its rows carry one); None when no stage > 0 exists. ``overall`` is the run's
    bubble 1 - sum(busy)/(stages*step_time), per DESIGN.md."""
    s = StepMetric
    if not store.first(select(func.max(s.stage)).where(s.run_id == run_id))[0]:
        return None
    lo, hi = store.first(select(func.min(s.step), func.max(s.step)).where(s.run_id == run_id))
    width = bucket_width(lo, hi, max_points)
    busy = s.compute_time + s.comm_time
    stmt = (select(s.stage, func.min(s.step).label("first"), avg(busy), avg(s.step_time),
                   avg(s.bubble)).where(s.run_id == run_id)
            .group_by(s.stage, (s.step - lo) // width).order_by(s.stage, "first"))
    stages: dict = {}
    for stage, first, b, st, measured in store.all(stmt):
        entry = stages.setdefault(stage, {"stage": stage, "step": [], "busy": [],
                                          "step_time": [], "bubble": []})
        entry["step"].append(first)
        entry["busy"].append(b)
        entry["step_time"].append(st)
        entry["bubble"].append(measured if measured is not None
                               else (1 - b / st if st else None))
    totals = store.all(select(s.stage, avg(busy), avg(s.step_time))
                       .where(s.run_id == run_id).group_by(s.stage))
    total_busy = sum(b for _, b, _ in totals)
    capacity = len(totals) * max(st for _, _, st in totals)
    return {"bucket": width, "stages": list(stages.values()),
            "overall": 1 - total_busy / capacity if capacity else None}


def _max_over_median(values: list) -> Optional[float]:
    med = statistics.median(values)
    return max(values) / med if med > 0 else None


def _mean(values: list) -> Optional[float]:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None
