"""Elastic state at model scale: Horovod's TorchState (stock) and Regatta side by side.

    .venv/bin/python bench/bench_state.py [--sizes 10M,100M] [--dp 2,3] [--repeats 3] [--additions 10]

For each model size (an MLP of 10 square layers, Adam) and data-parallel width, the
three flavours run under a real ``horovodrun --gloo`` on this machine (bench/state_worker.py
says what each measures), one after the other, the order alternating from one
configuration to the next. Per metric it prints p50 / p95 / max over repeats and ranks, and
the ratios of the p50s, regatta / stock and regatta / regatta-commit (the same runtime
going back to the commit after every failure, as before survivors kept their live state):

* commit: one in-memory commit; restore: a failure's restore plus the sync after the
  reset (Horovod's elastic loop always runs both); sync to a new worker;
* durable checkpoint: what the training loop waits for, and the write itself;
* step time while a checkpoint is being written over a step without, per round against
  the round's own steps without a write (rank 0's steps), p50 / p95 / max over rounds,
  beside the same ratio of a control round with nothing written after each (A/B/A/B) and
  the write's over its control (the method's bias divided out);
* extra memory per rank for the commit (RSS); the high-water mark of each rank (VmHWM),
  rank 0's shared-memory snapshot and its writer process's own memory (USS; its VmHWM),
  and all of them together: what the job held at its peak.

Then the time a host takes to join (``--additions`` of them per flavour, 0: none): one
``regatta local digits`` run per flavour on 2 simulated hosts, a third listed for
discovery every ADD_EVERY steps and removed half-way to the next (a drained node coming
back); from the edit of the discovery file to the first step done with the new worker,
p50 / p95 / max, and the phases of each addition (re-initialised, synced). Stock is
bench/stock_elastic.py (Horovod's documented loop, fresh Python per worker), as in
bench_recovery. ``--sizes ""`` skips the state part.

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
sys.path.insert(0, str(ROOT))

from bench.percentiles import percentile   # noqa: E402
from elastic.launch.loopback import host_name   # noqa: E402
from elastic.launch.stopping import Stopping, stop_tree   # noqa: E402

HOROVODRUN = str(Path(sys.executable).parent / "horovodrun")
REGATTA_LOCAL = [sys.executable, "-m", "regatta", "local"]
STOCK_LOOP = ["--module", "bench.stock_elastic", "--stock-recovery", "--cold-workers"]
ADD_EVERY = 1200    # steps from one addition to the next (stock takes ~400 to add a host)
FLAVOURS = ("stock", "regatta-commit", "regatta")   # state_worker.py says what each is
ADDITION_FLAVOURS = ("stock", "regatta")
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
    done = run_bounded(cmd, env, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{flavour} {params} dp={dp} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def run_bounded(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run`` that leaves nothing behind: on a timeout, or the bench stopped by
    a signal, every process under ``cmd`` ends (horovodrun gives its workers their own
    process groups, and 3 ranks of 100M hold 8 GB)."""
    with Stopping() as stopping:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        stopping.forward_to(proc, group=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        finally:
            stop_tree(proc)
    if stopping.requested:
        raise SystemExit(128 + stopping.requested)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def spread(values: list[float], unit: float = 1.0) -> str:
    """p50 / p95 / max."""
    return "/".join(f"{v / unit:.3f}" for v in (percentile(values, 0.5), percentile(values, 0.95), max(values)))


def write_slowdown(root: dict) -> dict:
    """A step while a checkpoint is written over a step without, from rank 0's rounds, and
    the same ratio of each round's control (nothing written), and their quotient.

    Each round's ratio is taken against the plain steps just before it, so load drifting
    over the run does not pass for the write's cost; the control's ratio is what the
    method alone makes of a round's later steps (they had run faster: 0.78-0.86x), which
    the corrected ratio divides out. Stock writes inside the loop: its step that writes
    takes the write on top."""
    ratios, controls, overlapped = [], [], 0
    for plain, writing, blocking, c_plain, c_after in zip(
            root["plain_s"], root["writing_s"], root["checkpoint_s"],
            root["control_plain_s"], root["control_after_s"]):
        step = statistics.median(plain)
        during = statistics.median(writing) if writing else step + blocking
        ratios.append(during / step)
        controls.append(statistics.median(c_after) / statistics.median(c_plain))
        overlapped += len(writing)
    return {"ratios": ratios, "controls": controls,
            "corrected": [r / c for r, c in zip(ratios, controls)], "overlapped": overlapped,
            "pooled": statistics.median(sum(root["writing_s"], []) or [float("nan")])
            / statistics.median(sum(root["plain_s"], []))}


def summarise(ranks: list[dict]) -> dict:
    root = ranks[0]
    return {
        "commit_s": [v for r in ranks for v in r["commit_s"]],
        "restore_s": [v for r in ranks for v in r["restore_s"]],
        "sync_new_s": [v for r in ranks for v in r["sync_new_s"]],
        "checkpoint_blocking_s": root["checkpoint_s"], "checkpoint_write_s": root["write_s"],
        "step_s": sum(root["plain_s"], []), "slowdown": write_slowdown(root),
        "commit_mb": [r["commit_rss"] / MB for r in ranks], "peak_mb": [r["peak_rss"] / MB for r in ranks],
        "snapshot_mb": [root["snapshot_bytes"] / MB], "writer_mb": [root["writer_uss"] / MB],
        "writer_peak_mb": [root["writer_hwm"] / MB],
        # everything the flavour held at once, at most: every rank's peak and the writer's own
        "job_peak_mb": [sum(r["peak_rss"] + r["writer_uss"] for r in ranks) / MB],
        "newcomer": [n for r in ranks for n in r.get("newcomer", [])],
        "p2p_gbps": [v for r in ranks for v in r.get("p2p_gbps", [])], "cores": root.get("cores", 1),
    }


ROWS = (("commit (s)", "commit_s", 1.0), ("restore + sync (s)", "restore_s", 1.0),
        ("sync to a new worker (s)", "sync_new_s", 1.0),
        ("checkpoint: loop waits (s)", "checkpoint_blocking_s", 1.0),
        ("checkpoint: write (s)", "checkpoint_write_s", 1.0), ("step without a write (s)", "step_s", 1.0),
        ("extra commit memory/rank (MB)", "commit_mb", 1.0), ("peak memory/rank, VmHWM (MB)", "peak_mb", 1.0),
        ("rank 0's snapshot shm (MB)", "snapshot_mb", 1.0), ("rank 0's writer, USS (MB)", "writer_mb", 1.0),
        ("rank 0's writer, VmHWM (MB)", "writer_peak_mb", 1.0),
        ("all ranks' VmHWM + writer (MB)", "job_peak_mb", 1.0))


def report(params: int, dp: int, results: dict) -> dict:
    stock, rollback, ours = (summarise(results[f]) for f in FLAVOURS)
    print(f"\n== {results['regatta'][0]['params'] / 1e6:.1f}M parameters (Adam), dp = {dp} ==")
    print(f"{'':30s} {'stock p50/p95/max':>22s} {'regatta-commit p50/p95/max':>26s} "
          f"{'regatta p50/p95/max':>22s} {'/stock':>7s} {'/commit':>7s}")
    for label, key, unit in ROWS:
        p50 = {name: max(statistics.median(r[key]), 1e-9) for name, r in zip(FLAVOURS, (stock, rollback, ours))}
        against = {name: f"{p50['regatta'] / p50[name]:7.2f}" if p50[name] > 1e-6 else f"{'-':>7s}"
                   for name in ("stock", "regatta-commit")}   # stock has no writer nor snapshot
        print(f"{label:30s} {spread(stock[key], unit):>22s} {spread(rollback[key], unit):>26s} "
              f"{spread(ours[key], unit):>22s} {against['stock']} {against['regatta-commit']}")
    for name, result in zip(FLAVOURS, (stock, rollback, ours)):
        slowdown = result["slowdown"]
        print(f"step while writing / without, {name:14s} {distribution(slowdown['ratios'])}, control "
              f"{distribution(slowdown['controls'])}, corrected {distribution(slowdown['corrected'])} "
              f"over {len(slowdown['ratios'])} rounds; {slowdown['overlapped']} steps overlapped a write"
              + (f", pooled {slowdown['pooled']:.3f}" if slowdown["overlapped"] else ""))
        print(f"{'':30s}each round (write / control): " + " ".join(
            f"{r:.3f}/{c:.3f}" for r, c in zip(slowdown["ratios"], slowdown["controls"])))
    for name, result in (("regatta-commit", rollback), ("regatta", ours)):
        report_transfer(name, result)
    return {"memory_ratio": statistics.median(ours["commit_mb"]) / statistics.median(stock["commit_mb"]),
            "job_memory_ratio": ours["job_peak_mb"][0] / stock["job_peak_mb"][0],
            "slowdown": percentile(ours["slowdown"]["corrected"], 0.5)}


def report_transfer(name: str, ours: dict) -> None:
    """The newcomer's transfer against the link's bound (state_worker.py says how each is
    measured)."""
    if not ours["newcomer"] or not ours["p2p_gbps"]:
        return
    rates = [n["bytes"] / n["seconds"] / 1e9 for n in ours["newcomer"]]
    senders = ours["newcomer"][0]["senders"]
    at_once = max(1, min(senders, ours["cores"] - 1))
    link = statistics.median(ours["p2p_gbps"])
    bound = link * at_once
    print(f"newcomer's transfer, {name}: {distribution(rates)} GB/s ({ours['newcomer'][0]['bytes'] / 1e9:.2f} GB "
          f"from {senders} senders); one loopback TCP stream {distribution(ours['p2p_gbps'])} GB/s x "
          f"{at_once} sender(s) at once on {ours['cores']} cores = bound {bound:.2f} GB/s; "
          f"p50 / bound {statistics.median(rates) / bound:.2f}")


def distribution(values: list[float]) -> str:
    return f"p50 {percentile(values, 0.5):.3f} p95 {percentile(values, 0.95):.3f} max {max(values):.3f}"


def addition_plan(count: int) -> list[str]:
    """The third host listed every ADD_EVERY steps and removed half-way to the next."""
    host, args = host_name(2), []
    for index in range(count):
        at = 100 + index * ADD_EVERY
        args += ["--add", f"{host}@{at}", "--remove", f"{host}@{at + ADD_EVERY // 2}"]
    return args


def additions(flavour: str, count: int, folder: Path) -> list[dict]:
    """The report's ``host_added`` changes of one run of ``count`` additions."""
    run = folder / f"additions-{flavour}"
    cmd = [*REGATTA_LOCAL, "digits", "--hosts", "2", "--steps", str(100 + count * ADD_EVERY),
           "--commit-every", "10", *addition_plan(count), *(STOCK_LOOP if flavour == "stock" else []),
           "--timeout", "3000", "--run-dir", str(run), "--report", str(run / "report.json"),
           "--", "--db", str(folder / "additions.db")]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "REGATTA_SPOOL_DIR": str(folder / "spool")}
    done = run_bounded(cmd, env, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"additions ({flavour}) failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    report = json.loads((run / "report.json").read_text())
    return [c for c in report["changes"] if c["kind"] == "host_added"]


def report_additions(found: dict, count: int) -> float:
    """Prints the distributions side by side; regatta's p95 (s)."""
    print(f"\n== a host joining: {count} additions per flavour (digits, 2 hosts + 1) ==")
    print(f"{'':10s} {'joined':>7s} {'p50':>7s} {'p95':>7s} {'max':>7s}   "
          f"{'noticed p50':>11s} {'re-initialised p50':>18s} {'synced p50':>10s}")
    p95 = {}
    for flavour, changes in found.items():
        joined = [c for c in changes if c["size_after"] == 3 and c["first_step_done_s"] is not None]
        seconds = [c["first_step_done_s"] for c in joined] or [float("nan")]
        p95[flavour] = percentile(seconds, 0.95)
        phase = {key: statistics.median([c[key] for c in joined if c[key] is not None] or [float("nan")])
                 for key in ("detected_s", "reset_done_s", "state_synced_s")}
        shown = {key: f"{value:.2f}" if value == value else "-" for key, value in phase.items()}
        print(f"{flavour:10s} {len(joined):3d}/{len(changes):<3d} {statistics.median(seconds):7.2f} "
              f"{p95[flavour]:7.2f} {max(seconds):7.2f}   {shown['detected_s']:>11s} {shown['reset_done_s']:>18s} "
              f"{shown['state_synced_s']:>10s}")
    for flavour, changes in found.items():
        print(f"{flavour:10s} each (s): " + " ".join(
            f"{c['first_step_done_s']:.2f}" if c["first_step_done_s"] is not None else "-" for c in changes))
    print(f"p95 regatta / stock: {p95['regatta'] / p95['stock']:.2f}")
    return p95["regatta"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10M,100M")
    parser.add_argument("--dp", default="2,3")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="steps without a write per checkpoint round")
    parser.add_argument("--additions", type=int, default=10, help="host additions per flavour (0: none)")
    args = parser.parse_args()
    print("load average at start:", Path("/proc/loadavg").read_text().strip())
    goals, order = {}, list(FLAVOURS)
    with tempfile.TemporaryDirectory(prefix="bench-state-") as tmp:
        for params in map(parse_size, filter(None, args.sizes.split(","))):
            for dp in map(int, args.dp.split(",")):
                results = {}
                for flavour in order:
                    results[flavour] = launch(flavour, params, dp, args.repeats, args.steps, Path(tmp))
                order.reverse()     # alternate, so load drifts hit both alike
                goals[params, dp] = report(params, dp, results)
        if args.additions:
            found = {flavour: additions(flavour, args.additions, Path(tmp)) for flavour in ADDITION_FLAVOURS}
            addition_p95 = report_additions(found, args.additions)
    print("\nload average at end:", Path("/proc/loadavg").read_text().strip())
    for (params, dp), goal in goals.items():
        print(f"{params / 1e6:.0f}M dp={dp}: commit memory regatta/stock {goal['memory_ratio']:.2f} "
              f"(2/dp by design), the job's peak memory regatta/stock {goal['job_memory_ratio']:.2f}; "
              f"step while writing {goal['slowdown']:.3f}x per round p50, over its control (goal <= 1.05)")
    if args.additions:
        print(f"addition p95 {addition_p95:.2f} s (goal <= 1 s)")


if __name__ == "__main__":
    main()
