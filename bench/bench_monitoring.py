"""What monitoring and commits cost a training step, measured side by side in one run.

    .venv/bin/python bench/bench_monitoring.py [--seconds 3] [--rounds 6] [--steps 1000]

1. Training speed with every probe on (step rows through the SQLite sink and its flushes,
   straggler check, progress, the host sampler thread) vs all of it off, in alternating
   blocks of ``--seconds`` each (ABBA order, so a drift hits both alike) of the same process
   and model. A block is seconds long so that it holds the sink's flushes (every 1 s) and
   the host sampler's ticks: steps/s per block counts every step's whole cost, where a
   median step would hide a flush in the few steps that pay it. Prints steps/s (median and
   range over the blocks), the on/off ratio per round, and step times (p50, p95, max) per
   arm (goal: on/off >= 0.98).
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
from elastic.training import from_job
from jobs.digits import DigitsConfig, DigitsJob


def start(tmp: Path, commit_every) -> tuple:
    """A one-process runtime with the digits engine, ready to step (no loop)."""
    cfg = TrainConfig(run_dir=str(tmp / f"run-{commit_every}"), steps=10**9, progress=False,
                      db=str(tmp / "bench.db"), commit_every=commit_every, checkpoint_every=0)
    engine = DataParallelEngine(from_job(DigitsJob(DigitsConfig())), cfg)
    runtime = Runtime(Env.read({}), cfg, "bench", {})
    runtime.init(engine)
    state = engine.build(runtime)
    state.sync()
    runtime.enter(state)
    return runtime, engine, state


def monitoring_overhead(tmp: Path, seconds: float, rounds: int) -> dict:
    """Alternating blocks: every probe on (step rows to SQLite, stragglers, progress, the
    host sampler thread) / all off (the bare engine step). Per arm: each block's steps/s
    and every step's time."""
    runtime, engine, state = start(tmp, 10**9)
    for _ in range(10):                      # warm-up
        engine.step(state, Pending())
    runtime.sampler.stop()
    rates, steps = {True: [], False: []}, {True: [], False: []}
    for index in range(2 * rounds):
        on = (index % 4) in (0, 3)           # on, off, off, on, ...
        if on:
            runtime.sampler = HostSampler(runtime.sink, runtime.run_id, runtime.world.host,
                                          runtime.world.slot)
        began = time.perf_counter()
        count = 0
        while time.perf_counter() - began < seconds:
            started = time.perf_counter()
            if on:
                row, agreed = engine.step(state, runtime.pending(state))
                runtime.after_step(state, row, agreed)
            else:
                engine.step(state, Pending())
            steps[on].append(time.perf_counter() - started)
            count += 1
        rates[on].append(count / (time.perf_counter() - began))
        if on:
            runtime.sampler.stop()
    runtime.sampler = None
    runtime.close()
    return {"rates": rates, "steps": steps}


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


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
    parser.add_argument("--seconds", type=float, default=3.0, help="length of a block (>= 2)")
    parser.add_argument("--rounds", type=int, default=6, help="blocks per arm")
    parser.add_argument("--steps", type=int, default=1000, help="steps per commit arm (>= 200)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        measured = monitoring_overhead(Path(tmp), args.seconds, args.rounds)
        rates, steps = measured["rates"], measured["steps"]
        for on, label in ((True, "on "), (False, "off")):
            r, t = rates[on], steps[on]
            print(f"monitoring {label}: {statistics.median(r):7.1f} steps/s (blocks {min(r):.1f}-{max(r):.1f}); "
                  f"step p50 {quantile(t, 0.5) * 1e3:.3f} ms, p95 {quantile(t, 0.95) * 1e3:.3f} ms, "
                  f"max {max(t) * 1e3:.2f} ms ({len(t)} steps)")
        ratios = [on / off for on, off in zip(rates[True], rates[False])]
        print(f"ratio on/off, steps/s   : median {statistics.median(ratios):.3f} "
              f"(rounds {min(ratios):.3f}-{max(ratios):.3f}; {args.rounds} blocks of {args.seconds:g} s "
              f"an arm; goal >= 0.98)")
        cost = 1 / statistics.median(rates[True]) - 1 / statistics.median(rates[False])
        print(f"monitoring's cost a step: {cost * 1e3:.3f} ms (from the medians' steps/s; "
              f"a {statistics.median(steps[False]) * 1e3:.2f} ms step here)")
        for label, every in (("auto (default)", "auto"), ("fixed 10", 10)):
            share, count = commit_overhead(Path(tmp), 2 * args.steps, every)
            print(f"commit cost, {label:14s}: {share * 100:6.2f} % of training time "
                  f"({count} commits in {2 * args.steps} steps; goal <= 1 %)")


if __name__ == "__main__":
    main()
