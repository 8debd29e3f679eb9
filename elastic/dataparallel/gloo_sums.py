"""The gradient buckets' sums over a torch.distributed Gloo group of this world
(``train.gradient_sums = "gloo"``); everything else (the sync, the commits' object
collectives, the hand-offs) stays on Horovod.

Why: Horovod runs one collective at a time from its background loop, and torch's Gloo
group two, on its worker threads. Where a model's gradients take longer to sum than
backward takes to compute, the buckets queue behind each other in Horovod: the same four
25 MB sums took 1.22x as long over Horovod's Gloo as over torch's (bench_allreduce), and
the 26M-parameter MLP of bench_throughput ran faster over this group than over Horovod in
six alternating pairs of runs (Regatta / DDP 0.98-1.03 against 0.94-0.99,
docs/measurements.md).

The group is opened for each world when the engine enters it, before the runtime's
recovery takes stock of the world's connections, so a peer's death shuts this group's
sockets too and a sum blocked on the dead peer raises at once (runtime/torch_group.py);
the failure reaches the elastic loop as ``HorovodInternalError``. It is destroyed before
the next reset and at the end.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from elastic.runtime.torch_group import forget_group, meeting_point, open_default_group, translated

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
    def __init__(self, world, collectives, env):
        """Every rank of ``world`` opens it together; rank 0 picks the address and sends it
        over ``collectives`` (Horovod's). Horovod's Gloo interface and timeout apply (``env``:
        horovodrun's ``--network-interface`` and ``--gloo-timeout-seconds``)."""
        init = meeting_point(world, collectives.broadcast_object, "regatta.dp.gloo_sums")
        with translated("gradient sums"):
            open_default_group(init, world.rank, world.size, env.gloo_timeout_s, env.gloo_iface)
        self.open = True

    def allreduce_sum_async(self, tensors: list[torch.Tensor], name: str) -> GlooRequest:
        """Start summing each of ``tensors`` in place; ``name`` is Horovod's, unused here
        (torch matches collectives by their order, the same on every rank)."""
        with translated("gradient sums"):
            return GlooRequest([dist.all_reduce(t, async_op=True) for t in tensors])

    def close(self) -> None:
        """Destroy the group; a group whose peers died may not close cleanly, and is then
        forgotten all the same. Only the first call acts: a later one would destroy
        whatever default group exists by then (another world's)."""
        if self.open:
            self.open = False
            with contextlib.suppress(Exception):
                forget_group()


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
