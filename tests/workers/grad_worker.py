"""Worker for test_gradients: data-parallel gradients through Regatta's fused allreduce.

    mpirun -np 2 python tests/workers/grad_worker.py OUT.pt
"""
import sys

import horovod.torch as hvd
import torch

from elastic.dataparallel import allreduce_step
from elastic.sampler import rank_share
from elastic.world import World
from jobs.digits import DigitsConfig, DigitsJob


def main(out: str) -> None:
    hvd.init()
    world = World.from_horovod(hvd)
    job = DigitsJob(DigitsConfig(dropout=0.0))
    torch.manual_seed(0)
    model = job.build_model()
    x, y = job.train_data()
    batch = torch.arange(33)          # odd on purpose: ranks get 17 and 16 samples
    mine = rank_share(batch, world.rank, world.size)
    loss_sum, count = job.loss_sum(model, (x[mine], y[mine]))
    loss_sum.backward()
    reduced = allreduce_step(model, loss_sum.item(), count, 0, 0.0, world)
    if world.rank == 0:
        torch.save({"loss": reduced.loss, "count": reduced.count,
                    "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}, out)


if __name__ == "__main__":
    main(sys.argv[1])
