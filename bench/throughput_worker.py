"""One arm of bench_throughput.py on one rank: the same job, data split, optimizer and
thread count, trained by Regatta, by a stock Horovod DistributedOptimizer loop, or by
torch DDP over Gloo, until stopped. Each rank appends one JSON line per step to
``<run-dir>/throughput/<arm>-<rank>.jsonl`` (wall time; for Regatta also its step row's
timings), after a first line with its pid and the job's sizes.

    regatta local mlp --module bench.throughput_worker --hosts 2 --steps 1000000 \
        --commit-every 1000000 --run-dir runs/tp -- --arm regatta --model mlp
    regatta local mlp --module bench.throughput_worker ... -- --arm stock --model mlp
    torchrun --standalone --nproc-per-node 2 -m bench.throughput_worker --arm ddp \
        --model mlp --steps 1000000 --run-dir runs/tp

Regatta runs through its public entry (``elastic.train.train``, as a user's script does)
and reports each step from its step callback. The stock loop is Horovod's documented
elastic loop (``hvd.elastic.run``, ``TorchState``, ``DistributedOptimizer``). Before
training, the stock and DDP arms time a plain allreduce of the model's gradient size over
their transport (the bench turns it into a bus bandwidth).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from elastic.runtime.env import Env
from elastic.runtime.memory import keep_freed_memory

ALLREDUCE_REPEATS = 5


def job_and_config(model: str, argv: list[str]):
    if model == "charlm":
        from jobs.charlm import CharLMJob, parse_config
        config = parse_config(argv)
        return CharLMJob(config["model"]), config
    from bench.mlp import MLPJob, parse_config
    config = parse_config(argv)
    return MLPJob(config["model"]), config


def share_cores(size_here: int) -> int:
    """The thread count Regatta's runtime picks where no OMP_NUM_THREADS is set
    (runtime/world.py share_cores)."""
    threads = max(1, (os.cpu_count() or 1) // max(1, size_here))
    torch.set_num_threads(threads)
    return threads


def batches(job, cfg, rank: int, size: int):
    """Each step's share of the global batch, as Regatta's step takes it."""
    from elastic.data.sampler import Cursor, global_batch, rank_share
    data, cursor = job.train_data(), Cursor()
    while True:
        indices = global_batch(cursor, len(data[0]), cfg.global_batch, cfg.seed)
        cursor = cursor.advance(len(indices), len(data[0]))
        yield tuple(t[rank_share(indices, rank, size)] for t in data)


def grad_bytes(job) -> int:
    """Gradient bytes of the job's model, without allocating one."""
    with torch.device("meta"):
        return sum(p.numel() * p.element_size() for p in job.build_model().parameters())


class StepLog:
    """The rank's line-per-step file the bench reads while the arm runs."""

    def __init__(self, run_dir: str, arm: str, rank: int, header: dict):
        folder = Path(run_dir) / "throughput"
        folder.mkdir(parents=True, exist_ok=True)
        self.file = open(folder / f"{arm}-{rank}.jsonl", "w", buffering=1)
        self.write({"pid": os.getpid(), "rank": rank, "threads": torch.get_num_threads(), **header})

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")

    def step(self, **timings) -> None:
        self.write({"t": time.time(), **timings})


def timed(operation) -> float:
    """Median seconds of ``operation`` after one warm-up."""
    operation()
    times = []
    for _ in range(ALLREDUCE_REPEATS):
        started = time.perf_counter()
        operation()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


# -- the arms ---------------------------------------------------------------------------
def run_regatta(job, config, header: dict) -> None:
    from elastic.train import train
    log = []

    def on_step(record: dict) -> None:
        if not log:
            log.append(StepLog(config["train"].run_dir, "regatta", record["rank"], header))
        log[0].step(**{k: record.get(k) for k in ("step_time", "comm_time", "wait_time", "overlap")})
    train(job, config, callbacks=[on_step])


def run_stock(job, config, header: dict, arm: str = "stock") -> None:
    """Horovod's documented elastic loop; a point of the stock sweep differs only in the
    environment bench_throughput gives it (HOROVOD_CYCLE_TIME, HOROVOD_FUSION_THRESHOLD)."""
    import horovod.torch as hvd
    from elastic.optim import make_optimizer
    cfg = config["train"]
    hvd.init()
    share_cores(int(os.environ.get("REGATTA_PROCS_PER_MACHINE", 0)) or hvd.local_size())
    flat = torch.ones(header["grad_bytes"] // 4)
    header["allreduce_s"] = timed(lambda: hvd.allreduce_(flat, op=hvd.Sum, name="bench.flat"))
    del flat
    header.update(cycle_ms=os.environ.get("HOROVOD_CYCLE_TIME", "Horovod's default"),
                  fusion_bytes=os.environ.get("HOROVOD_FUSION_THRESHOLD", "Horovod's default"))
    log = StepLog(cfg.run_dir, arm, hvd.rank(), header)
    torch.manual_seed(cfg.seed)
    model = job.build_model()
    optimizer = hvd.DistributedOptimizer(make_optimizer(model.parameters(), cfg),
                                         named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, step=0)

    @hvd.elastic.run
    def loop(state):
        data = batches(job, cfg, hvd.rank(), hvd.size())
        while state.step < cfg.steps:
            model.train()
            optimizer.zero_grad()
            loss_sum, count = job.loss_sum(model, next(data))
            (loss_sum / count).backward()
            optimizer.step()
            state.step += 1
            log.step()
    loop(state)


def run_ddp(job, config, header: dict, arm: str = "ddp") -> None:
    """DDP at its defaults, or ("ddp-tuned") as a user tuning it would: buckets as views of
    the gradients (no copy in and out) and Regatta's bucket size."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from elastic.optim import make_optimizer
    cfg = config["train"]
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    share_cores(int(os.environ.get("LOCAL_WORLD_SIZE", size)))
    flat = torch.ones(header["grad_bytes"] // 4)
    header["allreduce_s"] = timed(lambda: dist.all_reduce(flat))
    del flat
    tuned = arm == "ddp-tuned"
    options = {"gradient_as_bucket_view": True, "bucket_cap_mb": cfg.bucket_mb} if tuned else {}
    header["ddp_options"] = options
    log = StepLog(cfg.run_dir, arm, rank, header)
    torch.manual_seed(cfg.seed)
    model = DistributedDataParallel(job.build_model(), **options)
    optimizer = make_optimizer(model.parameters(), cfg)
    data = batches(job, cfg, rank, size)
    for _ in range(cfg.steps):
        model.train()
        optimizer.zero_grad()
        loss_sum, count = job.loss_sum(model, next(data))
        (loss_sum / count).backward()
        optimizer.step()
        log.step()
    # No destroy_process_group: in torch 2.13 it can deadlock (the Gloo group's destructor
    # joins a worker thread that waits for the GIL the destructor holds).
    sys.stdout.flush()
    os._exit(0)


def runner(arm: str):
    """The loop an arm runs: ``stock-<cycle>ms-<fusion>MiB`` is the stock loop under the
    Horovod settings bench_throughput gives it."""
    if arm == "regatta":
        return run_regatta
    if arm == "stock" or arm.startswith("stock-"):
        return run_stock
    if arm in ("ddp", "ddp-tuned"):
        return run_ddp
    raise SystemExit(f"unknown arm {arm!r}: regatta, stock, stock-<cycle>ms-<fusion>MiB, ddp or ddp-tuned")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one arm of bench_throughput")
    parser.add_argument("--arm", required=True, help="regatta, stock, stock-<cycle>ms-<fusion>MiB, "
                                                      "ddp or ddp-tuned")
    parser.add_argument("--model", choices=("charlm", "mlp"), required=True)
    ours, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    run_arm = runner(ours.arm)
    keeps = Env.read().keep_freed_memory      # bench_throughput --allocator
    if keeps and ours.arm != "regatta":     # Regatta's runtime does it itself
        keeps = keep_freed_memory()
    job, config = job_and_config(ours.model, rest)
    header = {"arm": ours.arm, "model": ours.model, "grad_bytes": grad_bytes(job),
              "global_batch": config["train"].global_batch, "keeps_freed_memory": keeps}
    if ours.arm == "regatta":
        run_regatta(job, config, header)
    else:
        run_arm(job, config, header, ours.arm)


if __name__ == "__main__":
    main()
