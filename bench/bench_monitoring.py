"""What monitoring and commits cost a training step, measured side by side in one run.

    .venv/bin/python bench/bench_monitoring.py [--steps 1000] [--block 10]

1. Step time with every probe on (step rows through the SQLite sink, straggler check,
   host sampler thread) vs all of it off, in alternating blocks of the same process and
   model, so machine noise hits both alike; prints the medians and their ratio (goal <=
   1.02).
2. Commit cost amortised per step at the default interval ("auto", Young/Daly capped at
   1 %) and at a fixed 10: total commit time / total training time (goal <= 1 %).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import horovod.torch as hvd
import torch

from elastic.commit_policy import CommitPolicy
from elastic.config import TrainConfig
from elastic.dataparallel import Session, commit, make_optimizer, train_step
from elastic.events import EventLog
from elastic.faults import FaultPlan
from elastic.metrics import StepReporter
from elastic.state import TrainState
from elastic.world import World
from jobs.digits import DigitsConfig, DigitsJob
from monitor.sink import SQLiteSink


def make_session(tmp: Path, commits: CommitPolicy):
    cfg = TrainConfig(run_dir=str(tmp), steps=10**9, progress=False)
    job = DigitsJob(DigitsConfig())
    torch.manual_seed(0)
    model = job.build_model()
    events = EventLog(tmp, "bench", 0)
    state = TrainState(model, make_optimizer(model, cfg), events=events,
                       checkpoint_path=cfg.checkpoint_path, checkpoint_every=0)
    session = Session(job=job, cfg=cfg, data=job.train_data(), events=events,
                      faults=FaultPlan(), world=World.from_horovod(hvd), commits=commits)
    return state, session


def monitoring_overhead(tmp: Path, steps: int, block: int) -> tuple[float, float]:
    state, session = make_session(tmp, CommitPolicy(fixed=10**9))
    times = {True: [], False: []}
    for _ in range(10):                      # warm-up
        train_step(state, session)
    for index in range(2 * steps // block):
        on = index % 2 == 0
        if on:
            sink = SQLiteSink(str(tmp / "bench.db"), spool_dir=str(tmp))
            reporter = StepReporter(sink, "bench", "bench")
        for _ in range(block):
            started = time.perf_counter()
            stats = train_step(state, session)
            if on:
                reporter.on_step(session, state, stats)
            times[on].append(time.perf_counter() - started)
        if on:
            reporter.close()
            sink.close()
    return statistics.median(times[True]), statistics.median(times[False])


def commit_overhead(tmp: Path, steps: int, fixed: int | None) -> tuple[float, int]:
    state, session = make_session(tmp, CommitPolicy(fixed=fixed))
    session.commits.entered(0)
    total = committing = 0.0
    commits = 0
    for _ in range(steps):
        started = time.perf_counter()
        stats = train_step(state, session)
        session.commits.observe_step(stats.step_time)
        if stats.commit:
            before = time.perf_counter()
            commit(state, session, "periodic", stats.loss)
            committing += time.perf_counter() - before
            commits += 1
        total += time.perf_counter() - started
    return committing / total, commits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000, help="steps per arm (>= 200)")
    parser.add_argument("--block", type=int, default=10)
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        on, off = monitoring_overhead(Path(tmp), args.steps, args.block)
        print(f"step time, monitoring on : {on * 1e3:7.3f} ms (median of {args.steps})")
        print(f"step time, monitoring off: {off * 1e3:7.3f} ms (median of {args.steps})")
        print(f"ratio on/off             : {on / off:7.3f}   (goal <= 1.02)")
        for label, fixed in (("auto (default)", None), ("fixed 10", 10)):
            share, count = commit_overhead(Path(tmp), 2 * args.steps, fixed)
            print(f"commit cost, {label:14s}: {share * 100:6.2f} % of training time "
                  f"({count} commits in {2 * args.steps} steps; goal <= 1 %)")


if __name__ == "__main__":
    main()
