"""A metrics store for the dashboard tests: a real short training run when the trainer
records step rows, plus simulated runs that cover what a short local run cannot (an
elastic failure and a host joining, a pipeline, a failed run).

    .venv/bin/python tests/webui_fixtures.py /tmp/demo/m.db   # fill a store to look at

The simulated rows go through monitor.sink.SQLiteSink, the path a worker's rows take.
"""
from __future__ import annotations

import math
import random
import subprocess
import sys
import time
from pathlib import Path

from monitor.sink import SQLiteSink
from monitor.store import Store

ROOT = Path(__file__).resolve().parents[1]
ELASTIC, PIPELINE, FAILED = "sim-elastic", "sim-pipeline", "sim-failed"
_CACHE: dict = {}


def _step_rows(run, step, t, ranks, world_ranks, rng, loss, stage_of=None):
    """One step of every rank: slow hosts compute longer and the others wait for them;
    in a pipeline the last stage (loss, output layer) is the heavier one."""
    compute = {r: 0.040 * factor * rng.uniform(0.95, 1.05) * (1 + 0.4 * (stage_of(r) if stage_of else 0))
               for r, (_, _, factor) in ranks.items()}
    slowest = max(compute.values())
    rows = []
    for r, (host, slot, _) in ranks.items():
        data, comm = 0.004 * rng.uniform(0.9, 1.1), 0.012 * rng.uniform(0.9, 1.1)
        wait = slowest - compute[r]
        rows.append({"type": "step", "run_id": run, "step": step, "wall_time": t, "rank": r,
                     "world_size": world_ranks, "host": host, "slot": slot,
                     "stage": stage_of(r) if stage_of else 0, "step_time": data + compute[r]
                     + wait + comm, "data_time": data, "compute_time": compute[r],
                     "comm_time": comm, "wait_time": wait, "samples": 32,
                     "bytes_sent": 430_000, "loss": loss, "lr": 0.05,
                     "uid": f"{run}:{r}:{step}:{t:.3f}"})
    return rows, slowest + 0.016


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
    """6 ranks on 3 hosts (host-c 1.5x slower); host-b dies at step 28 (restore to the
    step-25 commit), host-d joins at step 40. The run is still running."""
    rng, rows, t = random.Random(seed), [], t0
    rows.append({"type": "run", "id": ELASTIC, "job": "digits", "status": "running",
                 "started_at": t0, "config": {"steps": steps}, "launcher": "horovodrun"})
    ranks = _layout(["host-a", "host-b", "host-c"], {"host-c": 1.5})
    for r, (host, _, _) in ranks.items():
        rows += [_event(ELASTIC, t + 0.01 * r, "start", None, host, r, size=6),
                 _event(ELASTIC, t + 0.3 + 0.01 * r, "ready", 0, host, r)]
    t += 0.5
    step = 0
    while step < steps:
        if step == 28 and ranks.get(2, ("",))[0] == "host-b":   # host-b killed
            rows += [_event(ELASTIC, t + 0.001 * i, "failure", 28, "host-b", r,
                            cause="SIGKILL (injected)", size=6) for i, r in enumerate((2, 3))]
            survivors = [r for r, v in ranks.items() if v[0] != "host-b"]
            for i, r in enumerate(survivors):
                rows += [_event(ELASTIC, t + 0.15 + 0.001 * i, "peer_lost", None, ranks[r][0], r,
                                peer_rank=2, severed=3),
                         _event(ELASTIC, t + 0.2 + 0.001 * i, "restore", 25, ranks[r][0], r,
                                from_step=28, steps_redone=3)]
            ranks = _layout(["host-a", "host-c"], {"host-c": 1.5})
            t = _resize(rows, ranks, t + 1.1, 25, 6)
            step = 25
        if step == 40 and len(ranks) == 4:   # host-d joins
            rows.append(_event(ELASTIC, t, "host_added", 40, "launcher", None,
                               target="host-d", planned_step=40))
            rows += [_event(ELASTIC, t + 0.05, "commit", 40, ranks[r][0], r,
                            reason="membership", cost_s=0.002) for r in ranks]
            ranks = _layout(["host-a", "host-c", "host-d"], {"host-c": 1.5})
            t = _resize(rows, ranks, t + 0.6, 40, 4)
        step += 1
        loss = 2.3 * math.exp(-step / 18) + 0.15 + rng.uniform(-0.04, 0.04)
        batch, dt = _step_rows(ELASTIC, step, t, ranks, len(ranks), rng, loss)
        rows += batch
        t += dt
        if step % 5 == 0:
            rows += [_event(ELASTIC, t, "commit", step, ranks[r][0], r, reason="periodic",
                            cost_s=0.002, loss=loss) for r in ranks]
        if step == 15:
            rows.append(_event(ELASTIC, t, "straggler", step, "host-c", 4, factor=1.5))
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
                 "started_at": t0, "finished_at": t0 + 4.0, "config": {"pp": 2}})
    ranks = _layout(["host-a", "host-b"])
    for step in range(1, steps + 1):
        batch, dt = _step_rows(PIPELINE, step, t, ranks, 4, rng, 3.0 - step / 20,
                               stage_of=lambda r: r % 2)
        rows += batch
        t += dt
    return rows


def failed_rows(t0: float) -> list[dict]:
    """A run whose only host died: status failed."""
    rng, rows, t = random.Random(2), [], t0
    rows.append({"type": "run", "id": FAILED, "job": "digits", "status": "failed",
                 "started_at": t0, "finished_at": t0 + 1.5})
    ranks = _layout(["host-a"])
    for step in range(1, 11):
        batch, dt = _step_rows(FAILED, step, t, ranks, 2, rng, 2.0)
        rows += batch
        t += dt
    rows.append(_event(FAILED, t, "failure", 10, "host-a", 0, cause="OOM", size=2))
    return rows


def write(db: str, rows: list[dict]) -> None:
    """Through the worker's sink, flushed and closed."""
    sink = SQLiteSink(db, spool_dir=str(Path(db).parent / "spool"))
    for row in rows:
        sink.emit(row)
    sink.close()


def real_run(folder: Path, db: str):
    """The trainer's own rows: `python -m jobs.digits --steps 40 ...`, or None if it does
    not (yet) record step rows into the store."""
    cmd = [sys.executable, "-m", "jobs.digits", "--steps", "40", "--run-dir",
           str(folder / "digits"), "--db", db, "--no-progress"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, timeout=120, text=True)
    store = Store(db)
    try:
        if done.returncode != 0 or store.count("step") == 0:
            return None
        from sqlalchemy import select
        from monitor.models import StepMetric
        return store._all(select(StepMetric.run_id).limit(1))[0][0]
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
        write(db, elastic_rows(t0 + 200) + pipeline_rows(t0) + failed_rows(t0 + 100))
        _CACHE["built"] = {"db": db, "main": real or ELASTIC, "real": real,
                           "elastic": ELASTIC, "pipeline": PIPELINE, "failed": FAILED}
    return _CACHE["built"]


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/regatta-demo.db")
    print(build(target.parent, target.name))
