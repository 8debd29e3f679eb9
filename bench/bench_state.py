"""Elastic state at model scale: Horovod's TorchState (stock) and Regatta side by side.

    .venv/bin/python bench/bench_state.py [--sizes 10M,100M] [--dp 2,3] [--repeats 3]

For each model size (an MLP of 10 square layers, Adam) and data-parallel width, both
flavours run under a real ``horovodrun --gloo`` on this machine (bench/state_worker.py
says what each measures), one after the other, the order alternating from one
configuration to the next. Per metric it prints p50 and max over repeats and ranks, and
the ratio regatta / stock:

* commit: one in-memory commit; restore: a failure's restore plus the sync after the
  reset (Horovod's elastic loop always runs both); sync to a new worker;
* durable checkpoint: what the training loop waits for, and the write itself;
* step time while a checkpoint is being written over a step without (rank 0's steps);
* extra memory per rank for the commit (RSS), and the peak RSS.

100M parameters x Adam are 1.2 GB of state per rank: mind others sharing the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOROVODRUN = str(Path(sys.executable).parent / "horovodrun")
FLAVOURS = ("stock", "regatta")
MB = 1 << 20


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9}.get(text[-1], 1)
    return int(float(text.rstrip("KMG")) * scale)


def launch(flavour: str, params: int, dp: int, repeats: int, steps: int, folder: Path) -> list[dict]:
    out = folder / f"{flavour}-{params}-{dp}.json"
    cmd = [HOROVODRUN, "--gloo", "-np", str(dp), "-H", f"localhost:{dp}", sys.executable, "-m",
           "bench.state_worker", "--flavour", flavour, "--params", str(params),
           "--repeats", str(repeats), "--steps", str(steps), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "REGATTA_PROCS_PER_MACHINE": str(dp), "REGATTA_SPOOL_DIR": str(folder / "spool")}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{flavour} {params} dp={dp} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def spread(values: list[float], unit: float = 1.0) -> str:
    return f"{statistics.median(values) / unit:8.3f} (max {max(values) / unit:8.3f})"


def summarise(ranks: list[dict]) -> dict:
    root = ranks[0]
    steps = root["step_s"]
    quiet = [s for s, busy in zip(steps, root["overlaps"]) if not busy] or steps
    busy = [s for s, on in zip(steps, root["overlaps"]) if on]
    step = statistics.median(quiet)
    # Stock writes inside the loop: the step that writes takes the write on top.
    during = statistics.median(busy) if busy else step + statistics.median(root["checkpoint_s"])
    return {
        "commit_s": [v for r in ranks for v in r["commit_s"]],
        "restore_s": [v for r in ranks for v in r["restore_s"]],
        "sync_new_s": [v for r in ranks for v in r["sync_new_s"]],
        "checkpoint_blocking_s": root["checkpoint_s"], "checkpoint_write_s": root["write_s"],
        "step_s": quiet, "slowdown": during / step, "steps_overlapping": len(busy),
        "commit_mb": [r["commit_rss"] / MB for r in ranks], "peak_mb": [r["peak_rss"] / MB for r in ranks],
    }


ROWS = (("commit (s)", "commit_s", 1.0), ("restore + sync (s)", "restore_s", 1.0),
        ("sync to a new worker (s)", "sync_new_s", 1.0),
        ("checkpoint: loop waits (s)", "checkpoint_blocking_s", 1.0),
        ("checkpoint: write (s)", "checkpoint_write_s", 1.0), ("step without a write (s)", "step_s", 1.0),
        ("extra commit memory/rank (MB)", "commit_mb", 1.0), ("peak RSS/rank (MB)", "peak_mb", 1.0))


def report(params: int, dp: int, results: dict) -> dict:
    stock, ours = summarise(results["stock"]), summarise(results["regatta"])
    print(f"\n== {results['regatta'][0]['params'] / 1e6:.1f}M parameters (Adam), dp = {dp} ==")
    print(f"{'':32s} {'stock p50 (max)':>26s} {'regatta p50 (max)':>26s} {'ratio':>7s}")
    for label, key, unit in ROWS:
        ratio = statistics.median(ours[key]) / max(statistics.median(stock[key]), 1e-9)
        print(f"{label:32s} {spread(stock[key], unit):>26s} {spread(ours[key], unit):>26s} {ratio:7.2f}")
    print(f"{'step while writing / without':32s} {stock['slowdown']:26.3f} {ours['slowdown']:26.3f}"
          f"   (regatta: {ours['steps_overlapping']} steps overlapped a write)")
    return {"memory_ratio": statistics.median(ours["commit_mb"]) / statistics.median(stock["commit_mb"]),
            "slowdown": ours["slowdown"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10M,100M")
    parser.add_argument("--dp", default="2,3")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12, help="steps per checkpoint round")
    args = parser.parse_args()
    print("load average at start:", Path("/proc/loadavg").read_text().strip())
    goals, order = {}, list(FLAVOURS)
    with tempfile.TemporaryDirectory(prefix="bench-state-") as tmp:
        for params in map(parse_size, args.sizes.split(",")):
            for dp in map(int, args.dp.split(",")):
                results = {}
                for flavour in order:
                    results[flavour] = launch(flavour, params, dp, args.repeats, args.steps, Path(tmp))
                order.reverse()     # alternate, so load drifts hit both alike
                goals[params, dp] = report(params, dp, results)
    print("\nload average at end:", Path("/proc/loadavg").read_text().strip())
    for (params, dp), goal in goals.items():
        print(f"{params / 1e6:.0f}M dp={dp}: commit memory regatta/stock {goal['memory_ratio']:.2f} "
              f"(goal <= 0.7 at 100M dp=3); step while writing {goal['slowdown']:.3f}x (goal <= 1.05)")


if __name__ == "__main__":
    main()
