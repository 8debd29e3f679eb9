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

import torch

from elastic.config import TrainConfig
from elastic.dataparallel.engine import DataParallelEngine
from elastic.runtime.control import Pending
from elastic.runtime.env import Env
from elastic.runtime.reporting import HostSampler
from elastic.runtime.worker import Runtime
from jobs.digits import DigitsConfig, DigitsJob


def start(tmp: Path, commit_every) -> tuple:
    """A one-process runtime with the digits engine, ready to step (no loop)."""
    cfg = TrainConfig(run_dir=str(tmp / f"run-{commit_every}"), steps=10**9, progress=False,
                      db=str(tmp / "bench.db"), commit_every=commit_every, checkpoint_every=0)
    engine = DataParallelEngine(DigitsJob(DigitsConfig()), cfg)
    runtime = Runtime(Env.read({}), cfg, "bench", {})
    runtime.init(engine)
    state = engine.build(runtime)
    state.sync()
    runtime.enter(state)
    return runtime, engine, state


def monitoring_overhead(tmp: Path, steps: int, block: int) -> tuple[float, float]:
    """Alternating blocks: every probe on (step rows to SQLite, stragglers, progress, the
    host sampler thread) / all off (the bare engine step)."""
    runtime, engine, state = start(tmp, 10**9)
    times = {True: [], False: []}
    for _ in range(10):                      # warm-up
        engine.step(state, Pending())
    runtime.sampler.stop()
    for index in range(2 * steps // block):
        on = index % 2 == 0
        if on:
            runtime.sampler = HostSampler(runtime.sink, runtime.run_id, runtime.world.host,
                                          runtime.world.slot)
        for _ in range(block):
            started = time.perf_counter()
            if on:
                row, agreed = engine.step(state, runtime.pending(state))
                runtime.after_step(state, row, agreed)
            else:
                engine.step(state, Pending())
            times[on].append(time.perf_counter() - started)
        if on:
            runtime.sampler.stop()
    runtime.sampler = None
    runtime.close()
    return statistics.median(times[True]), statistics.median(times[False])


def commit_overhead(tmp: Path, steps: int, commit_every) -> tuple[float, int]:
    runtime, engine, state = start(tmp, commit_every)
    total = committing = 0.0
    commits = 0
    for _ in range(steps):
        started = time.perf_counter()
        row, agreed = engine.step(state, runtime.pending(state))
        runtime.after_step(state, row, agreed)
        if agreed.commit:
            before = time.perf_counter()
            runtime.commit(state, "periodic", agreed.loss)
            committing += time.perf_counter() - before
            commits += 1
        total += time.perf_counter() - started
    runtime.close()
    return committing / total, commits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000, help="steps per arm (>= 200)")
    parser.add_argument("--block", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        on, off = monitoring_overhead(Path(tmp), args.steps, args.block)
        print(f"step time, monitoring on : {on * 1e3:7.3f} ms (median of {args.steps})")
        print(f"step time, monitoring off: {off * 1e3:7.3f} ms (median of {args.steps})")
        print(f"ratio on/off             : {on / off:7.3f}   (goal <= 1.02)")
        for label, every in (("auto (default)", "auto"), ("fixed 10", 10)):
            share, count = commit_overhead(Path(tmp), 2 * args.steps, every)
            print(f"commit cost, {label:14s}: {share * 100:6.2f} % of training time "
                  f"({count} commits in {2 * args.steps} steps; goal <= 1 %)")


if __name__ == "__main__":
    main()
