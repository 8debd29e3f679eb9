"""Recovery speed side by side in one run: Regatta vs a stock Horovod elastic loop, and
a Dataset read by DataLoader workers vs the same job read in-process.

    .venv/bin/python bench/bench_recovery.py [--repeats 5] [--data tensors|loader] [--scenarios failure/sigkill]

Every arm runs under the same real `horovodrun` on simulated hosts (regatta local), the
arms alternating run by run so that load drifts hit them alike. Recovery is the time from
the fault to the first step done at the new size (the launcher's report).

* ``--data tensors`` (jobs.digits, tensors in memory), stock vs Regatta:
  failure, 3 hosts, one host's workers SIGKILLed, either from outside at a random instant
  after step 100 (``sigkill``, a different instant each repeat) or by themselves at step
  100 (``kill``); addition, 2 hosts, a third listed for discovery at step 100 (time from
  the edit of the discovery file). Stock = bench/stock_elastic.py (DistributedOptimizer,
  TorchState, commit every 10 steps, fresh Python per worker, Gloo timeout 30 s).
* ``--data loader`` (examples/files_cnn.py: a file-backed Dataset), its two DataLoader
  workers per rank (the default) vs ``train.loader_workers=0``, the same two failures at
  step 120.

Prints every run, then p50, p95 and max of each arm and the ratio of the p50s.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.percentiles import percentile  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
REGATTA = str(Path(sys.executable).parent / "regatta")

# scenario -> (target, launcher arguments); {seed} varies the outside fault's instant
TENSORS = {
    "failure/sigkill": ["digits", "--hosts", "3", "--steps", "700", "--sigkill", "2@100"],
    "failure/kill": ["digits", "--hosts", "3", "--steps", "700", "--kill", "2@100"],
    "addition": ["digits", "--hosts", "2", "--steps", "1500", "--add", "@100"],
}
LOADER = {
    "failure/sigkill": ["examples/files_cnn.py", "--hosts", "3", "--steps", "200", "--sigkill", "2@120"],
    "failure/kill": ["examples/files_cnn.py", "--hosts", "3", "--steps", "200", "--kill", "2@120"],
}
# arm -> (launcher arguments, job arguments)
ARMS = {
    "tensors": {"stock": (["--module", "bench.stock_elastic", "--stock-recovery", "--cold-workers"], []),
                "regatta": ([], [])},
    "loader": {"2 loader workers": ([], []),
               "in-process": ([], ["--set", "train.loader_workers=0"])},
}


def measure(args: list[str], arm: tuple[list, list], seed: int, workdir: Path, name: str) -> float:
    run_dir, report = workdir / name, workdir / f"{name}.json"
    cmd = [REGATTA, "local", *args, "--commit-every", "10", "--seed", str(seed), *arm[0],
           "--run-dir", str(run_dir), "--report", str(report),
           "--", "--no-progress", "--db", str(workdir / "bench.db"), *arm[1]]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=600)
    (change,) = json.loads(report.read_text())["changes"]
    return change["first_step_done_s"]


def summary(values: list[float]) -> str:
    return (f"p50 {percentile(values, 0.5):6.3f} s  p95 {percentile(values, 0.95):6.3f} s  "
            f"max {max(values):6.3f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--data", choices=sorted(ARMS), default="tensors")
    parser.add_argument("--scenarios", default="", help="a comma list of the data's scenarios "
                        "(failure/sigkill, failure/kill, addition; default: all)")
    args = parser.parse_args()
    scenarios, arms = (TENSORS if args.data == "tensors" else LOADER), ARMS[args.data]
    chosen = [s for s in args.scenarios.split(",") if s]
    unknown = sorted(set(chosen) - set(scenarios))
    if unknown:
        parser.error(f"--scenarios: no {', '.join(unknown)} for --data {args.data} "
                     f"(it has {', '.join(scenarios)})")
    scenarios = {s: launch for s, launch in scenarios.items() if not chosen or s in chosen}
    times = {(s, a): [] for s in scenarios for a in arms}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for scenario, launch in scenarios.items():
                for arm, options in arms.items():
                    name = f"{scenario.replace('/', '-')}-{arm.replace(' ', '-')}-{repeat}"
                    seconds = measure(launch, options, repeat, Path(tmp), name)
                    times[scenario, arm].append(seconds)
                    print(f"run {repeat + 1}: {scenario:16s} {arm:17s} {seconds:7.3f} s", flush=True)
    print()
    base, other = list(arms)
    for scenario in scenarios:
        for arm in arms:
            print(f"{scenario:16s} {arm:17s} {summary(times[scenario, arm])}")
        ratio = percentile(times[scenario, base], 0.5) / percentile(times[scenario, other], 0.5)
        print(f"{scenario:16s} p50 {base} / {other}: {ratio:.2f}x\n")


if __name__ == "__main__":
    main()
