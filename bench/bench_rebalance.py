"""Static stage boundaries against automatic rebalancing, side by side in one mpirun launch.

    .venv/bin/python bench/bench_rebalance.py [--steps 200] [--layers 8] [--dim 64] [--slow 3] [--repeats 1]

Starts ``mpirun -np 2`` on itself (charlm, pp = 2, 1F1B) and runs two scenarios, each
static then rebalanced, alternating, ``--repeats`` times:

* slowed rank: balanced boundaries, rank 1 (stage 1) slowed ``--slow`` x by fault
  injection (REGATTA_SLOW_RANKS: it sleeps that factor minus one times each child's
  forward and backward time, as a slower machine would take);
* lopsided: no slowdown, stage 0 holds only the embedding (boundaries 0,1).

The lopsided scenario gains only when both ranks have a core of their own: on a machine
already busy with other work, evening out the stages adds CPU demand, not parallelism
(the load average is printed). Prints samples/s over the whole run (the rebalancer's measuring windows and the move
included) and over the last half (steady state), and rebalanced / static. The rebalancer
acts after 4 warm-up steps and two 4-step windows above 1.2 imbalance (planner.rebalance_*).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCENARIOS = ("slowed rank", "lopsided")


def options(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--layers", type=int, default=8, help="transformer blocks (children - 2)")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--slow", type=float, default=3.0, help="slowdown of rank 1 (slowed-rank scenario)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", default="runs/bench_rebalance")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def cases(opts) -> list[tuple[str, bool, list, float]]:
    half = (opts.layers + 2) // 2
    shapes = {"slowed rank": ([0, half], opts.slow), "lopsided": ([0, 1], 1.0)}
    return [(name, rebalance, *shapes[name]) for _ in range(opts.repeats)
            for name in SCENARIOS for rebalance in (False, True)]


def worker(opts) -> None:
    from elastic.config import TrainConfig
    from elastic.runtime.events import read_events
    from elastic.pipeline.config import PipelineConfig
    from elastic.pipeline.planner import PlannerConfig
    from elastic.pipeline.rebalance import SLOW_ENV
    from elastic.train import train
    from jobs.charlm import CharLMConfig, CharLMJob
    rank = None
    job = CharLMJob(CharLMConfig(context=32, dim=opts.dim, heads=4, layers=opts.layers))
    results = []
    for index, (name, rebalance, boundaries, slow) in enumerate(cases(opts)):
        os.environ[SLOW_ENV] = f"1:{slow}"
        run_dir = Path(opts.out) / f"case{index}"
        configs = {"train": TrainConfig(steps=opts.steps, global_batch=16, lr=0.003, seed=1,
                                        progress=False, commit_every=opts.steps, checkpoint_every=1,
                                        run_dir=str(run_dir), db=str(run_dir / "m.db")),
                   "pipeline": PipelineConfig(pp=2, microbatches=4, boundaries=boundaries,
                                              transport="mpi"),
                   "planner": PlannerConfig(rebalance=rebalance)}
        records = []
        train(job, configs, callbacks=[records.append])
        walls, rank = [r["wall_time"] for r in records], records[0]["rank"]
        moves = [e for e in read_events(run_dir) if e["kind"] == "rebalance" and e["rank"] == 0]
        results.append({"name": name, "rebalance": rebalance, "walls": walls,
                        "moves": [(e["step"], e["old"], e["new"]) for e in moves]})
    if rank == 0:
        (Path(opts.out) / "results.json").write_text(json.dumps(results))


def throughput(walls: list[float], first: int) -> float:
    """Samples/s from step ``first`` (1-based) to the end; 16 samples per step."""
    return 16 * (len(walls) - first) / (walls[-1] - walls[first - 1])


def main(argv=None) -> None:
    opts = options(argv)
    shutil.rmtree(opts.out, ignore_errors=True)    # a checkpoint left there would be resumed
    Path(opts.out).mkdir(parents=True)
    command = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "OMP_NUM_THREADS=1",
               "-x", "PYTHONPATH", sys.executable, __file__, "--worker", *(argv or sys.argv[1:])]
    subprocess.run(command, check=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                   timeout=1800)
    load = os.getloadavg()[1]    # 5-minute average: other work competing for the cores
    results = json.loads((Path(opts.out) / "results.json").read_text())
    print(f"charlm pp=2 dim={opts.dim} blocks={opts.layers}, {opts.steps} steps, "
          f"global batch 16, 1F1B m=4, rank 1 slowed {opts.slow}x in 'slowed rank'; "
          f"load average {load:.1f} on {os.cpu_count()} cores")
    print(f"{'scenario':<12} {'samples/s whole run':>30} {'samples/s last half':>30}  moves")
    print(f"{'':<12} {'static':>9} {'rebal.':>9} {'ratio':>9}   {'static':>9} {'rebal.':>9} {'ratio':>9}")
    for name in SCENARIOS:
        rows = {r: [x for x in results if x["name"] == name and x["rebalance"] == r] for r in (False, True)}
        whole = [statistics.median(throughput(x["walls"], 1) for x in rows[r]) for r in (False, True)]
        tail = [statistics.median(throughput(x["walls"], opts.steps // 2) for x in rows[r])
                for r in (False, True)]
        moves = "; ".join(f"step {s}: {o}->{n}" for s, o, n in rows[True][0]["moves"])
        print(f"{name:<12} {whole[0]:9.1f} {whole[1]:9.1f} {whole[1] / whole[0]:8.2f}x   "
              f"{tail[0]:9.1f} {tail[1]:9.1f} {tail[1] / tail[0]:8.2f}x  {moves}")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(options())
    else:
        main()
