"""Point-to-point tensor transport between stages, with two implementations.

* :class:`MpiTransport` (runs launched by ``mpirun``): mpi4py ``Isend``/``Irecv`` straight on
  the tensors' memory (``MPI.BYTE`` views, so any dtype works and nothing is pickled);
  data-parallel gradient sums run on a ``Comm.Split`` sub-communicator per stage.
* :class:`GlooTransport` (runs launched by ``horovodrun``, where there is no MPI world, see
  shared/DESIGN.md): a torch.distributed Gloo group, with one sub-group per stage.

Both wait by polling with a short sleep instead of blocking inside the library: OpenMPI
busy-spins in ``Wait``, and with several ranks per core (CI, laptops) a spinning stage
steals the CPU from the stage it is waiting for. The sleep is capped at ``poll_cap_s``.
Pickling is used only off the hot path (``gather_object`` at the end of a run).
"""
from __future__ import annotations

import os
import socket
import time

import torch

POLL_CAP_S = 2e-4


def poll(done, cap_s: float = POLL_CAP_S) -> None:
    """Return once ``done()`` is true; spin briefly, then sleep with a growing delay."""
    delay = 0.0
    while not done():
        if delay:
            time.sleep(delay)
        delay = min(cap_s, max(delay * 2, 1e-6))


class Handle:
    """One outstanding send or receive; keeps its tensor alive until complete."""

    def __init__(self, request, tensor: torch.Tensor, cap_s: float):
        self.request, self.tensor, self._cap = request, tensor, cap_s
        self._done = False

    def test(self) -> bool:
        if not self._done:
            self._done = bool(self._test())
        return self._done

    def wait(self) -> torch.Tensor:
        poll(self.test, self._cap)
        return self.tensor

    def _test(self) -> bool:
        return self.request.Test()


class _GlooHandle(Handle):
    def _test(self) -> bool:
        return self.request.is_completed()

    def wait(self) -> torch.Tensor:
        # Gloo sleeps in its own wait (no spinning), and is_completed() alone never
        # surfaces a peer's failure; wait() raises it.
        self.request.wait()
        self._done = True
        return self.tensor


class Transport:
    """What a stage needs from the network. ``dp_peers`` are the world ranks of this
    stage in every replica, identical on all of them."""
    rank: int
    size: int

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Handle: ...
    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Handle: ...
    def allreduce_dp(self, flat: torch.Tensor) -> None: """In-place sum over dp peers."""
    def gather_object(self, obj, root: int = 0) -> list | None: ...
    def barrier(self) -> None: ...
    def close(self) -> None: ...


def _bytes(tensor: torch.Tensor):
    if not tensor.is_contiguous():
        raise ValueError("transport buffers must be contiguous")
    return tensor.view(torch.uint8).reshape(-1).numpy()


class MpiTransport(Transport):
    def __init__(self, dp_color: int, dp_key: int, comm=None, poll_cap_s: float = POLL_CAP_S):
        from mpi4py import MPI
        self._mpi = MPI
        # A private duplicate: our tags never meet another library's messages.
        self.comm = (comm or MPI.COMM_WORLD).Dup()
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.dp_comm = self.comm.Split(color=dp_color, key=dp_key)
        self._cap = poll_cap_s

    def isend(self, tensor, peer, tag):
        return Handle(self.comm.Isend([_bytes(tensor), self._mpi.BYTE], dest=peer, tag=tag),
                      tensor, self._cap)

    def irecv(self, tensor, peer, tag):
        return Handle(self.comm.Irecv([_bytes(tensor), self._mpi.BYTE], source=peer, tag=tag),
                      tensor, self._cap)

    def allreduce_dp(self, flat):
        if self.dp_comm.Get_size() == 1:
            return
        if flat.dtype != torch.float32:
            raise TypeError(f"allreduce_dp sums float32 buffers, got {flat.dtype}")
        request = self.dp_comm.Iallreduce(self._mpi.IN_PLACE, [flat.numpy(), self._mpi.FLOAT],
                                          op=self._mpi.SUM)
        poll(request.Test, self._cap)

    def gather_object(self, obj, root=0):
        return self.comm.gather(obj, root=root)

    def barrier(self):
        poll(self.comm.Ibarrier().Test, self._cap)

    def close(self):
        self.dp_comm.Free()
        self.comm.Free()


class GlooTransport(Transport):
    def __init__(self, rank: int, size: int, init_method: str, stage_groups: list[list[int]],
                 my_group: int, timeout_s: float = 300.0):
        import datetime
        import torch.distributed as dist
        self._dist = dist
        self.rank, self.size = rank, size
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        # Every rank must create every group, in the same order.
        groups = [dist.new_group(ranks) for ranks in stage_groups]
        self.dp_group, self.dp_size = groups[my_group], len(stage_groups[my_group])

    def isend(self, tensor, peer, tag):
        return _GlooHandle(self._dist.isend(tensor, peer, tag=tag), tensor, POLL_CAP_S)

    def irecv(self, tensor, peer, tag):
        return _GlooHandle(self._dist.irecv(tensor, peer, tag=tag), tensor, POLL_CAP_S)

    def allreduce_dp(self, flat):
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


def free_port(host: str = "") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def under_mpirun() -> bool:
    return any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))


def gloo_init_method(rank: int) -> str:
    """Where the Gloo group meets: ``REGATTA_PIPE_INIT`` if set; under mpirun, an address
    rank 0 picks and broadcasts over MPI; under horovodrun, over Horovod (with an explicit
    name: see DESIGN.md on broadcast_object hanging otherwise)."""
    if os.environ.get("REGATTA_PIPE_INIT"):
        return os.environ["REGATTA_PIPE_INIT"]
    mine = None
    if rank == 0:
        host = socket.gethostbyname(os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname())
        mine = f"tcp://{host}:{free_port()}"
    if under_mpirun():
        from mpi4py import MPI
        return MPI.COMM_WORLD.bcast(mine, root=0)
    import horovod.torch as hvd
    hvd.init()
    return hvd.broadcast_object(mine, root_rank=0, name="regatta.pipeline.init_method")


def make_transport(kind: str, rank: int, size: int, stage_groups: list[list[int]],
                   my_group: int) -> Transport:
    """``kind``: mpi | gloo | auto (mpi under mpirun, else gloo)."""
    if kind == "auto":
        kind = "mpi" if under_mpirun() else "gloo"
    if kind == "mpi":
        return MpiTransport(dp_color=my_group, dp_key=rank)
    return GlooTransport(rank, size, gloo_init_method(rank), stage_groups, my_group)
