"""Read helpers the dashboard needs beyond monitor.queries, over the same Store.

Like monitor.queries they return JSON-ready dicts and lists and fold a step that one rank
recorded twice (an elastic restore replays the steps since the last commit) into one
value. They live here, not in monitor/, because their shapes (a wall time on every point,
run summaries, recovery tables) exist for the dashboard only.
"""
from __future__ import annotations

import time
from typing import Iterator, Optional

from sqlalchemy import String, cast, func, literal, select

from monitor.models import MODELS, StepMetric
from monitor.queries import MAX_POINTS, SERIES_METRICS, _HOST_SUM, _metric_expr, _bucket_width
from monitor.store import Store

__all__ = ["series", "step_times", "imbalance", "timeline", "pipeline", "run_summaries", "export_rows",
           "SERIES_METRICS", "BY"]
BY = ("rank", "slot", "host", "all")


def _where(run_id: str, since: Optional[int], start: Optional[int], stop: Optional[int]):
    s = StepMetric
    where = [s.run_id == run_id]
    if since is not None:
        where.append(s.step > since)
    if start is not None:
        where.append(s.step >= start)
    if stop is not None:
        where.append(s.step <= stop)
    return where


def series(store: Store, run_id: str, metric: str, by: str = "rank",
           since: Optional[int] = None, start: Optional[int] = None,
           stop: Optional[int] = None, max_points: int = MAX_POINTS) -> dict:
    """Like Store.step_series, plus a wall time per point, a step range, ``by="slot"``
    (one series per process, keyed "host/slot") and ``by="all"`` (the whole run).

    Each point is (first step of its bucket, wall time of that step, mean value over the
    bucket); the time of a step is its latest execution (a replayed step counts where it
    was last done). ``cursor`` is the last step the answer covers: poll with since=cursor.
    """
    s = StepMetric
    if by not in BY:
        raise ValueError(f"by must be one of {BY}, got {by!r}")
    expr = _metric_expr(s, metric)
    where = _where(run_id, since, start, stop) + [expr.isnot(None)]
    lo, hi = store._all(select(func.min(s.step), func.max(s.step)).where(*where))[0]
    width = _bucket_width(lo, hi, max_points)
    # 1: one value per process and step, folding a replayed step into one. Per rank, a
    # process is (host, rank) as in Store.step_series; for the other groupings it is
    # (host, slot), which survives the renumbering of ranks at a reset: folding by rank
    # would count a step replayed under a new rank twice in a host's sum.
    ident = [s.host, s.rank] if by == "rank" else [s.host, s.slot]
    per_rank = (select(s.host, s.slot, s.rank, s.step, func.avg(expr).label("v"),
                       func.max(s.wall_time).label("t"))
                .where(*where).group_by(*ident, s.step).subquery())
    p = per_rank.c
    if by == "rank":
        src = select(p.rank.label("key"), p.step, p.v, p.t).subquery()
    else:
        # 2: one value per (key, step): additive metrics summed over processes, others averaged.
        agg = func.sum if metric in _HOST_SUM else func.avg
        key, group = {"slot": (p.host + "/" + cast(p.slot, String), [p.host, p.slot]),
                      "host": (p.host, [p.host]), "all": (literal("all"), [])}[by]
        src = (select(key.label("key"), p.step, agg(p.v).label("v"), func.max(p.t).label("t"))
               .group_by(*group, p.step).subquery())
    bucket = (src.c.step - (lo or 0)) // width  # 3: one value per (key, bucket of steps)
    stmt = (select(src.c.key, func.min(src.c.step).label("first"), func.min(src.c.t),
                   func.avg(src.c.v)).group_by(src.c.key, bucket).order_by(src.c.key, "first"))
    out: dict = {}
    for key, first, t, v in store._all(stmt):
        entry = out.setdefault(key, {"key": key, "step": [], "time": [], "value": []})
        entry["step"].append(first)
        entry["time"].append(t)
        entry["value"].append(v)
    return {"metric": metric, "by": by, "bucket": width,
            "cursor": hi if hi is not None else since, "series": list(out.values())}


def step_times(store: Store, run_id: str, steps: list[int]) -> list[Optional[float]]:
    """Wall time at which each of ``steps`` was last completed (None if never)."""
    if not steps:
        return []
    s = StepMetric
    rows = store._all(select(s.step, func.max(s.wall_time))
                      .where(s.run_id == run_id, s.step.in_(sorted(set(steps))))
                      .group_by(s.step))
    found = dict(rows)
    return [found.get(step) for step in steps]


def imbalance(store: Store, run_id: str, since: Optional[int] = None,
              max_points: int = MAX_POINTS) -> dict:
    """Store.imbalance with the wall time of each point and the polling cursor."""
    out = store.imbalance(run_id, since_step=since, max_points=max_points)
    out["time"] = step_times(store, run_id, out["step"])
    s = StepMetric
    last = store._all(select(func.max(s.step)).where(*_where(run_id, since, None, None)))[0][0]
    out["cursor"] = last if last is not None else since
    return out


def timeline(store: Store, run_id: str, since: Optional[int] = None,
             max_points: int = MAX_POINTS) -> dict:
    """World size over time: one point per executed (step, world size), in wall-time order.

    A replayed step appears again at its later time (the step axis goes back: those are
    the steps a failure cost). Thinned to about ``max_points`` points, always keeping the
    points where the world size changes, so resizes stay exact.
    """
    s = StepMetric
    rows = store._all(select(s.step, func.min(s.wall_time).label("t"), s.world_size)
                      .where(*_where(run_id, since, None, None))
                      .group_by(s.step, s.world_size).order_by("t"))
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


def pipeline(store: Store, run_id: str, max_points: int = MAX_POINTS) -> Optional[dict]:
    """Per pipeline stage and step bucket: busy time (compute+comm, mean over the stage's
    ranks), step time and bubble = 1 - busy/step_time; None when no stage > 0 exists.
    ``overall`` is the run's bubble 1 - sum(busy)/(stages*step_time), per DESIGN.md."""
    s = StepMetric
    if not store._all(select(func.max(s.stage)).where(s.run_id == run_id))[0][0]:
        return None
    lo, hi = store._all(select(func.min(s.step), func.max(s.step))
                        .where(s.run_id == run_id))[0]
    width = _bucket_width(lo, hi, max_points)
    busy = s.compute_time + s.comm_time
    stmt = (select(s.stage, func.min(s.step).label("first"), func.avg(busy),
                   func.avg(s.step_time)).where(s.run_id == run_id)
            .group_by(s.stage, (s.step - lo) // width).order_by(s.stage, "first"))
    stages: dict = {}
    for stage, first, b, st in store._all(stmt):
        entry = stages.setdefault(stage, {"stage": stage, "step": [], "busy": [],
                                          "step_time": [], "bubble": []})
        entry["step"].append(first)
        entry["busy"].append(b)
        entry["step_time"].append(st)
        entry["bubble"].append(1 - b / st if st else None)
    totals = store._all(select(s.stage, func.avg(busy), func.avg(s.step_time))
                        .where(s.run_id == run_id).group_by(s.stage))
    total_busy = sum(b for _, b, _ in totals)
    capacity = len(totals) * max(st for _, _, st in totals)
    return {"bucket": width, "stages": list(stages.values()),
            "overall": 1 - total_busy / capacity if capacity else None}


def _step_aggregates(store: Store, run_id: Optional[str]) -> dict:
    """Per run: world size min/max/latest, first/last step time, samples done once."""
    s = StepMetric
    only = [s.run_id == run_id] if run_id is not None else []
    per_rank = (select(s.run_id, s.rank, s.step, func.avg(s.samples).label("samples"))
                .where(*only).group_by(s.run_id, s.rank, s.step).subquery())
    samples = dict(store._all(select(per_rank.c.run_id, func.sum(per_rank.c.samples))
                              .group_by(per_rank.c.run_id)))
    latest = (select(s.run_id, func.max(s.wall_time).label("t")).where(*only)
              .group_by(s.run_id).subquery())
    now_size = dict(store._all(select(s.run_id, func.max(s.world_size))
                               .join(latest, (latest.c.run_id == s.run_id)
                                     & (latest.c.t == s.wall_time)).group_by(s.run_id)))
    out = {}
    for rid, lo, hi, t0, t1 in store._all(
            select(s.run_id, func.min(s.world_size), func.max(s.world_size),
                   func.min(s.wall_time), func.max(s.wall_time)).where(*only)
            .group_by(s.run_id)):
        span = t1 - t0
        out[rid] = {"world_size": now_size.get(rid), "world_size_min": lo,
                    "world_size_max": hi, "last_step_at": t1,
                    # effective: replayed steps count once, recovery time counts as time
                    "throughput": samples.get(rid, 0) / span if span > 0 else None}
    return out


def run_summaries(store: Store, recoveries_of, run_id: Optional[str] = None) -> list[dict]:
    """Store.runs() (or just ``run_id``) plus what the runs list shows: world size now,
    min and max, effective throughput (samples/s), duration, failures seen and survived.
    ``recoveries_of(events)`` turns a run's events into its recovery table."""
    aggregates = _step_aggregates(store, run_id)
    now = time.time()
    out = []
    for run in store.runs():
        if run_id is not None and run["id"] != run_id:
            continue
        agg = aggregates.get(run["id"], {})
        table = recoveries_of(store.events(run["id"], kinds=_TRIGGER_AND_PHASES))
        end = run["finished_at"] or (now if run["status"] == "running"
                                     else agg.get("last_step_at") or run["started_at"])
        run.update({k: agg.get(k) for k in ("world_size", "world_size_min", "world_size_max",
                                            "throughput", "last_step_at")})
        run["duration_s"] = max(0.0, end - run["started_at"])
        failures = [r for r in table if r["kind"] in ("failure", "peer_lost")]
        run["failures"] = len(failures)
        run["failures_survived"] = sum(1 for r in failures if r["first_step_done_s"] is not None)
        out.append(run)
    return out


_TRIGGER_AND_PHASES = ["failure", "host_added", "host_removed", "peer_lost", "restore",
                       "reset", "sync", "resumed"]


def export_rows(store: Store, kind: str, run_id: Optional[str] = None
                ) -> tuple[list[str], Iterator[tuple]]:
    """Column names and a lazy iterator over every stored row of ``kind`` (one run or all),
    in insertion order, so an export of a large store streams instead of loading it."""
    model = MODELS[kind]
    table = model.__table__
    columns = [c.name for c in table.columns]
    stmt = select(table).order_by(table.c.id if kind != "run" else table.c.started_at)
    if run_id is not None:
        stmt = stmt.where((table.c.id if kind == "run" else table.c.run_id) == run_id)

    def rows() -> Iterator[tuple]:
        with store.engine.connect() as conn:
            yield from conn.execute(stmt)
    return columns, rows()
