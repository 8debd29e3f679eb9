"""Worker for test_gradients: data-parallel gradients through Regatta's reduction.

    mpirun -np 2 python tests/workers/grad_worker.py OUT.pt
"""
import sys

import horovod.torch as hvd
import torch

from elastic.data.sampler import rank_share
from elastic.dataparallel.reduce import BucketReducer
from elastic.runtime.collectives import HorovodCollectives
from elastic.runtime.control import Pending
from jobs.digits import DigitsConfig, DigitsJob


def main(out: str) -> None:
    hvd.init()
    job = DigitsJob(DigitsConfig(dropout=0.0))
    torch.manual_seed(0)
    model = job.build_model()
    x, y = job.train_data()
    batch = torch.arange(33)          # odd on purpose: ranks get 17 and 16 samples
    mine = rank_share(batch, hvd.rank(), hvd.size())
    reducer = BucketReducer(list(model.parameters()), hvd.rank(), hvd.size(),
                            HorovodCollectives(hvd), bucket_bytes=4096)
    reducer.before_backward(last=True)
    loss_sum, count = job.loss_sum(model, (x[mine], y[mine]))
    loss_sum.backward()
    reduced = reducer.finish(Pending().control(loss_sum.item(), count, 0.0))
    if hvd.rank() == 0:
        torch.save({"loss": reduced.agreed.loss, "count": reduced.agreed.count,
                    "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}, out)


if __name__ == "__main__":
    main(sys.argv[1])
