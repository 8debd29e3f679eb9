"""Horovod's Gloo allreduce against torch.distributed's, side by side in one run, 2 ranks on
this machine: the transports under Regatta's data-parallel engine and under torch DDP.

    .venv/bin/python bench/bench_allreduce.py [--mb 100] [--repeats 10] [--rounds 3]

Each round starts one launch per arm, the order rotating (``horovodrun --gloo`` for the
two Horovod arms, ``torchrun`` for torch, all on the loopback interface); each times, after
a warm-up, ``--repeats`` sums of ``--mb`` MB of float32 as one tensor and as 4 equal
tensors started together (a model's gradient buckets), every rank starting after a
barrier. The arms differ in the transport and in how they wait:

* horovod: Horovod's Gloo, waited on in ``hvd.synchronize`` (a yielding spin), as the
  stock DistributedOptimizer loop does;
* regatta: Horovod's Gloo, started and waited on as Regatta's engine does
  (runtime/collectives.py: Horovod's fusion off, a sum of 4 MB or more waited for asleep
  between ``hvd.poll`` calls);
* torch: torch.distributed's Gloo, waited on in ``Work.wait`` (a blocking wait), as DDP does.

Prints the time per sum on rank 0 (p50, p95, max over every round's repeats), the bus
bandwidth at the p50, and each Horovod arm / torch of the p50s per round.
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

BIN = Path(sys.executable).parent
TRANSPORTS = ("horovod", "regatta", "torch")
HOROVOD_ARMS = ("horovod", "regatta")   # launched by horovodrun
LAYOUTS = (1, 4)          # tensors the MB are split into
RANKS = 2


def options(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=100, help="MB summed per allreduce")
    parser.add_argument("--repeats", type=int, default=10, help="timed sums per layout and launch")
    parser.add_argument("--rounds", type=int, default=3, help="launches per transport")
    parser.add_argument("--worker", choices=TRANSPORTS, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# -- one launch (inside horovodrun or torchrun) -------------------------------------------
def collectives(transport: str):
    """(rank, start a sum of one tensor in place, wait for it, barrier)."""
    import torch
    if transport in HOROVOD_ARMS:
        import horovod.torch as hvd
        from elastic.runtime.collectives import FUSION_ENV, HorovodRequest, horovod_fusion_bytes
        from elastic.runtime.env import Env
        fusion = horovod_fusion_bytes(Env.read())
        if transport == "regatta" and fusion is not None:   # as start_horovod sets it
            os.environ[FUSION_ENV] = str(fusion)
        hvd.init()
        barrier = lambda: hvd.allreduce(torch.zeros(1), name="bench.barrier")  # noqa: E731
        if transport == "horovod":
            return (hvd.rank(), lambda t, name: hvd.allreduce_async_(t, op=hvd.Sum, name=name),
                    hvd.synchronize, barrier)
        return (hvd.rank(), lambda t, name: HorovodRequest(
                    hvd, hvd.allreduce_async_(t, op=hvd.Sum, name=name), t.numel() * t.element_size()),
                lambda request: request.wait(), barrier)
    import torch.distributed as dist
    dist.init_process_group("gloo")
    return dist.get_rank(), lambda t, name: dist.all_reduce(t, async_op=True), \
        lambda work: work.wait(), dist.barrier


def worker(opts) -> None:
    import torch
    from elastic.runtime.memory import keep_freed_memory
    torch.set_num_threads(1)
    keep_freed_memory()
    rank, start, wait, barrier = collectives(opts.worker)
    times = {}
    for parts in LAYOUTS:
        tensors = [torch.ones((opts.mb << 18) // parts) for _ in range(parts)]
        times[parts] = []
        for repeat in range(opts.repeats + 1):
            barrier()
            started = time.perf_counter()
            for handle in [start(t, f"bench.{parts}.{i}") for i, t in enumerate(tensors)]:
                wait(handle)
            if repeat:
                times[parts].append(time.perf_counter() - started)
    if rank == 0:
        print("RESULT " + json.dumps(times))
    sys.stdout.flush()
    os._exit(0)   # torch.distributed's teardown can hang on a Gloo thread (throughput_worker.py)


# -- launcher side ----------------------------------------------------------------------------
def launch(transport: str, opts) -> dict:
    args = [__file__, "--worker", transport, "--mb", str(opts.mb), "--repeats", str(opts.repeats)]
    if transport in HOROVOD_ARMS:
        command = [str(BIN / "horovodrun"), "--gloo", "-np", str(RANKS), "-H", f"localhost:{RANKS}",
                   "--network-interface", "lo", sys.executable, *args]
    else:
        command = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(RANKS), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(ROOT))
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    found = [line[line.index("RESULT ") + 7:] for line in done.stdout.splitlines() if "RESULT " in line]
    if done.returncode or not found:
        raise SystemExit(f"{transport} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return {int(parts): values for parts, values in json.loads(found[0]).items()}


def report(rounds: list[dict], mb: int) -> None:
    moved = (mb << 20) * 2 * (RANKS - 1) / RANKS   # a ring allreduce's bytes per rank
    for parts in LAYOUTS:
        print(f"\n{mb} MB as {parts} tensor{'s' if parts > 1 else ''}:")
        print(f"  {'transport':13} {'p50 ms':>8} {'p95 ms':>8} {'max ms':>8} {'bus GB/s at p50':>16}")
        for transport in TRANSPORTS:
            times = [t for r in rounds for t in r[transport][parts]]
            p50 = percentile(times, 0.5)
            print(f"  {transport:13} {p50 * 1e3:8.1f} {percentile(times, 0.95) * 1e3:8.1f} "
                  f"{max(times) * 1e3:8.1f} {moved / p50 / 1e9:16.2f}")
        for transport in TRANSPORTS[:-1]:
            ratios = [percentile(r[transport][parts], 0.5) / percentile(r["torch"][parts], 0.5)
                      for r in rounds]
            print(f"  {transport} / torch, p50 per round: {statistics.median(ratios):.2f} "
                  f"[{min(ratios):.2f}-{max(ratios):.2f}] over {len(ratios)} rounds")


def main(argv=None) -> None:
    opts = options(argv)
    if opts.worker:
        return worker(opts)
    rounds = []
    for index in range(opts.rounds):
        order = TRANSPORTS[index % len(TRANSPORTS):] + TRANSPORTS[:index % len(TRANSPORTS)]
        rounds.append({transport: launch(transport, opts) for transport in order})
        print(f"round {index + 1}/{opts.rounds} done", file=sys.stderr, flush=True)
    report(rounds, opts.mb)


if __name__ == "__main__":
    main()
