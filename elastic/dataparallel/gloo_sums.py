"""The gradient buckets' sums over a torch.distributed Gloo group of this world
(``train.gradient_sums = "gloo"``); the commits' object collectives and the hand-offs
stay on Horovod.

Why: Horovod runs one collective at a time from its background loop, and torch's Gloo
group two, on its worker threads. Where a model's gradients take longer to sum than
backward takes to compute, the buckets queue behind each other in Horovod: the same four
25 MB sums took 1.22x as long over Horovod's Gloo as over torch's (bench_allreduce), and
the 26M-parameter MLP of bench_throughput ran faster over this group than over Horovod in
six alternating pairs of runs (Regatta / DDP 0.98-1.03 against 0.94-0.99,
docs/measurements.md).

The group is the runtime's for this world (runtime/torch_group.py ``WorldGroup``),
opened when the engine enters it unless the sync opened it already, before the runtime's
recovery takes stock of the world's connections, so a peer's death shuts this group's
sockets too and a sum blocked on the dead peer raises at once; the failure reaches the
elastic loop as ``HorovodInternalError``. The runtime destroys it before the next reset.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from elastic.runtime.torch_group import WorldGroup, translated

def over_gloo(setting: str, hvd, on_cpu: bool, buckets: int) -> bool:
    """Whether ``train.gradient_sums`` (``setting``) sums the ``buckets`` over this
    module's group. ``auto``: where Horovod would sum CPU tensors over Gloo (horovodrun,
    every elastic launch) and the buckets can queue, more than the two edge ones of about
    1 MB (buckets.py): a small model's (charlm's 1.4 MB) cannot, and there Horovod's path
    left less of the sums after backward (0.021-0.024 of a step against 0.032-0.043).
    Horovod's own elsewhere: MPI's operations under mpirun and NCCL on a GPU were not
    measured against this group."""
    if setting != "auto":
        return setting == "gloo"
    return on_cpu and hvd is not None and hvd.gloo_enabled() and buckets > 2


class GlooSums:
    def __init__(self, group: WorldGroup, world, collectives):
        """Over ``group``, opened for ``world`` here unless it is already (every rank of
        ``world`` calls this together)."""
        group.open_for(world, collectives)

    def allreduce_sum_async(self, tensors: list[torch.Tensor], name: str) -> GlooRequest:
        """Start summing each of ``tensors`` in place; ``name`` is Horovod's, unused here
        (torch matches collectives by their order, the same on every rank)."""
        with translated("gradient sums"):
            return GlooRequest([dist.all_reduce(t, async_op=True) for t in tensors])


class GlooRequest:
    def __init__(self, works: list):
        self.works = works

    def done(self) -> bool:
        return all(work.is_completed() for work in self.works)

    def wait(self) -> None:
        # is_completed() alone never surfaces a peer's failure; wait() raises it.
        with translated("gradient sums"):
            for work in self.works:
                work.wait()
