"""The runs list at a million step rows: kept summaries versus recomputing them, side by side.

    .venv/bin/python bench/bench_runs_list.py [--rows 1000000] [--runs 20] [--repeats 5]
    .venv/bin/python bench/bench_runs_list.py --db postgresql+psycopg://user@host/empty_db

Fills a fresh store (SQLite in a temporary folder, or ``--db``) with ``--runs`` runs of 8
ranks and ``--rows`` step rows in all, plus each run's commits and one failure with its
recovery events, written through Store.write_rows as the ingest server writes them (so
the per-run summary is kept as it would be). Then, alternating, repeated:

  before  what ``GET /api/v1/runs`` computed until the summary was kept (commit 8986698):
          for every run, aggregates over all of its step rows (last step, world sizes,
          samples counted once per rank and step, first/last step time), then its events
  now     ``GET /api/v1/runs`` through the real Flask app: one read of the run table and
          the few events of the recovery table

and prints p50 / p95 / max of each and the ratio of the medians. Goal: now < 10 % of before.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from sqlalchemy import func, select  # noqa: E402

from monitor.models import Event, Run, StepMetric  # noqa: E402
from monitor.recovery import recoveries  # noqa: E402
from monitor.store import Store  # noqa: E402
from webui import create_app  # noqa: E402

GOAL = 0.10
TRIGGER_AND_PHASES = ["failure", "host_added", "host_removed", "peer_lost", "restore", "reset",
                      "sync", "resumed"]


def fill(store: Store, rows: int, runs: int) -> None:
    """``runs`` runs of 8 ranks on 2 hosts; each loses host 1 a third of the way in."""
    per_run = rows // runs
    t0 = time.time() - 86400
    for r in range(runs):
        rid = f"bench-{r:03d}"
        store.write_rows([{"type": "run", "id": rid, "job": "digits", "status": "finished",
                           "started_at": t0 + r, "finished_at": t0 + r + per_run,
                           "config": {"train": {"lr": 0.01 * r}}}])
        batch, steps = [], per_run * 3 // 16   # 8 ranks for a third, then 4
        for step in range(steps):
            size = 8 if step < steps // 3 else 4
            for rank in range(size):
                batch.append({"type": "step", "run_id": rid, "step": step, "rank": rank,
                              "wall_time": t0 + r + step * 0.1, "world_size": size,
                              "host": f"node{rank // 4}", "slot": rank % 4, "step_time": 0.1,
                              "compute_time": 0.06, "comm_time": 0.03, "samples": 64,
                              "bytes_sent": 4_000_000, "loss": 1.0 / (step + 1),
                              "uid": f"{rid}:{rank}:{step}"})
            if step % 50 == 0:
                batch.append({"type": "event", "run_id": rid, "kind": "commit", "step": step,
                              "wall_time": t0 + r + step * 0.1, "host": "node0", "rank": 0,
                              "uid": f"{rid}:c:{step}"})
            if step == steps // 3:
                t = t0 + r + step * 0.1
                batch += [{"type": "event", "run_id": rid, "kind": kind, "step": step,
                           "wall_time": t + dt, "host": "node0", "rank": 0, "uid": f"{rid}:{kind}",
                           "detail": {"target": "node1", "size_before": 8, "size_after": 4}}
                          for kind, dt in (("failure", 0.0), ("peer_lost", 0.01),
                                           ("reset", 0.2), ("sync", 0.3), ("resumed", 0.4))]
            if len(batch) >= 5000:
                store.write_rows(batch)
                batch = []
        store.write_rows(batch)


def before(store: Store) -> str:
    """The runs list as computed until commit 8986698: every aggregate from the steps."""
    s = StepMetric
    last = select(s.run_id, func.max(s.step).label("m")).group_by(s.run_id).subquery()
    out = []
    with store.engine.connect() as conn:
        runs = conn.execute(select(Run.id, Run.job, Run.status, Run.started_at, Run.finished_at,
                                   Run.config, last.c.m).outerjoin(last, last.c.run_id == Run.id)
                            .order_by(Run.started_at.desc())).all()
        per_rank = (select(s.run_id, s.rank, s.step, func.avg(s.samples).label("samples"))
                    .group_by(s.run_id, s.rank, s.step).subquery())
        samples = dict(conn.execute(select(per_rank.c.run_id, func.sum(per_rank.c.samples))
                                    .group_by(per_rank.c.run_id)).all())
        latest = select(s.run_id, func.max(s.wall_time).label("t")).group_by(s.run_id).subquery()
        now_size = dict(conn.execute(select(s.run_id, func.max(s.world_size)).join(
            latest, (latest.c.run_id == s.run_id) & (latest.c.t == s.wall_time))
            .group_by(s.run_id)).all())
        spans = {rid: (lo, hi, t0, t1) for rid, lo, hi, t0, t1 in conn.execute(
            select(s.run_id, func.min(s.world_size), func.max(s.world_size),
                   func.min(s.wall_time), func.max(s.wall_time)).group_by(s.run_id))}
        for rid, job, status, started, finished, config, last_step in runs:
            lo, hi, t0, t1 = spans.get(rid, (None, None, None, None))
            events = [{"kind": e.kind, "wall_time": e.wall_time, "step": e.step, "host": e.host,
                       "detail": json.loads(e.detail)} for e in conn.execute(
                select(Event.kind, Event.wall_time, Event.step, Event.host, Event.detail)
                .where(Event.run_id == rid, Event.kind.in_(TRIGGER_AND_PHASES)))]
            failures = [x for x in recoveries(events) if x["kind"] == "failure"]
            out.append({"id": rid, "job": job, "status": status, "config": json.loads(config),
                        "last_step": last_step, "world_size": now_size.get(rid),
                        "world_size_min": lo, "world_size_max": hi,
                        "throughput": samples.get(rid, 0) / (t1 - t0) if t1 and t1 > t0 else None,
                        "failures": len(failures)})
    return json.dumps({"runs": out})


def stats(times: list[float]) -> str:
    ordered = sorted(times)
    p95 = ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))]
    return (f"p50 {statistics.median(ordered) * 1000:9.1f} ms  p95 {p95 * 1000:9.1f} ms  "
            f"max {ordered[-1] * 1000:9.1f} ms")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--db", default="", help="an empty store URL instead of a temp SQLite file")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        db = args.db or os.path.join(folder, "bench.db")
        store = Store(db)
        started = time.perf_counter()
        fill(store, args.rows, args.runs)
        print(f"filled {store.count('step'):,} step rows in {args.runs} runs "
              f"({time.perf_counter() - started:.0f} s)")
        app = create_app({"db": db})
        client = app.test_client()
        old, new = [], []
        for _ in range(args.repeats):   # alternating, so load changes hit both alike
            t = time.perf_counter()
            body = before(store)
            old.append(time.perf_counter() - t)
            t = time.perf_counter()
            response = client.get("/api/v1/runs")
            new.append(time.perf_counter() - t)
            assert response.status_code == 200
        fresh = {r["id"]: r for r in response.get_json()["runs"]}
        for r in json.loads(body)["runs"]:   # the same answers, both ways
            got = fresh[r["id"]]
            assert (got["last_step"], got["world_size"], got["world_size_max"],
                    got["failures"]) == (r["last_step"], r["world_size"], r["world_size_max"],
                                         r["failures"]), (got, r)
        app.extensions["regatta_store"].close()
        store.close()
    ratio = statistics.median(new) / statistics.median(old)
    print(f"before (recomputed from the steps): {stats(old)}")
    print(f"now    (GET /api/v1/runs, kept):    {stats(new)}")
    print(f"ratio now / before: {ratio:.4f}  goal < {GOAL}: {'met' if ratio < GOAL else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
