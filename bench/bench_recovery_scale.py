"""Does a failure cost more as the model grows? A SIGKILL at a random instant of a step,
at 10M and 100M parameters x Adam, Regatta going on from the survivors' live state and
the same runtime going back to the commit (``train.recover_from=commit``), side by side.

    .venv/bin/python bench/bench_recovery_scale.py [--sizes 10M,100M] [--repeats 5]

Each run is ``regatta local`` on 3 simulated hosts (one process each, real horovodrun)
training bench/mlp.py's MLP (7 square layers of ``width``, Adam, global batch 24, a
commit every 10 steps, no durable checkpoint); host 2's worker is SIGKILLed from outside
at a random instant within two step times of step ``--kill-at``; the arms alternate run
by run so that load drifts hit them alike. Per run: seconds from the kill to the first
step done on the 2 survivors (the launcher's report, as the dashboard measures it), to
the state agreed (``synced``: training goes on from there), the median step time at 2
(from the run's step rows), the first step's own time at 2 (``first``: the slowest
rank's; what the new world's first step pays beyond a steady one) and what is left when one such step is taken off (``own``:
what the recovery itself cost, which is what must not grow with the model), steps redone,
and the bytes the survivors' sync moved (the most any survivor received or sent). Printed
per size and arm: p50 / p95 / max of each, the ratio of each size's ``own`` p50 over the
smallest size's, and commit / live.

100M x Adam is 1.2 GB of state per rank, about 4 GB of memory per rank with gradients
and commit: three ranks need 12 GB free; 200M about 16 GB (13 GB used at its peak here);
300M (``--sizes 300M``) about 30 GB, more than this machine's 24. ``--kill-at 12
--after 6`` keeps the big sizes' runs to minutes (a step at 200M takes 4 s here).
"""
from __future__ import annotations

import argparse
import json
import math
import sqlite3
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.bench_state import parse_size   # noqa: E402
from bench.percentiles import percentile  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
REGATTA = str(Path(sys.executable).parent / "regatta")
LAYERS, INPUTS, CLASSES = 7, 512, 16
ARMS = {"live": [], "commit": ["--set", "train.recover_from=commit"]}


def width_for(params: int) -> int:
    """The MLP width whose parameter count is nearest ``params``."""
    return max(8, round(math.sqrt(params / (LAYERS - 1))))


def parameters(width: int) -> int:
    return (INPUTS + 1) * width + (LAYERS - 1) * (width + 1) * width + (width + 1) * CLASSES


def step_seconds_at(db: Path, size: int) -> float:
    """The median step time of the world at ``size`` (every rank's rows but the first
    step after the change, which holds what the recovery left to the step)."""
    with sqlite3.connect(db) as store:
        rows = store.execute("SELECT step, step_time FROM step_metric WHERE world_size = ? "
                             "ORDER BY step", (size,)).fetchall()
    first = min(step for step, _ in rows)
    return statistics.median(t for step, t in rows if step > first)


def measure(width: int, arm: str, seed: int, kill_at: int, after: int, workdir: Path) -> dict:
    name = f"w{width}-{arm}-{seed}"
    run_dir, report_path, db = workdir / name, workdir / f"{name}.json", workdir / f"{name}.db"
    cmd = [REGATTA, "local", "mlp", "--module", "bench.mlp", "--hosts", "3",
           "--steps", str(kill_at + after), "--sigkill", f"2@{kill_at}", "--commit-every", "10",
           "--seed", str(seed), "--timeout", "1800", "--run-dir", str(run_dir),
           "--report", str(report_path), "--", "--no-progress", "--db", str(db),
           "--set", f"model.width={width}", "--set", "train.optimizer=adam",
           "--set", "train.global_batch=24", "--set", "train.checkpoint_every=0",
           "--set", "train.eval_every=0", *ARMS[arm]]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1900)
    if done.returncode != 0:
        log = run_dir / "horovodrun.log"
        tail = log.read_text()[-1500:] if log.exists() else done.stderr[-1500:]
        raise RuntimeError(f"exit {done.returncode}:\n{tail}")
    report = json.loads(report_path.read_text())
    (change,) = [c for c in report["changes"] if c["kind"] == "failure"]
    syncs = [e for e in report["events"] if e["kind"] == "sync" and e["wall_time"] > change["wall_time"]
             and e.get("size") == 2]
    step = step_seconds_at(db, 2)
    first = [e["step_time"] for e in report["events"] if e["kind"] == "resumed"
             and e["wall_time"] > change["wall_time"] and e.get("size") == 2]
    return {"seconds": change["first_step_done_s"], "steps_redone": change["steps_redone"],
            "synced": change["state_synced_s"], "step": step, "first_step": max(first),
            "overhead": change["first_step_done_s"] - step,
            "moved_bytes": max((e.get("moved_bytes", 0) for e in syncs), default=None),
            "source": sorted({e.get("source") for e in syncs})}


def spread(values: list[float]) -> str:
    return (f"p50 {percentile(values, 0.5):7.3f}  p95 {percentile(values, 0.95):7.3f}  "
            f"max {max(values):7.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10M,100M")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kill-at", type=int, default=25, help="the step the kill comes after")
    parser.add_argument("--after", type=int, default=20, help="steps trained after the kill")
    parser.add_argument("--arms", default=",".join(ARMS), help="live, commit or both")
    args = parser.parse_args()
    for arm in set(ARMS) - set(args.arms.split(",")):
        del ARMS[arm]
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    results = {(size, arm): [] for size in sizes for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            width = width_for(size)
            print(f"== {parameters(width) / 1e6:.1f}M parameters (width {width}) x Adam, 3 hosts, "
                  f"one SIGKILLed after step {args.kill_at} ==", flush=True)
            for repeat in range(args.repeats):
                arms = list(ARMS) if repeat % 2 == 0 else list(reversed(ARMS))
                for arm in arms:
                    try:
                        row = measure(width, arm, repeat, args.kill_at, args.after, Path(tmp))
                    except RuntimeError as err:   # said, and counted out of the figures
                        print(f"  run {repeat + 1} {arm:6s} FAILED: {err}", flush=True)
                        continue
                    results[size, arm].append(row)
                    print_run(repeat, arm, row)
    print("\nkill -> first step done; of which a step at 2 (its median); the rest, the recovery's own")
    base = None
    for size in sizes:
        for arm in ARMS:
            rows = results[size, arm]
            if not rows:
                continue
            own = percentile([r["overhead"] for r in rows], 0.5)
            base = base or own
            print(f"{size / 1e6:5.0f}M  {arm:6s} done {spread([r['seconds'] for r in rows])}")
            print(f"{'':13s}synced {spread([r['synced'] for r in rows])}")
            print(f"{'':13s}step   {spread([r['step'] for r in rows])}")
            print(f"{'':13s}first  {spread([r['first_step'] for r in rows])}")
            print(f"{'':13s}own    {spread([r['overhead'] for r in rows])}  redone max "
                  f"{max(r['steps_redone'] for r in rows)}; own p50 / smallest size's {own / base:.2f}x")
        if set(ARMS) == {"live", "commit"} and results[size, "live"] and results[size, "commit"]:
            live = percentile([r["seconds"] for r in results[size, "live"]], 0.5)
            commit = percentile([r["seconds"] for r in results[size, "commit"]], 0.5)
            print(f"{size / 1e6:5.0f}M  p50 commit / live {commit / live:.2f}x")


def print_run(repeat: int, arm: str, row: dict) -> None:
    moved = "?" if row["moved_bytes"] is None else f"{row['moved_bytes'] / 2**20:.1f} MiB"
    print(f"  run {repeat + 1} {arm:6s} done {row['seconds']:7.3f} s  synced {row['synced']:6.3f}  "
          f"step {row['step']:6.3f}  first {row['first_step']:6.3f}  own {row['overhead']:6.3f}  "
          f"redone {row['steps_redone']}  "
          f"moved {moved}  from {'/'.join(map(str, row['source']))}", flush=True)


if __name__ == "__main__":
    main()
