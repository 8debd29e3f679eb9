"""Runs as the dashboard lists them: one query over the run table and its kept summary
(monitor.rollup), never over the step rows, so the list stays fast at millions of rows.
Also the run's events and user-logged metrics, run management (name, tags, notes,
delete) and streamed exports. Functions take the Store first (see monitor.queries).

Rows already in a store are read defensively: a ``config``, ``tags`` or ``detail`` that is
not the JSON it should be (a store written by an older or foreign producer) reads as
empty, with ``config_error``/``detail_error`` saying so, instead of failing the page.
"""
from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from typing import Iterator, Optional

from sqlalchemy import delete, func, or_, select, update

from monitor.models import MODELS, CustomMetric, Event, HostSample, Run, RunProcess, StepMetric
from monitor.recovery import KINDS as RECOVERY_KINDS, recoveries
from monitor.schema import RowError, check_tags

LOST_AFTER_S = 300.0   # a running run silent this long is shown as lost
_LIKE_ESCAPE = "\\"


def decode_object(text) -> tuple[dict, Optional[str]]:
    """(the JSON object in ``text``, None) or ({}, what is wrong with it)."""
    try:
        value = json.loads(text) if isinstance(text, (str, bytes)) else text
    except (ValueError, RecursionError) as exc:
        return {}, f"not JSON: {str(exc)[:100]}"
    if not isinstance(value, dict):
        return {}, f"a JSON {type(value).__name__}, not an object"
    return value, None


def decode_tags(text) -> list[str]:
    try:
        value = json.loads(text) if isinstance(text, str) else text
    except (ValueError, RecursionError):
        return []
    return [t for t in value if isinstance(t, str)] if isinstance(value, list) else []


def _contains(text: str) -> str:
    """A LIKE pattern matching ``text`` anywhere, its wildcards escaped."""
    return "%" + "".join(_LIKE_ESCAPE + c if c in "%_\\" else c for c in text) + "%"


def status_of(run, now: float, lost_after: float = LOST_AFTER_S) -> str:
    """The stored status, or ``lost`` for a running run whose rows stopped coming."""
    if run.status != "running":
        return run.status
    seen = run.last_seen_at if run.last_seen_at is not None else run.started_at
    return "lost" if _finite(seen) and now - seen > lost_after else "running"


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def run_dict(run, now: Optional[float] = None, lost_after: float = LOST_AFTER_S) -> dict:
    now = time.time() if now is None else now
    config, config_error = decode_object(run.config)
    status = status_of(run, now, lost_after)
    span = (run.last_step_at - run.first_step_at) if run.first_step_at is not None else None
    end = run.finished_at or (now if status == "running" else
                              run.last_seen_at or run.last_step_at or run.started_at)
    out = {"id": run.id, "job": run.job, "status": status, "stored_status": run.status,
           "started_at": run.started_at, "finished_at": run.finished_at, "config": config,
           "launcher": run.launcher, "name": run.name, "tags": decode_tags(run.tags),
           "notes": run.notes or "", "error": run.error, "code_revision": run.code_revision,
           "last_step": run.last_step, "step_rows": run.step_rows or 0,
           "world_size": run.world_size, "world_size_min": run.world_size_min,
           "world_size_max": run.world_size_max, "last_step_at": run.last_step_at,
           "last_seen_at": run.last_seen_at,
           # effective: replayed steps count once, recovery time counts as time
           "throughput": (run.samples_done or 0) / span if span and span > 0 else None,
           "duration_s": max(0.0, end - run.started_at) if _finite(end) else None}
    if config_error:
        out["config_error"] = config_error
    return out


def runs(store, q: str = "", status: Optional[str] = None, tag: Optional[str] = None,
         job: Optional[str] = None, limit: int = 500, offset: int = 0,
         lost_after: float = LOST_AFTER_S) -> dict:
    """Runs newest first, filtered: ``q`` is a case-insensitive substring of the id, name,
    job, tags or notes; ``status`` one of monitor.models.READ_STATUSES. Returns
    {"runs": [...], "total": matching runs}; each run with its failures (seen, survived)."""
    now = time.time()
    where = []
    if q:
        pattern = _contains(q.lower())
        where.append(or_(*[func.lower(col).like(pattern, escape=_LIKE_ESCAPE)
                           for col in (Run.id, Run.name, Run.job, Run.tags, Run.notes)]))
    if job:
        where.append(Run.job == job)
    if tag:   # tags are stored as a JSON list: look for the tag as a JSON string
        where.append(Run.tags.like(_contains(json.dumps(tag)), escape=_LIKE_ESCAPE))
    silent = func.coalesce(Run.last_seen_at, Run.started_at) < now - lost_after
    if status == "lost":
        where += [Run.status == "running", silent]
    elif status == "running":
        where += [Run.status == "running", ~silent]
    elif status:
        where.append(Run.status == status)
    total = store.first(select(func.count()).select_from(Run).where(*where))[0]
    stmt = (select(Run).where(*where).order_by(Run.started_at.desc(), Run.id)
            .limit(limit).offset(offset))
    found = [run_dict(run, now, lost_after) for (run,) in store.all_orm(stmt)]
    _add_failures(store, found)
    return {"runs": found, "total": total}


def _add_failures(store, found: list[dict]) -> None:
    """Failures seen and survived per run, from the events that make the recovery table
    (a few per failure; commits and steps are not read)."""
    if not found:
        return
    by_run: dict = defaultdict(list)
    for i in range(0, len(found), 500):
        ids = [r["id"] for r in found[i:i + 500]]
        for ev in _event_rows(store, select(Event).where(Event.run_id.in_(ids),
                                                           Event.kind.in_(RECOVERY_KINDS))):
            by_run[ev["run_id"]].append(ev)
    for run in found:
        failures = [r for r in recoveries(by_run.get(run["id"], [])) if r["kind"] == "failure"]
        run["failures"] = len(failures)
        run["failures_survived"] = sum(1 for r in failures if r["first_step_done_s"] is not None)


def run(store, run_id: str, lost_after: float = LOST_AFTER_S) -> Optional[dict]:
    """One run with its summary, processes, hosts and event count, or None if unknown."""
    rows = store.all_orm(select(Run).where(Run.id == run_id))
    if not rows:
        return None
    out = run_dict(rows[0][0], lost_after=lost_after)
    procs = store.all(select(RunProcess.host, RunProcess.slot, RunProcess.last_rank,
                             RunProcess.last_step, RunProcess.last_wall_time)
                      .where(RunProcess.run_id == run_id)
                      .order_by(RunProcess.host, RunProcess.slot))
    out["processes"] = [{"key": f"{h}:{s}", "host": h, "slot": s, "rank": r, "last_step": st,
                         "last_seen_at": t} for h, s, r, st, t in procs]
    out["hosts"] = sorted({p["host"] for p in out["processes"]})
    out["ranks"] = len(out["processes"])
    out["events"] = store.first(select(func.count()).select_from(Event)
                                .where(Event.run_id == run_id))[0]
    _add_failures(store, [out])
    return out


def _event_rows(store, stmt) -> list[dict]:
    out = []
    for (ev,) in store.all_orm(stmt):
        detail, error = decode_object(ev.detail)
        row = {"id": ev.id, "run_id": ev.run_id, "wall_time": ev.wall_time, "step": ev.step,
               "kind": ev.kind, "host": ev.host, "rank": ev.rank, "detail": detail,
               "uid": ev.uid}
        if error:
            row["detail_error"] = error
        out.append(row)
    return out


def events(store, run_id: str, kinds: Optional[list[str]] = None,
           since_id: Optional[int] = None) -> list[dict]:
    """The run's events in time order, ``detail`` decoded; optionally only some kinds,
    or only those stored after the event id ``since_id``."""
    stmt = select(Event).where(Event.run_id == run_id).order_by(Event.wall_time, Event.id)
    if kinds:
        stmt = stmt.where(Event.kind.in_(list(kinds)))
    if since_id is not None:
        stmt = stmt.where(Event.id > since_id)
    return _event_rows(store, stmt)


def run_recoveries(store, run_id: str) -> list[dict]:
    return recoveries(events(store, run_id, kinds=list(RECOVERY_KINDS)))


def metric_names(store, run_id: str) -> list[dict]:
    """The names of the run's user-logged metrics, with how many values each has."""
    m = CustomMetric
    return [{"name": name, "count": n} for name, n in store.all(
        select(m.name, func.count()).where(m.run_id == run_id).group_by(m.name)
        .order_by(m.name))]


def metric_points(store, run_id: str, name: str, since_id: Optional[int] = None,
                  max_points: int = 2000) -> dict:
    """The values of one user-logged metric in logging order: step (None if it was
    logged without one), wall time, value, rank; at most ``max_points`` (thinned evenly,
    the newest kept). ``cursor`` is the id to poll with (since=cursor)."""
    m = CustomMetric
    stmt = (select(m.id, m.step, m.wall_time, m.value, m.rank)
            .where(m.run_id == run_id, m.name == name).order_by(m.wall_time, m.id))
    if since_id is not None:
        stmt = stmt.where(m.id > since_id)
    rows = store.all(stmt)
    every = max(1, math.ceil(len(rows) / max(1, max_points)))
    kept = [r for i, r in enumerate(rows) if (len(rows) - 1 - i) % every == 0]
    return {"name": name, "step": [r[1] for r in kept], "time": [r[2] for r in kept],
            "value": [r[3] for r in kept], "rank": [r[4] for r in kept],
            "cursor": max((r[0] for r in rows), default=since_id)}


def edit_run(store, run_id: str, changes: dict) -> Optional[dict]:
    """Set a run's ``name`` (str or None), ``tags`` (list of str) and/or ``notes`` (str);
    RowError naming the field if a value is refused, None if the run is unknown."""
    allowed = {"name", "tags", "notes"}
    unknown = sorted(set(changes) - allowed)
    if unknown:
        raise RowError(f"field '{unknown[0][:60]}': only name, tags and notes can be edited",
                       unknown[0][:60])
    values = {}
    if "name" in changes:
        name = changes["name"]
        if name is not None and (not isinstance(name, str) or len(name.strip()) > 200
                                 or any(ord(c) < 32 for c in name)):
            raise RowError("field 'name' must be a string of at most 200 characters without "
                           "control characters, or null", "name")
        values["name"] = name.strip() or None if isinstance(name, str) else None
    if "tags" in changes:
        values["tags"] = json.dumps(check_tags(changes["tags"]))
    if "notes" in changes:
        notes = changes["notes"]
        if not isinstance(notes, str) or len(notes) > 10_000 or "\x00" in notes:
            raise RowError("field 'notes' must be a string of at most 10000 characters", "notes")
        values["notes"] = notes
    with store.writer() as conn:
        done = conn.execute(update(Run).where(Run.id == run_id).values(**values)) \
            if values else None
        if done is not None and done.rowcount == 0:
            return None
    return run(store, run_id)


def delete_run(store, run_id: str) -> bool:
    """Delete a run and every row of it; False if there was no such run."""
    with store.writer() as conn:
        if conn.execute(delete(Run).where(Run.id == run_id)).rowcount == 0:
            return False
        for model in (StepMetric, Event, HostSample, CustomMetric, RunProcess):
            conn.execute(delete(model).where(model.run_id == run_id))
    return True


def export_rows(store, kind: str, run_id: Optional[str] = None
                ) -> tuple[list[str], Iterator[tuple]]:
    """Column names and a lazy iterator over every stored row of ``kind`` (one run or all),
    in insertion order, so an export of a large store streams instead of loading it."""
    table = MODELS[kind].__table__
    columns = [c.name for c in table.columns]
    key = table.c.id if kind == "run" else table.c.run_id
    stmt = select(table).order_by(table.c.started_at if kind == "run" else table.c.id)
    if run_id is not None:
        stmt = stmt.where(key == run_id)

    def rows() -> Iterator[tuple]:
        with store.engine.connect() as conn:
            yield from conn.execution_options(stream_results=True, yield_per=2000).execute(stmt)
    return columns, rows()


def count(store, kind: str, run_id: Optional[str] = None) -> int:
    """Number of stored rows of one type (``run``, ``step``, ``event``, ``host``, ``metric``)."""
    model = MODELS[kind]
    stmt = select(func.count()).select_from(model)
    if run_id is not None:
        stmt = stmt.where((model.id if kind == "run" else model.run_id) == run_id)
    return store.first(stmt)[0]

