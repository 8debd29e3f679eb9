"""Steady-state training speed, Regatta vs a stock Horovod DistributedOptimizer loop vs
torch DDP (Gloo), each baseline at its defaults and tuned, side by side in one run, 2 ranks.

    .venv/bin/python bench/bench_throughput.py            # a few minutes
    .venv/bin/python bench/bench_throughput.py --quick    # fewer, shorter turns

Models: charlm (jobs/charlm.py, compute-heavy: 1.4 MB of gradients) and a ~26M-parameter
MLP (bench/mlp.py, communication-heavy: 105 MB of gradients a step). Per model, the five
arms are started once, each warmed up alone, then take turns: only one arm runs at a
time (the others are stopped with SIGSTOP, so they use no CPU), for ``--turn`` seconds,
in an order that rotates every round. Load that comes and goes on the machine hits every
arm alike, and no arm pays another's start-up.

* regatta: ``regatta local`` (horovodrun elastic, 2 simulated hosts), the job through
  ``elastic.train.train`` with its default reduction (bench/throughput_worker.py);
* stock: the same launcher, Horovod's documented elastic loop with DistributedOptimizer;
* stock at each point of ``--stock-sweep`` (``stock-<cycle>ms-<fusion>MiB``): the same
  with ``HOROVOD_CYCLE_TIME`` and ``HOROVOD_FUSION_THRESHOLD`` set. Horovod's docs give no
  CPU values for either; they point to its autotuner, which searches these two knobs. The
  sweep is that search done by hand, side by side: by default cycles of 2.5, 5 and 10 ms
  (Horovod's default is 1 ms, the plain stock arm) at Regatta's bucket size, and 5 ms at
  Horovod's default 64 MiB. **stock-tuned** is the sweep's fastest point (median steps/s),
  chosen after the turns; picked from the same turns it is measured in, it is if anything
  flattered by the noise;
* ddp: ``torchrun``, DistributedDataParallel over Gloo, at its defaults;
* ddp-tuned: the same with ``gradient_as_bucket_view=True`` and Regatta's bucket size
  (``bucket_cap_mb``), as a user tuning it would.

Same job, data split, optimizer, global batch, allocator setting (``--allocator``: by
default every arm keeps the memory it frees, as Regatta's runtime does, see
elastic/runtime/memory.py and bench_allocator.py) and threads per rank everywhere (an
``OMP_NUM_THREADS`` in the environment changes Regatta's alone, which follows it; the table
says each arm's threads); Regatta commits only at its start (as the stock loop's
TorchState does). An arm's rate in a turn is its rank 0's steps that ended inside the
turn, over the time between the first and the last of them (a step cut by a stop is not
counted). Prints steps/s and samples/s (median,
min, max over the rounds), the ratios per round (median and range), Regatta's overlap and
exposed communication, the bus bandwidth a plain allreduce of the gradients reaches over
each transport against the memory-copy bound, the peak RSS per rank (VmHWM), and
/proc/loadavg. As root it runs in a private network namespace (``unshare --net``), so
another ``regatta local`` on the machine adding or removing loopback aliases cannot break
its simulated hosts (``--shared-network``: not).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BIN = Path(sys.executable).parent
# at 1 ms, Horovod's default cycle, the stock loop's threads took 25-33 % of a rank's CPU
# on two cores (docs/measurements.md); "bucket": Regatta's bucket size, in MiB
STOCK_SWEEP = "2.5:bucket,5:bucket,10:bucket,5:64"
MODELS = ("charlm", "mlp")
ALLOCATORS = ("kept", "glibc", "shipped")
RANKS = 2
FOREVER = 1_000_000              # steps: the bench stops the arms itself
ISOLATED = "REGATTA_BENCH_ISOLATED"


def options(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="charlm,mlp", help="comma-separated: charlm, mlp")
    parser.add_argument("--rounds", type=int, default=5, help="turns per arm")
    parser.add_argument("--turn", type=float, default=8.0, help="seconds per turn")
    parser.add_argument("--warmup", type=int, default=5, help="steps each arm runs alone first")
    parser.add_argument("--quick", action="store_true", help="3 rounds of 4 s turns")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="config override for every arm, e.g. train.global_batch=64")
    parser.add_argument("--allocator", choices=ALLOCATORS, default="kept",
                        help="kept: every arm keeps freed memory as Regatta's runtime does (the "
                             "engines compared alone); glibc: every arm on glibc's default; "
                             "shipped: each arm as it ships (Regatta kept, the others glibc)")
    parser.add_argument("--shared-network", action="store_true",
                        help="stay in this network namespace (default as root: a private one)")
    parser.add_argument("--stock-sweep", default=STOCK_SWEEP, metavar="CYCLE_MS:FUSION_MIB,...",
                        help="Horovod settings of the stock loop to measure beside its defaults; "
                             "FUSION_MIB may be 'bucket' (Regatta's bucket size); the fastest is "
                             f"stock-tuned (default {STOCK_SWEEP})")
    opts = parser.parse_args(argv)
    try:
        opts.sweep = stock_sweep(opts.stock_sweep, bucket_mb(opts.set))
    except ValueError as error:
        parser.error(f"--stock-sweep: {error}")
    opts.models = [m for m in opts.models.split(",") if m]
    unknown = sorted(set(opts.models) - set(MODELS))
    if unknown:
        parser.error(f"unknown model {unknown[0]!r}; known: {', '.join(MODELS)}")
    if opts.quick:
        opts.rounds, opts.turn = 3, 4.0
    return opts


def stock_sweep(spec: str, bucket: float) -> dict[str, tuple[float, float]]:
    """``"2.5:bucket,5:64"`` -> {arm name: (cycle ms, fusion MiB)}."""
    points = {}
    for item in filter(None, spec.split(",")):
        cycle, sep, fusion = item.partition(":")
        if not sep:
            raise ValueError(f"{item!r} is not CYCLE_MS:FUSION_MIB")
        try:
            point = (float(cycle), bucket if fusion == "bucket" else float(fusion))
        except ValueError:
            raise ValueError(f"{item!r}: numbers expected (or 'bucket' for the fusion)") from None
        if point[0] <= 0 or point[1] <= 0:
            raise ValueError(f"{item!r}: the cycle and the fusion threshold must be positive")
        points[f"stock-{point[0]:g}ms-{point[1]:g}MiB"] = point
    return points


def arms_of(opts) -> tuple[str, ...]:
    return ("regatta", "stock", *opts.sweep, "ddp", "ddp-tuned")


# -- the arms' processes -------------------------------------------------------------------
def start(arm: str, model: str, run_dir: Path, overrides: list[str], allocator: str,
          horovod: tuple[float, float] | None = None) -> subprocess.Popen:
    """``horovod``: (cycle ms, fusion MiB) for a point of the stock sweep."""
    job_args = ["--arm", arm, "--model", model, "--db", str(run_dir / "m.db"),
                *[f"--set={pair}" for pair in overrides]]
    if arm.startswith("ddp"):
        command = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(RANKS), "-m",
                   "bench.throughput_worker", "--run-dir", str(run_dir), "--steps", str(FOREVER),
                   "--no-progress", *job_args]
    else:   # a long Gloo timeout: a stopped arm may be stopped inside a collective
        # Loopback aliases, not namespaced hosts: the ranks' pids (which the turns stop and
        # continue) are then this process's, and Gloo runs on lo like the other arms.
        command = [str(BIN / "regatta"), "local", model, "--module", "bench.throughput_worker",
                   "--aliases", "--hosts", str(RANKS), "--steps", str(FOREVER), "--commit-every", str(FOREVER),
                   "--gloo-timeout", "3600", "--timeout", "36000", "--run-dir", str(run_dir),
                   "--", *job_args]
    # Gloo on loopback, as horovodrun's --network-interface lo (all ranks are local). No
    # OMP_NUM_THREADS of the bench's own: Regatta would follow it, the other arms not.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "lo",
           **allocator_env(arm, allocator)}
    if horovod is not None:
        env.update(HOROVOD_CYCLE_TIME=f"{horovod[0]:g}", HOROVOD_FUSION_THRESHOLD=str(int(horovod[1] * 2**20)))
    run_dir.mkdir(parents=True, exist_ok=True)
    log = open(launcher_log(run_dir), "w")
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def bucket_mb(overrides: list[str]) -> float:
    """Regatta's bucket size in this run (``--set train.bucket_mb=...``, else its default)."""
    from elastic.config import TrainConfig
    for pair in overrides:
        key, _, value = pair.partition("=")
        if key == "train.bucket_mb":
            return float(value)
    return TrainConfig().bucket_mb


def allocator_env(arm: str, allocator: str) -> dict:
    """Whether the arm keeps freed memory (elastic/runtime/memory.py): Regatta's runtime
    reads REGATTA_KEEP_FREED_MEMORY, the other arms' worker the same variable."""
    keep = allocator == "kept" or (allocator == "shipped" and arm == "regatta")
    return {"REGATTA_KEEP_FREED_MEMORY": "1" if keep else "0"}


def launcher_log(run_dir: Path) -> Path:
    """Beside the run dir: ``regatta local`` starts from an empty one."""
    return run_dir.with_name(run_dir.name + ".launcher.log")


def read_log(run_dir: Path, arm: str, rank: int) -> tuple[dict, list[dict]]:
    path = run_dir / "throughput" / f"{arm}-{rank}.jsonl"
    if not path.exists():
        return {}, []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return (lines[0], lines[1:]) if lines else ({}, [])


def warm_up(arm: str, proc: subprocess.Popen, run_dir: Path, steps: int) -> list[int]:
    """Wait for every rank's first ``steps`` steps; the ranks' pids."""
    deadline = time.monotonic() + 600
    while True:
        logs = [read_log(run_dir, arm, rank) for rank in range(RANKS)]
        if all(len(steps_) >= steps for _, steps_ in logs):
            return [header["pid"] for header, _ in logs]
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = launcher_log(run_dir).read_text()[-3000:]
            hvd = run_dir / "horovodrun.log"
            raise SystemExit(f"{arm} did not warm up ({proc.poll()}):\n{tail}"
                             f"{hvd.read_text()[-3000:] if hvd.exists() else ''}")
        time.sleep(0.2)


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def stop_arm(proc: subprocess.Popen, pids: list[int]) -> None:
    signal_all(pids, signal.SIGCONT)
    signal_all(pids, signal.SIGKILL)
    try:
        os.killpg(proc.pid, signal.SIGTERM)   # regatta local stops horovodrun and its agents
        proc.wait(20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


# -- one model -------------------------------------------------------------------------------
def measure(model: str, opts, workdir: Path) -> dict:
    """Start, warm up and stop each arm, then give them turns; what each did in each turn."""
    arms: dict[str, tuple] = {}
    try:
        every = arms_of(opts)
        for arm in every:
            run_dir = workdir / f"{model}-{arm}"
            proc = start(arm, model, run_dir, opts.set, opts.allocator, opts.sweep.get(arm))
            pids = warm_up(arm, proc, run_dir, opts.warmup)
            signal_all(pids, signal.SIGSTOP)
            arms[arm] = (proc, pids, run_dir)
            print(f"{model}: {arm} warmed up", flush=True)
        turns = {arm: [] for arm in every}
        for round_ in range(opts.rounds):
            order = every[round_ % len(every):] + every[:round_ % len(every)]
            for arm in order:
                _, pids, _ = arms[arm]
                signal_all(pids, signal.SIGCONT)
                began = time.time()
                time.sleep(opts.turn)
                signal_all(pids, signal.SIGSTOP)
                turns[arm].append((began, time.time(), loadavg()))
            print(f"{model}: round {round_ + 1} of {opts.rounds}, load {loadavg()}", flush=True)
        rss = {arm: [peak_rss(pid) for pid in pids] for arm, (_, pids, _) in arms.items()}
    finally:
        for proc, pids, _ in arms.values():
            stop_arm(proc, pids)
    logs = {arm: read_log(run_dir, arm, 0) for arm, (_, _, run_dir) in arms.items()}
    return {"turns": turns, "rss": rss, "logs": logs}


def turn_rate(steps: list[dict], began: float, ended: float) -> float | None:
    ends = [s["t"] for s in steps if began <= s["t"] <= ended]
    return (len(ends) - 1) / (ends[-1] - ends[0]) if len(ends) >= 2 and ends[-1] > ends[0] else None


def spread(values: list[float], fmt: str = "{:.3f}") -> str:
    return (f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-"
            f"{fmt.format(max(values))}]")


def report(model: str, result: dict, memcpy: float, sweep: dict) -> None:
    turns, logs = result["turns"], result["logs"]
    arms = tuple(turns)
    rates = {arm: [turn_rate(logs[arm][1], b, e) for b, e, _ in turns[arm]] for arm in arms}
    header = logs["stock"][0]
    batch, nbytes = header["global_batch"], header["grad_bytes"]
    print(f"\n== {model}: {nbytes / 2**20:.1f} MiB of gradients, global batch {batch}, {RANKS} ranks, "
          f"{len(turns['regatta'])} turns of each arm")
    print(f"{'arm':21} {'steps/s median [min-max]':>26} {'samples/s':>10} {'peak RSS/rank MiB':>18} "
          f"{'threads/rank':>12} {'freed memory':>12}")
    for arm in arms:
        good = [r for r in rates[arm] if r is not None]
        kept = {True: "kept", False: "glibc"}.get(logs[arm][0].get("keeps_freed_memory"), "?")
        print(f"{arm:21} {spread(good):>26} {statistics.median(good) * batch:10.1f} "
              f"{max(result['rss'][arm]) / 2**20:18.0f} {logs[arm][0].get('threads', '?'):>12} "
              f"{kept:>12}")
    tuned = max(sweep, key=lambda arm: statistics.median(r for r in rates[arm] if r is not None),
                default="stock")
    cycle, fusion = sweep.get(tuned, (None, None))
    print(f"stock-tuned = {tuned}: the fastest of the sweep (HOROVOD_CYCLE_TIME={cycle} ms, "
          f"HOROVOD_FUSION_THRESHOLD={fusion} MiB); ddp-tuned: {logs['ddp-tuned'][0].get('ddp_options')}")
    for name, other in (("stock", "stock"), ("stock-tuned", tuned), ("ddp", "ddp"), ("ddp-tuned", "ddp-tuned")):
        ratios = [a / b for a, b in zip(rates["regatta"], rates[other]) if a and b]
        print(f"regatta / {name:11}: {spread(ratios)} per round")
    rows = [s for b, e, _ in turns["regatta"] for s in logs["regatta"][1] if b <= s["t"] <= e]
    overlap = [s["overlap"] for s in rows if s.get("overlap") is not None]
    exposed = [s["comm_time"] / s["step_time"] for s in rows if s.get("step_time")]
    print(f"regatta: overlap (share of communication hidden behind backward) median "
          f"{statistics.median(overlap) if overlap else 0:.2f}; exposed communication / step "
          f"time median {statistics.median(exposed):.3f}")
    for arm, name in (("stock", "Horovod (Gloo)"), ("ddp", "torch.distributed Gloo")):
        seconds = logs[arm][0]["allreduce_s"]
        bus = nbytes * 2 * (RANKS - 1) / RANKS / seconds
        print(f"allreduce of the gradients alone, {name:22}: {seconds * 1e3:7.1f} ms, bus bandwidth "
              f"{bus / 1e9:5.2f} GB/s = {bus / memcpy:.2f} x memcpy ({memcpy / 1e9:.1f} GB/s)")
    loads = [load for arm in arms for _, _, load in turns[arm]]
    print(f"loadavg (1 min) during the turns: {min(loads):.2f}-{max(loads):.2f}")


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def isolate(argv: list[str]) -> None:
    """Run this bench again in a private network namespace with its loopback up."""
    command = " ".join(["ip link set lo up && exec", *map(shlex.quote, [sys.executable, __file__, *argv])])
    env = {**os.environ, ISOLATED: "1"}
    raise SystemExit(subprocess.run(["unshare", "--net", "--fork", "sh", "-c", command], env=env).returncode)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    opts = options(argv)
    if (not opts.shared_network and os.geteuid() == 0 and shutil.which("unshare")
            and not os.environ.get(ISOLATED)):
        isolate(argv)
    from elastic.runtime.reporting import memcpy_bandwidth
    print(f"loadavg at start: {Path('/proc/loadavg').read_text().strip()}; network namespace: "
          f"{'private' if os.environ.get(ISOLATED) else 'shared'}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-throughput-") as tmp:
        results = {model: measure(model, opts, Path(tmp)) for model in opts.models}
    memcpy = memcpy_bandwidth()
    for model in opts.models:
        report(model, results[model], memcpy, opts.sweep)
    print(f"\nloadavg at end: {Path('/proc/loadavg').read_text().strip()}")


if __name__ == "__main__":
    main()
