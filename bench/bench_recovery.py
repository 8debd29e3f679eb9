"""Recovery speed, Regatta vs a stock Horovod elastic loop, side by side in one run.

    .venv/bin/python bench/bench_recovery.py [--repeats 2]

Both run under the same real `horovodrun` on simulated loopback hosts (regatta local),
the same digits job and commit interval:
* failure: 3 hosts, the workers of one SIGKILLed at step 100; time from the kill to the
  first step done at the new size.
* addition: 2 hosts, a third listed for discovery at step 100; time from the edit of
  the discovery file to the first step done with the new worker.
Stock = bench/stock_elastic.py (DistributedOptimizer, TorchState, commit every 10 steps,
fresh Python per worker, Gloo timeout 30 s). Regatta = jobs.digits with lifelines and
warm agents. Prints every run, the medians and the ratios.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REGATTA = str(Path(sys.executable).parent / "regatta")

SCENARIOS = {
    "failure": ["--hosts", "3", "--steps", "700", "--kill", "2@100"],
    "addition": ["--hosts", "2", "--steps", "1500", "--add", "@100"],
}
FLAVOURS = {
    "stock": ["--module", "bench.stock_elastic", "--stock-recovery", "--cold-workers"],
    "regatta": [],
}


def measure(scenario: str, flavour: str, workdir: Path) -> float:
    run_dir, report = workdir / f"{scenario}-{flavour}", workdir / f"{scenario}-{flavour}.json"
    cmd = [REGATTA, "local", "digits", *SCENARIOS[scenario], "--commit-every", "10",
           *FLAVOURS[flavour], "--run-dir", str(run_dir), "--report", str(report),
           "--", "--db", str(workdir / "bench.db")]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=600)
    (change,) = json.loads(report.read_text())["changes"]
    return change["first_step_done_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    times = {(s, f): [] for s in SCENARIOS for f in FLAVOURS}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for scenario in SCENARIOS:
                for flavour in FLAVOURS:   # alternate, so load drifts hit both alike
                    seconds = measure(scenario, flavour, Path(tmp))
                    times[scenario, flavour].append(seconds)
                    print(f"run {repeat + 1}: {scenario:8s} {flavour:7s} {seconds:7.2f} s", flush=True)
    print()
    for scenario in SCENARIOS:
        stock = statistics.median(times[scenario, "stock"])
        ours = statistics.median(times[scenario, "regatta"])
        print(f"{scenario:8s}: stock {stock:6.2f} s   regatta {ours:6.2f} s   "
              f"speed-up {stock / ours:6.1f}x")


if __name__ == "__main__":
    main()
