"""One Horovod elastic script, on stock Horovod and on Regatta by its import line: what a
SIGKILL of one worker costs each.

    .venv/bin/python bench/bench_horovod_dropin.py [--repeats 5] [--kill-after 25]

Both arms run under ``regatta local`` on 3 simulated hosts, each worker a fresh Python
started by horovodrun (``--cold-workers``): tests/workers/horovod_mnist_elastic_stock.py
(``import horovod.torch as hvd``) with Horovod's own discovery and failure detection
(``--stock-recovery``), examples/horovod_mnist_elastic.py (``import regatta.horovod as
hvd``) with Regatta's. Rank 0 prints every batch (``--log-interval 1``); the bench
reads those lines as they come and, at a random instant within 0.5 s of batch
``--kill-after``, SIGKILLs the worker of host 2 itself, from outside, the same way for both
arms (found by its HOROVOD_HOSTNAME). Measured from the script's own lines: seconds from
the kill to the first batch printed by 2 workers, and the run's wall time. The arms
alternate run by run. Printed per arm: p50 / p95 / max, and the ratio of the p50s.
"""
from __future__ import annotations

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.percentiles import percentile  # noqa: E402
from elastic.launch.loopback import host_name  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
REGATTA = str(Path(sys.executable).parent / "regatta")
ARMS = {"stock": (ROOT / "tests" / "workers" / "horovod_mnist_elastic_stock.py",
                  ["--stock-recovery", "--cold-workers"]),
        "regatta": (ROOT / "examples" / "horovod_mnist_elastic.py", ["--cold-workers"])}
BATCH = re.compile(rb"Train epoch \d+ batch \d+ workers (\d+)")
POLL_S = 0.005


def workers_of(host: str, script: Path) -> list[int]:
    """The pids of ``script``'s training processes on simulated ``host``."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if f"HOROVOD_HOSTNAME={host}".encode() in environ and script.name.encode() in cmdline \
                and b"horovodrun" not in cmdline:
            found.append(int(proc.name))
    return found


def measure(arm: str, repeat: int, kill_after: int, workdir: Path) -> dict:
    script, flags = ARMS[arm]
    run_dir = workdir / f"{arm}-{repeat}"
    log = run_dir / "horovodrun.log"
    started = time.time()
    launch = subprocess.Popen([REGATTA, "local", str(script), "--hosts", "3", "--run-dir", str(run_dir),
                               "--timeout", "600", *flags, "--", "--log-interval", "1",
                               "--seed", str(42 + repeat)],
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    batches, killed_at, resumed_at, offset = 0, None, None, 0
    rng = random.Random(repeat)
    while launch.poll() is None and resumed_at is None:
        if log.exists():
            with open(log, "rb") as handle:
                handle.seek(offset)
                lines = handle.read().split(b"\n")
                offset += sum(len(line) + 1 for line in lines[:-1])
            for line in lines[:-1]:
                found = BATCH.search(line)
                if not found:
                    continue
                batches += 1
                if killed_at is None and batches == kill_after:
                    time.sleep(rng.uniform(0, 0.5))
                    victims = workers_of(host_name(1), script)
                    for pid in victims:
                        os.kill(pid, signal.SIGKILL)
                    killed_at = time.time()
                elif killed_at is not None and found.group(1) == b"2":
                    resumed_at = time.time()
        time.sleep(POLL_S)
    code = launch.wait(timeout=600)
    if code != 0 or resumed_at is None:
        raise RuntimeError(f"{arm} run {repeat}: exit {code}, resumed {resumed_at}; see {log}")
    return {"seconds": resumed_at - killed_at, "wall": time.time() - started}


def spread(values: list[float]) -> str:
    return (f"p50 {percentile(values, 0.5):7.3f}  p95 {percentile(values, 0.95):7.3f}  "
            f"max {max(values):7.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kill-after", type=int, default=25, help="batches printed before the kill")
    args = parser.parse_args()
    results = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for arm in (list(ARMS) if repeat % 2 == 0 else list(reversed(ARMS))):
                row = measure(arm, repeat, args.kill_after, Path(tmp))
                results[arm].append(row)
                print(f"  run {repeat + 1} {arm:7s} kill -> first batch on 2 workers "
                      f"{row['seconds']:7.3f} s   run {row['wall']:6.1f} s", flush=True)
    print()
    for arm, rows in results.items():
        print(f"{arm:7s} recovery {spread([r['seconds'] for r in rows])}   "
              f"run {spread([r['wall'] for r in rows])}")
    stock, ours = (percentile([r["seconds"] for r in results[a]], 0.5) for a in ("stock", "regatta"))
    print(f"p50 recovery stock / regatta: {stock / ours:.1f}x")


if __name__ == "__main__":
    main()
