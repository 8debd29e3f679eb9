"""The pipeline's transport under ``horovodrun`` (no MPI world there): a torch.distributed
Gloo group with one sub-group per stage, rebuilt on every elastic reset (transport.py has
the contract and the MPI one).
"""
from __future__ import annotations

import contextlib

import torch

from .transport import Handle, Transport
from elastic.runtime.torch_group import forget_group, open_default_group
from elastic.runtime.waiting import POLL_CAP_S


class _GlooHandle(Handle):
    def _test(self) -> bool:
        return self.request.is_completed()

    def wait(self) -> torch.Tensor:
        # Gloo sleeps in its own wait (no spinning), and is_completed() alone never
        # surfaces a peer's failure; wait() raises it.
        self.request.wait()
        self._done = True
        return self.tensor


class GlooTransport(Transport):
    def __init__(self, rank: int, size: int, init_method: str, stage_groups: list[list[int]],
                 my_group: int, timeout_s: float = 300.0, interface: str = ""):
        """``interface``: horovodrun's ``--network-interface`` (``Env.gloo_iface``), which
        the group's connections use unless ``GLOO_SOCKET_IFNAME`` names one."""
        import torch.distributed as dist
        self._dist = dist
        self.rank, self.size = rank, size
        open_default_group(init_method, rank, size, timeout_s, interface)
        try:
            # Every rank must create every group, in the same order.
            groups = [dist.new_group(ranks) for ranks in stage_groups]
        except BaseException:
            with contextlib.suppress(Exception):   # the first error is the one to report
                forget_group()
            raise
        self.dp_group, self.dp_size = groups[my_group], len(stage_groups[my_group])

    def _isend(self, tensor, peer, tag):
        return _GlooHandle(self._dist.isend(tensor, peer, tag=tag), tensor, POLL_CAP_S)

    def _irecv(self, tensor, peer, tag):
        return _GlooHandle(self._dist.irecv(tensor, peer, tag=tag), tensor, POLL_CAP_S)

    def _allreduce_dp(self, flat):
        if self.dp_size > 1:
            self._dist.all_reduce(flat, group=self.dp_group)

    def gather_object(self, obj, root=0):
        out = [None] * self.size if self.rank == root else None
        self._dist.gather_object(obj, out, dst=root)
        return out

    def barrier(self):
        self._dist.barrier()

    def close(self):
        self._dist.destroy_process_group()
