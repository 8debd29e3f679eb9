"""Point-to-point tensor transport between stages, with two implementations.

* :class:`MpiTransport` (runs launched by ``mpirun``): mpi4py ``Isend``/``Irecv`` straight on
  the tensors' memory (``MPI.BYTE`` views, so any dtype works and nothing is pickled);
  data-parallel gradient sums run on a ``Comm.Split`` sub-communicator per stage.
* :class:`~elastic.pipeline.gloo_transport.GlooTransport` (runs launched by ``horovodrun``,
  where there is no MPI world, see shared/DESIGN.md): a torch.distributed Gloo group, with
  one sub-group per stage.

A stage sends and receives every step's activations and gradients through the same
buffers (``send_channel``, ``recv_channel``: under MPI persistent requests, started again
each step; under Gloo a fresh send or receive on the kept buffer), and the executor posts
all of a step's receives when the step starts: a message is taken in whenever it
arrives, and the hot path sets nothing up.

Where a core is free for it, a thread keeps MPI's messages moving while the stage computes
(progress.py: without it a message may move only when its sender next calls MPI).
MPI requests are waited on by testing them (runtime/waiting.py: OpenMPI busy-spins in ``Wait``,
which steals the CPU from the stage being waited for when ranks share cores). Gloo's own
wait sleeps on a condition and is used as is. Pickling is used only off the hot path
(``gather_object`` at the end of a run).

Device tensors (a stage on CUDA, see stage.py) go through host buffers unless the library
reads and writes that device's memory itself (``direct_devices``): a send copies the
tensor into a pinned CPU buffer and sends that; a receive lands in a pinned buffer and is
copied into the device tensor when waited on; ``allreduce_dp`` sums a host copy. The same
bytes travel either way, so results do not depend on the path.

* MPI sends CUDA memory directly only when the library says it is CUDA-aware
  (``mpi_cuda_aware``); otherwise it stages.
* The torch.distributed group stays Gloo and stages. NCCL was not chosen: it ignores
  message tags, which the executor uses to match early-posted receives; it needs one GPU
  per rank (two stages sharing a GPU, as on a one-GPU machine or with more slots than
  GPUs, is an error); and it would be a second communicator to rebuild on every elastic
  reset. The cost is one device/host copy per message on each side, small next to a
  stage's compute at the activation sizes a pipeline moves.
"""
from __future__ import annotations

import os

import torch

from . import progress
from elastic.runtime.waiting import POLL_CAP_S, SPIN_ALONE_S, SPIN_S, fine_timer_slack, poll


class Handle:
    """One outstanding send or receive; keeps its tensor alive until complete."""
    _spin = SPIN_S
    _on_done = None            # called once when first seen complete

    def __init__(self, request, tensor: torch.Tensor, cap_s: float, spin_s: float = SPIN_S,
                 on_done=None):
        self.request, self.tensor, self._cap, self._spin = request, tensor, cap_s, spin_s
        self._done, self._on_done = False, on_done

    def test(self) -> bool:
        if not self._done:
            self._done = bool(self._test())
            if self._done and self._on_done is not None:
                self._on_done()
        return self._done

    def wait(self) -> torch.Tensor:
        poll(self.test, self._cap, self._spin)
        return self.tensor

    def _test(self) -> bool:
        return self.request.Test()


class _Staged(Handle):
    """A send or receive of a device tensor through the host buffer ``inner`` moves; a
    receive copies the buffer into the device tensor once, when waited on."""

    def __init__(self, inner: Handle, tensor: torch.Tensor, receive: bool):
        self.inner, self.tensor, self._receive, self._copied = inner, tensor, receive, False

    def test(self) -> bool:
        return self.inner.test()

    def wait(self) -> torch.Tensor:
        host = self.inner.wait()
        if self._receive and not self._copied:
            # Pinned -> device is asynchronous on the current stream, which every later
            # use of the tensor also runs on; torch keeps the pinned block until it is done.
            self.tensor.copy_(host, non_blocking=host.is_pinned())
            self._copied = True
        return self.tensor


class Channel:
    """A send of, or a receive into, one buffer, posted again every step: ``start()``
    posts it and returns its handle."""

    def __init__(self, start):
        self.start = start


def host_buffer(tensor: torch.Tensor) -> torch.Tensor:
    """An empty CPU tensor shaped like ``tensor``, pinned when ``tensor`` is on CUDA."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)


class Transport:
    """What a stage needs from the network. ``dp_peers`` are the world ranks of this
    stage in every replica, identical on all of them. Subclasses move tensors the library
    can address (``direct_devices``); this class stages the others through host memory."""
    rank: int
    size: int
    direct_devices: frozenset = frozenset({"cpu"})   # empty: stage everything (tests)

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Handle:
        if self._direct(tensor):
            return self._isend(tensor, peer, tag)
        host = host_buffer(tensor)
        host.copy_(tensor)            # synchronous: the buffer is complete before it is sent
        return _Staged(self._isend(host, peer, tag), tensor, receive=False)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Handle:
        if self._direct(tensor):
            return self._irecv(tensor, peer, tag)
        return _Staged(self._irecv(host_buffer(tensor), peer, tag), tensor, receive=True)

    def recv_channel(self, tensor: torch.Tensor, peer: int, tag: int) -> Channel:
        """Receives from ``peer`` with ``tag`` into ``tensor``, one per ``start()``."""
        if self._direct(tensor):
            return self._recv_channel(tensor, peer, tag)
        inner = self._recv_channel(host_buffer(tensor), peer, tag)
        return Channel(lambda: _Staged(inner.start(), tensor, receive=True))

    def send_channel(self, tensor: torch.Tensor, peer: int, tag: int) -> Channel:
        """Sends of ``tensor``'s content at each ``start()`` to ``peer`` with ``tag``."""
        if self._direct(tensor):
            return self._send_channel(tensor, peer, tag)
        host = host_buffer(tensor)
        inner = self._send_channel(host, peer, tag)

        def start() -> Handle:
            host.copy_(tensor)        # synchronous: the buffer is complete before it is sent
            return _Staged(inner.start(), tensor, receive=False)
        return Channel(start)

    def _recv_channel(self, tensor: torch.Tensor, peer: int, tag: int) -> Channel:
        return Channel(lambda: self._irecv(tensor, peer, tag))

    def _send_channel(self, tensor: torch.Tensor, peer: int, tag: int) -> Channel:
        return Channel(lambda: self._isend(tensor, peer, tag))

    def allreduce_dp(self, flat: torch.Tensor) -> None:
        """In-place sum over dp peers."""
        if self._direct(flat):
            return self._allreduce_dp(flat)
        host = host_buffer(flat)
        host.copy_(flat)
        self._allreduce_dp(host)
        flat.copy_(host)

    def _direct(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type in self.direct_devices

    def _isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Handle: ...
    def _irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Handle: ...
    def _allreduce_dp(self, flat: torch.Tensor) -> None: ...
    def gather_object(self, obj, root: int = 0) -> list | None: ...
    def barrier(self) -> None: ...
    def close(self) -> None: ...


def _bytes(tensor: torch.Tensor):
    if not tensor.is_contiguous():
        raise ValueError("transport buffers must be contiguous")
    flat = tensor.view(torch.uint8).reshape(-1)
    if flat.is_cuda:
        # CUDA-aware MPI reads the memory through __cuda_array_interface__, outside torch's
        # stream order: finish the kernels that write it (or last used a reused block).
        torch.cuda.current_stream(flat.device).synchronize()
        return flat
    return flat.numpy()


def mpi_cuda_aware(comm, forced: bool | None = None) -> bool:
    """Whether this MPI moves CUDA memory itself: ``forced`` (``REGATTA_MPI_CUDA_AWARE``)
    if given, else what the library reports (``Query_cuda_support`` where mpi4py exposes
    Open MPI's MPIX extension, or ``cuda`` among the MPI 4.1 ``mpi_memory_alloc_kinds``),
    else no."""
    if forced is not None:
        return forced
    from mpi4py import MPI
    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:
        try:
            return bool(query())
        except Exception:  # noqa: BLE001 - an MPI without the extension
            pass
    try:
        kinds = comm.Get_info().Get("mpi_memory_alloc_kinds") or ""
    except Exception:  # noqa: BLE001 - MPI < 4.1
        kinds = ""
    return "cuda" in kinds


class MpiTransport(Transport):
    def __init__(self, dp_color: int, dp_key: int, comm=None, poll_cap_s: float = POLL_CAP_S,
                 cuda_aware: bool | None = None, progress_thread: bool | None = None):
        """``progress_thread``: keep messages moving while the stage computes
        (progress.py); None: where a core is free for it, and not when MPI moves CUDA
        memory itself."""
        from mpi4py import MPI
        self._mpi = MPI
        # A private duplicate: our tags never meet another library's messages.
        self.comm = (comm or MPI.COMM_WORLD).Dup()
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.dp_comm = self.comm.Split(color=dp_color, key=dp_key)
        self._cap = poll_cap_s
        here = self.comm.Split_type(MPI.COMM_TYPE_SHARED)
        self._spin = SPIN_ALONE_S if here.Get_size() <= len(os.sched_getaffinity(0)) else SPIN_S
        here.Free()
        self._persistent: list = []
        if torch.cuda.is_available() and mpi_cuda_aware(self.comm, cuda_aware):
            self.direct_devices = frozenset({"cpu", "cuda"})
            # MPI would drive CUDA copies from a thread without the device's context.
            progress_thread = False if progress_thread is None else progress_thread
        self._progress = progress.Progress(self.comm) if progress.wanted(self.comm, progress_thread) else None
        fine_timer_slack()

    @property
    def progress_thread(self) -> bool:
        """Whether a thread keeps messages moving while the stage computes."""
        return self._progress is not None

    def _posted(self, request, tensor) -> Handle:
        if self._progress is None:
            return Handle(request, tensor, self._cap, self._spin)
        self._progress.started()
        return Handle(request, tensor, self._cap, self._spin, on_done=self._progress.ended)

    def _isend(self, tensor, peer, tag):
        return self._posted(self.comm.Isend([_bytes(tensor), self._mpi.BYTE], dest=peer, tag=tag), tensor)

    def _irecv(self, tensor, peer, tag):
        return self._posted(self.comm.Irecv([_bytes(tensor), self._mpi.BYTE], source=peer, tag=tag), tensor)

    def _recv_channel(self, tensor, peer, tag):
        return self._persistent_channel(
            self.comm.Recv_init([_bytes(tensor), self._mpi.BYTE], source=peer, tag=tag), tensor)

    def _send_channel(self, tensor, peer, tag):
        return self._persistent_channel(
            self.comm.Send_init([_bytes(tensor), self._mpi.BYTE], dest=peer, tag=tag), tensor)

    def _persistent_channel(self, request, tensor) -> Channel:
        self._persistent.append(request)

        def start() -> Handle:
            if tensor.is_cuda:   # kernels writing (or still reading) the buffer come first
                torch.cuda.current_stream(tensor.device).synchronize()
            request.Start()
            return self._posted(request, tensor)
        return Channel(start)

    def _allreduce_dp(self, flat):
        if self.dp_comm.Get_size() == 1:
            return
        if flat.dtype != torch.float32:
            raise TypeError(f"allreduce_dp sums float32 buffers, got {flat.dtype}")
        if flat.is_cuda:
            torch.cuda.current_stream(flat.device).synchronize()
        request = self.dp_comm.Iallreduce(self._mpi.IN_PLACE,
                                          [flat if flat.is_cuda else flat.numpy(), self._mpi.FLOAT],
                                          op=self._mpi.SUM)
        poll(request.Test, self._cap, self._spin)

    def gather_object(self, obj, root=0):
        return self.comm.gather(obj, root=root)

    def barrier(self):
        poll(self.comm.Ibarrier().Test, self._cap, self._spin)

    def close(self):
        if self._progress is not None:
            self._progress.close()
        for request in self._persistent:
            try:
                request.Free()
            except Exception:  # noqa: BLE001 - still posted after a failed step
                pass
        self.dp_comm.Free()
        self.comm.Free()
