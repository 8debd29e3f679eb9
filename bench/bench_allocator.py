"""A training step's time and page faults with glibc's default malloc against the runtime's
kept freed memory (elastic/runtime/memory.py), side by side in one run.

    .venv/bin/python bench/bench_allocator.py [--steps 100] [--rounds 3]     # about 3 minutes

For each model, one process per arm and round, the arms alternating (load that comes and
goes hits both alike), each on one thread: forward, backward, an SGD step and zeroing the
gradients, ``--steps`` times after 20 warm-up steps. Models: the pipeline bench's stage
(bench_pipeline.py: 8 Linear+Tanh layers, 512 wide) on a 32-row microbatch, as at m = 8;
charlm (jobs/charlm.py) and the MLP of the throughput bench (bench/mlp.py) on one rank's
half of their global batch. Prints per arm the step time's p50, p95 and max over all the
rounds' steps, p95/p50, the minor page faults per step, and per round the ratio of the
p50s (kept / glibc) with its median and range.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.percentiles import percentile  # noqa: E402
from elastic.runtime.memory import USER_TUNABLES  # noqa: E402

MODELS = ("stage", "charlm", "mlp")
ARMS = ("glibc", "kept")
WARMUP = 20


def options(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="measured steps per process")
    parser.add_argument("--rounds", type=int, default=3, help="processes per arm and model")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "ARM"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# -- one process: one model, one arm ---------------------------------------------------------
def model_and_batch(name: str):
    import torch
    from torch import nn
    torch.manual_seed(0)
    if name == "stage":
        model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(512, 512), nn.Tanh())])
        x = torch.randn(32, 512, requires_grad=True)
        return model, lambda: model(x).pow(2).sum()
    if name == "charlm":
        from jobs.charlm import CharLMJob as Job, parse_config
    else:
        from bench.mlp import MLPJob as Job, parse_config
    config = parse_config([])
    job = Job(config["model"])
    rows = config["train"].global_batch // 2    # one rank's share of two
    model = job.build_model()
    batch = tuple(t[:rows] for t in job.train_data())
    return model, lambda: job.loss_sum(model, batch)[0]


def worker(name: str, arm: str, steps: int) -> None:
    import resource
    import torch
    from elastic.runtime.memory import keep_freed_memory
    torch.set_num_threads(1)
    if arm == "kept" and not keep_freed_memory():
        raise SystemExit("keep_freed_memory() did not apply (not glibc?)")
    model, loss = model_and_batch(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    times, faults = [], []
    for step in range(WARMUP + steps):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        started = time.perf_counter()
        loss().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= WARMUP:
            times.append(time.perf_counter() - started)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print("RESULT " + json.dumps({"times": times, "faults": faults}))


# -- launcher side ----------------------------------------------------------------------------
def run_arm(name: str, arm: str, steps: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for tunable in USER_TUNABLES:
        env.pop(tunable, None)   # glibc's default is one of the arms
    done = subprocess.run([sys.executable, __file__, "--steps", str(steps), "--worker", name, arm],
                          env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise SystemExit(f"{name}/{arm} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return json.loads(lines[0][len("RESULT "):])


def report(name: str, rounds: list[dict]) -> None:
    print(f"\n{name}:")
    print(f"  {'arm':6} {'p50 ms':>8} {'p95 ms':>8} {'max ms':>8} {'p95/p50':>8} {'faults/step':>12}")
    for arm in ARMS:
        times = [t for r in rounds for t in r[arm]["times"]]
        faults = [f for r in rounds for f in r[arm]["faults"]]
        p50 = percentile(times, 0.5)
        print(f"  {arm:6} {p50 * 1e3:8.2f} {percentile(times, 0.95) * 1e3:8.2f} {max(times) * 1e3:8.2f} "
              f"{percentile(times, 0.95) / p50:8.2f} {statistics.mean(faults):12.1f}")
    ratios = [percentile(r["kept"]["times"], 0.5) / percentile(r["glibc"]["times"], 0.5) for r in rounds]
    print(f"  kept / glibc, p50 per round: {statistics.median(ratios):.2f} "
          f"[{min(ratios):.2f}-{max(ratios):.2f}] over {len(ratios)} rounds")


def main(argv=None) -> None:
    opts = options(argv)
    if opts.worker:
        return worker(*opts.worker, opts.steps)
    names = [n.strip() for n in opts.models.split(",") if n.strip()]
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        raise SystemExit(f"--models: unknown {', '.join(unknown)} (known: {', '.join(MODELS)})")
    for name in names:
        rounds = []
        for index in range(opts.rounds):
            order = ARMS if index % 2 == 0 else ARMS[::-1]
            rounds.append({arm: run_arm(name, arm, opts.steps) for arm in order})
            print(f"{name}: round {index + 1}/{opts.rounds} done", file=sys.stderr, flush=True)
        report(name, rounds)


if __name__ == "__main__":
    main()
