"""A metrics store for the dashboard tests: a real short training run when the trainer
records step rows, plus simulated runs that cover what a short local run cannot (an
elastic failure and a host joining, a pipeline, a failed run on a host whose name is
markup, a run whose workers went silent).

    .venv/bin/python tests/webui_fixtures.py /tmp/demo/m.db   # fill a store to look at

The simulated rows go through monitor.sink.SqlSink, the path a worker's rows take.
``copy_store`` puts the same rows into another store (PostgreSQL) through the same sink.
"""
from __future__ import annotations

import math
import random
import subprocess
import sys
import time
from pathlib import Path

from monitor.schema import COLUMNS
from monitor.sink import SqlSink
from monitor.store import Store

ROOT = Path(__file__).resolve().parents[1]
ELASTIC, PIPELINE, FAILED, LOST = "sim-elastic", "sim-pipeline", "sim-failed", "sim-lost"
LOADER = "sim-loader"   # its DataLoader is the bottleneck: data_time dominates the step
DAY = 86400.0
# The dashboards under test call a run lost after a day of silence (the default is 5
# minutes), so the simulated runs stay "running" however long the test session takes.
LOST_AFTER_S = DAY
EVIL_HOST = '<a href="/evil">host-a</a>'   # a host name that is markup: shown, never run
_CACHE: dict = {}


def _step_rows(run, step, t, ranks, world_ranks, rng, loss, stage_of=None, data_s=0.004):
    """One step of every rank: slow hosts compute longer and the others wait for them;
    in a pipeline the last stage (loss, output layer) is the heavier one."""
    compute = {r: 0.040 * factor * rng.uniform(0.95, 1.05) * (1 + 0.4 * (stage_of(r) if stage_of else 0))
               for r, (_, _, factor) in ranks.items()}
    slowest = max(compute.values())
    rows = []
    for r, (host, slot, _) in ranks.items():
        data, comm = data_s * rng.uniform(0.9, 1.1), 0.012 * rng.uniform(0.9, 1.1)
        wait = slowest - compute[r]
        rows.append({"type": "step", "run_id": run, "step": step, "wall_time": t, "rank": r,
                     "world_size": world_ranks, "host": host, "slot": slot,
                     "stage": stage_of(r) if stage_of else 0, "step_time": data + compute[r]
                     + wait + comm, "data_time": data, "compute_time": compute[r],
                     "comm_time": comm, "wait_time": wait, "samples": 32,
                     "bytes_sent": 430_000, "loss": loss, "lr": 0.05,
                     "uid": f"{run}:{r}:{step}:{t:.3f}"})
    return rows, slowest + 0.016


class HostSampling:
    """Host rows as HostSampler sends them: every process present samples once a second
    (each at its own phase): its host's CPU % and its own RSS, which grows slowly. A
    process that leaves stops sampling; one that comes back starts afresh."""

    def __init__(self, run, rng, cpu=None):
        self.run, self.rng, self.cpu = run, rng, cpu or {}
        self.next_at: dict = {}

    def until(self, t, ranks) -> list[dict]:
        present = {(host, slot) for host, slot, _ in ranks.values()}
        self.next_at = {p: at for p, at in self.next_at.items() if p in present}
        rows = []
        for host, slot in sorted(present):
            at = self.next_at.setdefault((host, slot), t + 0.1 + 0.3 * slot)
            while at <= t:
                rows.append({"type": "host", "run_id": self.run, "host": host, "slot": slot,
                             "wall_time": at, "cpu_percent": self.cpu.get(host, 60.0)
                             + self.rng.uniform(-5, 5),
                             "rss_bytes": (300 + 40 * slot) * 2**20 + int(at * 1000) % 7_000_000,
                             "uid": f"{self.run}:host:{host}:{slot}:{at:.3f}"})
                at += 1.0
            self.next_at[host, slot] = at
        return rows


def _event(run, t, kind, step=None, host=None, rank=None, **detail):
    return {"type": "event", "run_id": run, "wall_time": t, "step": step, "kind": kind,
            "host": host, "rank": rank, "detail": detail, "uid": f"{run}:{kind}:{rank}:{t:.4f}"}


def _layout(hosts, slow=None):
    """rank -> (host, slot, compute factor), ranks numbered host by host as Horovod does."""
    slow = slow or {}
    out = {}
    for host in hosts:
        for slot in range(2):
            out[len(out)] = (host, slot, slow.get(host, 1.0))
    return out


def elastic_rows(t0: float, steps: int = 60, seed: int = 0) -> list[dict]:
    """6 ranks on 3 hosts (host-c 1.5x slower); host-b is killed at step 28 (restore to
    the step-25 commit) and joins again at step 40, so its processes are absent from 29
    to 40 and host-c's are renumbered twice. The run is still running."""
    rng, rows, t = random.Random(seed), [], t0
    rows.append({"type": "run", "id": ELASTIC, "job": "digits", "status": "running",
                 "started_at": t0, "launcher": "horovodrun", "name": "elastic demo",
                 "tags": ["demo", "elastic"], "code_revision": "0123abc",
                 "config": {"train": {"steps": steps, "lr": 0.05}, "model": {"hidden": 512}}})
    ranks = _layout(["host-a", "host-b", "host-c"], {"host-c": 1.5})
    sampling = HostSampling(ELASTIC, random.Random(seed + 100), cpu={"host-c": 92.0})
    for r, (host, _, _) in ranks.items():
        rows += [_event(ELASTIC, t + 0.01 * r, "start", None, host, r, size=6),
                 _event(ELASTIC, t + 0.3 + 0.01 * r, "ready", 0, host, r)]
    t += 0.5
    step = 0
    while step < steps:
        if step == 28 and ranks.get(2, ("",))[0] == "host-b":   # host-b killed
            # its workers record the injected kill, a survivor notices 0.15 s later, rank 0
            # records the failure of host-b (as elastic/metrics.py does)
            rows += [_event(ELASTIC, t + 0.001 * i, "kill_injected", 28, "host-b", r, size=6)
                     for i, r in enumerate((2, 3))]
            survivors = [r for r, v in ranks.items() if v[0] != "host-b"]
            for i, r in enumerate(survivors):
                rows += [_event(ELASTIC, t + 0.15 + 0.001 * i, "peer_lost", None, ranks[r][0], r,
                                peer_rank=2, target="host-b", severed=3),
                         _event(ELASTIC, t + 0.2 + 0.001 * i, "restore", 25, ranks[r][0], r,
                                from_step=28, steps_redone=3)]
            rows.append(_event(ELASTIC, t + 0.16, "failure", 28, "host-a", 0, target="host-b",
                               size_before=6, size_after=4))
            ranks = _layout(["host-a", "host-c"], {"host-c": 1.5})
            t = _resize(rows, ranks, t + 1.1, 25, 6)
            step = 25
        if step == 40 and len(ranks) == 4:   # host-b, repaired, joins again
            rows.append(_event(ELASTIC, t, "host_added", 40, "launcher", None,
                               target="host-b", planned_step=40))
            rows += [_event(ELASTIC, t + 0.05, "commit", 40, ranks[r][0], r,
                            reason="membership", cost_s=0.002) for r in ranks]
            ranks = _layout(["host-a", "host-b", "host-c"], {"host-c": 1.5})
            t = _resize(rows, ranks, t + 0.6, 40, 4)
        step += 1
        loss = 2.3 * math.exp(-step / 18) + 0.15 + rng.uniform(-0.04, 0.04)
        batch, dt = _step_rows(ELASTIC, step, t, ranks, len(ranks), rng, loss)
        rows += batch
        t += dt
        rows += sampling.until(t, ranks)
        if step % 5 == 0:
            rows += [_event(ELASTIC, t, "commit", step, ranks[r][0], r, reason="periodic",
                            cost_s=0.002, loss=loss) for r in ranks]
        if step >= 15 and step % 3 == 0:   # host-c flagged again and again: minor
            rows.append(_event(ELASTIC, t, "straggler", step, "host-a", 0,
                               straggler_host="host-c", straggler_rank=4, ratio=1.5))
        if step % 10 == 0:   # the user's own eval metric, logged by rank 0
            rows.append({"type": "metric", "run_id": ELASTIC, "name": "eval/loss", "step": step,
                         "value": loss + 0.1, "rank": 0, "host": "host-a", "wall_time": t,
                         "uid": f"{ELASTIC}:eval:{step}"})
    return rows


def _resize(rows, ranks, t, step, size_before):
    """reset, sync and the first step's resumed event of every rank of the new world."""
    for r, (host, _, _) in ranks.items():
        rows += [_event(ELASTIC, t + 0.001 * r, "reset", step, host, r,
                        size_before=size_before, size_after=len(ranks)),
                 _event(ELASTIC, t + 0.3 + 0.001 * r, "sync", step, host, r, size=len(ranks),
                        cost_s=0.01),
                 _event(ELASTIC, t + 0.45 + 0.001 * r, "resumed", step + 1, host, r,
                        size=len(ranks), step_time=0.07)]
    return t + 0.4


def pipeline_rows(t0: float, steps: int = 30, seed: int = 1) -> list[dict]:
    """2 data-parallel replicas x 2 pipeline stages (stage = rank % 2); finished."""
    rng, rows, t = random.Random(seed), [], t0
    rows.append({"type": "run", "id": PIPELINE, "job": "charlm", "status": "finished",
                 "started_at": t0, "finished_at": t0 + 4.0,
                 "config": {"train": {"steps": steps, "lr": 0.1}, "model": {"hidden": 512},
                            "parallel": {"pp": 2}}})
    ranks = _layout(["host-a", "host-b"])
    for step in range(1, steps + 1):
        batch, dt = _step_rows(PIPELINE, step, t, ranks, 4, rng, 3.0 - step / 20,
                               stage_of=lambda r: r % 2)
        rows += batch
        t += dt
    return rows


def loader_rows(t0: float, steps: int = 30, seed: int = 4) -> list[dict]:
    """2 ranks on one host whose DataLoader cannot keep up: 0.1 s of every step waits
    for data, 0.04 s computes; finished."""
    rng, rows, t = random.Random(seed), [], t0
    rows.append({"type": "run", "id": LOADER, "job": "files_cnn", "status": "finished",
                 "started_at": t0, "finished_at": t0 + 5.0,
                 "config": {"train": {"steps": steps, "loader_workers": 0}}})
    ranks = _layout(["host-a"])
    for step in range(1, steps + 1):
        batch, dt = _step_rows(LOADER, step, t, ranks, 2, rng, 2.0 - step / 30, data_s=0.1)
        rows += batch
        t += dt + 0.1
    return rows


def failed_rows(t0: float) -> list[dict]:
    """A run whose only host died: status failed."""
    rng, rows, t = random.Random(2), [], t0
    rows.append({"type": "run", "id": FAILED, "job": "digits", "status": "failed",
                 "started_at": t0, "finished_at": t0 + 1.5, "error": "CUDA out of memory"})
    ranks = _layout([EVIL_HOST])
    sampling = HostSampling(FAILED, random.Random(102))
    for step in range(1, 11):
        batch, dt = _step_rows(FAILED, step, t, ranks, 2, rng, 2.0)
        rows += batch
        t += dt
    rows += sampling.until(t, ranks) + sampling.until(t + 2.5, ranks)
    rows.append(_event(FAILED, t, "failure", 10, EVIL_HOST, 0, cause="OOM", size=2))
    return rows


def lost_rows(t0: float) -> list[dict]:
    """A run still 'running' whose workers went silent long ago: shown as lost."""
    rng, rows = random.Random(3), [{"type": "run", "id": LOST, "job": "digits",
                                    "status": "running", "started_at": t0}]
    batch, _ = _step_rows(LOST, 1, t0 + 1, _layout(["host-a"]), 2, rng, 2.0)
    return rows + batch


def write(db: str, rows: list[dict], spool_dir: str) -> None:
    """Through the worker's sink, flushed and closed."""
    sink = SqlSink(db, spool_dir=spool_dir)
    for row in rows:
        sink.emit(row)
    sink.close()
    assert sink.spooled == 0 and sink.failures == 0


def real_run(folder: Path, db: str):
    """The trainer's own rows: `python -m jobs.digits --steps 40 ...`, or None if it does
    not (yet) record step rows into the store."""
    cmd = [sys.executable, "-m", "jobs.digits", "--steps", "40", "--run-dir",
           str(folder / "digits"), "--db", db, "--no-progress"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, timeout=120, text=True)
    # a failed run must say so here, not as a dashboard test finding no finished run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    store = Store(db)
    try:
        if store.count("step") == 0:
            return None
        from sqlalchemy import select
        from monitor.models import StepMetric
        return store.all(select(StepMetric.run_id).limit(1))[0][0]
    finally:
        store.close()


def build(folder: Path, name: str = "m.db") -> dict:
    """Fill ``folder/name`` once per test session; ``main`` is the run the API tests use:
    the real run when there is one, else the simulated elastic run."""
    if "built" not in _CACHE:
        folder.mkdir(parents=True, exist_ok=True)
        db = str(folder / name)
        real = real_run(folder, db)
        t0 = time.time() - 300
        write(db, elastic_rows(t0 + 200) + pipeline_rows(t0) + failed_rows(t0 + 100)
              + loader_rows(t0 + 50) + lost_rows(t0 - 3 * DAY), str(folder / "spool"))
        _CACHE["built"] = {"db": db, "main": real or ELASTIC, "real": real,
                           "elastic": ELASTIC, "pipeline": PIPELINE, "failed": FAILED,
                           "lost": LOST, "loader": LOADER}
    return _CACHE["built"]


def copy_store(source: str, target: str, spool_dir: str) -> None:
    """Every row of ``source`` into ``target`` through a sink, as workers would send them
    (run rows first), so both stores hold the same runs."""
    store = Store(source)
    rows = []
    try:
        for kind in ("run", "step", "event", "host", "metric"):
            columns, found = store.export_rows(kind)
            keep = [(i, c) for i, c in enumerate(columns) if c in COLUMNS[kind]]
            rows += [dict({c: r[i] for i, c in keep}, type=kind) for r in found]
    finally:
        store.close()
    write(target, rows, spool_dir)


def build_on(kind: str, folder: Path, postgres=None) -> dict:
    """The session's data on SQLite, or copied into a fresh PostgreSQL database."""
    data = build(folder)
    if kind == "sqlite":
        return data
    key = "built-" + kind
    if key not in _CACHE:
        url = postgres.new_database()
        copy_store(data["db"], url, str(folder / "spool-pg"))
        _CACHE[key] = dict(data, db=url)
    return _CACHE[key]


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/regatta-demo.db")
    print(build(target.parent, target.name))
