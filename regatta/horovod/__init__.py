"""Horovod's PyTorch API with Regatta behind it: a Horovod script changes one line.

    import regatta.horovod as hvd          # was: import horovod.torch as hvd

    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, optimizer, epoch=1, batch=0)

    @hvd.elastic.run
    def train(state):
        ...                                # your loop: optimizer.step(), state.commit()

What changes behind the same names: failures are detected within a second by lifelines
(not Gloo's 30 s timeout), survivors go on from their live state, commits are shares in
host memory (not a full copy per commit), ``DistributedOptimizer`` reduces in buckets
overlapped with backward, and every step, host sample, event and recovery goes to the
metrics store and dashboard (``regatta.log`` works beside it). Regatta's settings come
from the ``REGATTA_ARGS`` environment variable (``regatta local`` sets it), so the
script's command line stays its own. What cannot be kept is refused with the reason
(README, "Coming from Horovod"). Every other name is horovod.torch's own: allreduce,
broadcast_parameters, rank, size, Compression, ...
"""
import horovod.torch as _horovod

from elastic.userloop.optimizer import DistributedOptimizer, RefusedOption
from elastic.userloop.session import init

from . import elastic

__all__ = ["init", "DistributedOptimizer", "RefusedOption", "elastic"]


def __getattr__(name: str):
    return getattr(_horovod, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(dir(_horovod)))
