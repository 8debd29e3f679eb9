"""The per-run summary the store keeps while it writes, so reading a run list is cheap.

For every step row actually inserted (replays of a stored uid are not), the run's row
gets its counts, first/last step time, world sizes and samples; the process's
``run_process`` row (one per host and slot, an identity that survives the renumbering
of ranks at a reset) gets its newest step. A step that a process records again after an
elastic restore adds no samples: each (process, step) counts once, whatever order the
rows arrive in (a spool replays old rows after newer ones). ``rebuild`` recomputes the
same from the step rows (migrations, tests, benches).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Optional

from sqlalchemy import func, select, update
from sqlalchemy.engine import Connection

from monitor.models import Run, RunProcess, StepMetric
from monitor.dialect import insert_for

# What the step insert returns for each row it really inserted.
RETURNED = ("run_id", "host", "slot", "step", "wall_time", "world_size", "samples", "rank",
            "step_time")
PROCESS_FIELDS = ("last_step", "last_rank", "last_wall_time", "last_step_time",
                  "last_samples", "step_rows")


def _process_upsert(conn: Connection, rows: list[dict]) -> None:
    if not rows:
        return
    stmt = insert_for(conn.dialect.name)(RunProcess.__table__)
    stmt = stmt.on_conflict_do_update(
        index_elements=["run_id", "host", "slot"],
        set_={name: stmt.excluded[name] for name in PROCESS_FIELDS})
    conn.execute(stmt, rows)


def done_steps(conn: Connection, rows: list[tuple]) -> dict:
    """(run_id, host, slot, step) -> (wall time, samples) of its first execution, for
    the steps these rows are about, as stored (call it before inserting them)."""
    spans: dict = {}
    for row in rows:
        lo, hi = spans.get(row[0], (row[3], row[3]))
        spans[row[0]] = (min(lo, row[3]), max(hi, row[3]))
    s, out = StepMetric, {}
    for rid, (lo, hi) in spans.items():
        for h, sl, st, t, n in conn.execute(
                select(s.host, s.slot, s.step, s.wall_time, s.samples)
                .where(s.run_id == rid, s.step >= lo, s.step <= hi)):
            key = (rid, h, sl, st)
            if key not in out or t < out[key][0]:
                out[key] = (t, n)
    return out


def apply(conn: Connection, runs: dict, inserted: Iterable[tuple], done: dict) -> None:
    """Fold the inserted step rows into the summaries. ``runs`` maps each run id of the
    batch to its locked run row (a dict of its summary columns); ``done`` is what
    done_steps returned before they were inserted (updated here). A process's step
    counts the samples of its first execution, even when that arrives last."""
    by_process: dict = defaultdict(list)
    for row in inserted:
        by_process[(row[0], row[1], row[2])].append(row)
    if not by_process:
        return
    ids = sorted({key[0] for key in by_process})
    known = {(p.run_id, p.host, p.slot): p._asdict() for p in conn.execute(
        select(RunProcess).where(RunProcess.run_id.in_(ids)))}
    deltas: dict = {rid: {"rows": 0, "samples": 0, "steps": [], "times": [], "sizes": [],
                          "newest": None} for rid in ids}
    processes = []
    for key, rows in by_process.items():
        rows.sort(key=lambda r: r[4])
        old = known.get(key)
        d = deltas[key[0]]
        for row in rows:
            step_key, first = (row[0], row[1], row[2], row[3]), (row[4], row[6])
            counted = done.get(step_key)
            if counted is None:
                d["samples"] += row[6]
                done[step_key] = first
            elif first[0] < counted[0]:   # the first execution arrived after its replay
                d["samples"] += row[6] - counted[1]
                done[step_key] = first
        newest = rows[-1]
        if old and old["last_wall_time"] > newest[4]:
            newest = None   # late rows of an earlier step: the process's newest stays
        base = old or {}
        processes.append({
            "run_id": key[0], "host": key[1], "slot": key[2],
            "last_step": max(max(r[3] for r in rows), base.get("last_step", -1)),
            "last_rank": newest[7] if newest else base["last_rank"],
            "last_wall_time": newest[4] if newest else base["last_wall_time"],
            "last_step_time": newest[8] if newest else base["last_step_time"],
            "last_samples": newest[6] if newest else base["last_samples"],
            "step_rows": base.get("step_rows", 0) + len(rows)})
        d["rows"] += len(rows)
        d["steps"] += [r[3] for r in rows]
        d["times"] += [r[4] for r in rows]
        d["sizes"] += [r[5] for r in rows]
        if d["newest"] is None or rows[-1][4] > d["newest"][4]:
            d["newest"] = rows[-1]
    _process_upsert(conn, processes)
    for rid, d in deltas.items():
        conn.execute(update(Run).where(Run.id == rid).values(**_run_values(runs[rid], d)))


def _run_values(run: dict, d: dict) -> dict:
    def merged(old, new, pick):
        return new if old is None else pick(old, new)
    newest_t = max(d["times"])
    out = {"step_rows": (run["step_rows"] or 0) + d["rows"],
           "samples_done": (run["samples_done"] or 0) + d["samples"],
           "last_step": merged(run["last_step"], max(d["steps"]), max),
           "first_step_at": merged(run["first_step_at"], min(d["times"]), min),
           "last_step_at": merged(run["last_step_at"], newest_t, max),
           "world_size_min": merged(run["world_size_min"], min(d["sizes"]), min),
           "world_size_max": merged(run["world_size_max"], max(d["sizes"]), max)}
    if run["last_step_at"] is None or newest_t >= run["last_step_at"]:
        out["world_size"] = d["newest"][5]
    return out


def rebuild(conn: Connection, run_ids: Optional[list[str]] = None) -> None:
    """Recompute every summary (or those of ``run_ids``) from the stored step rows."""
    s = StepMetric
    only = [s.run_id.in_(run_ids)] if run_ids is not None else []
    runs = select(Run.id) if run_ids is None else select(Run.id).where(Run.id.in_(run_ids))
    ids = [rid for (rid,) in conn.execute(runs)]
    conn.execute(RunProcess.__table__.delete().where(RunProcess.run_id.in_(ids)))
    empty = {"step_rows": 0, "samples_done": 0, "last_step": None, "first_step_at": None,
             "last_step_at": None, "world_size": None, "world_size_min": None,
             "world_size_max": None}
    for rid in ids:
        conn.execute(update(Run).where(Run.id == rid).values(**empty))
    # Per process, step rows in time order: the same fold as apply(), in chunks.
    stmt = (select(*[getattr(s, c) for c in RETURNED]).where(*only)
            .order_by(s.run_id, s.wall_time, s.id))
    locked = {rid: dict(empty) for rid in ids}
    batch: list = []
    done: dict = {}
    for row in conn.execute(stmt):
        batch.append(tuple(row))
        if len(batch) >= 50_000:
            _fold(conn, locked, batch, done)
            batch = []
    _fold(conn, locked, batch, done)


def _fold(conn: Connection, locked: dict, batch: list, done: dict) -> None:
    batch = [r for r in batch if r[0] in locked]   # step rows of a run never announced
    if not batch:
        return
    ids = {r[0] for r in batch}
    apply(conn, {rid: locked[rid] for rid in ids}, batch, done)
    for rid in ids:
        locked[rid] = summary_of(conn, rid)


def summary_of(conn: Connection, run_id: str) -> dict:
    """The run's summary columns as stored."""
    cols = ("step_rows", "samples_done", "last_step", "first_step_at", "last_step_at",
            "world_size", "world_size_min", "world_size_max")
    row = conn.execute(select(*[getattr(Run, c) for c in cols]).where(Run.id == run_id)).first()
    return dict(zip(cols, row)) if row else {}



def refresh_last_seen(conn: Connection, run_ids: Optional[list[str]] = None) -> None:
    """Set each run's last_seen_at to the newest wall time of any of its rows."""
    from monitor.models import CustomMetric, Event, HostSample
    newest: dict = {}
    for model in (StepMetric, Event, HostSample, CustomMetric):
        stmt = select(model.run_id, func.max(model.wall_time)).group_by(model.run_id)
        if run_ids is not None:
            stmt = stmt.where(model.run_id.in_(run_ids))
        for rid, t in conn.execute(stmt):
            if t is not None and (rid not in newest or t > newest[rid]):
                newest[rid] = t
    for rid, t in newest.items():
        conn.execute(update(Run).where(Run.id == rid).values(last_seen_at=t))
