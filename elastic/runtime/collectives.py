"""The few collectives the runtime itself needs, over whatever the launcher started.

Under Horovod (horovodrun, or mpirun for data parallelism) they are Horovod's; an mpirun
pipeline never initialises Horovod and uses MPI's world communicator; one process needs
none. Names keep Horovod's concurrent collectives apart (see DESIGN.md on
``broadcast_object`` hanging without one).

``allreduce_sum_async`` (Horovod and one process: the data-parallel engine's) starts
summing a group of tensors (one fused collective) and returns a :class:`Request`;
several may be in flight at once (the data-parallel engine overlaps gradient buckets with backward). Each
must be waited on exactly once; ``wait`` raises the collective's failure (under Horovod a
``HorovodInternalError``, which the elastic loop turns into a restore).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from .device import wants_cpu
from .env import Env
from .waiting import fine_timer_slack, poll

SLEPT_WAIT_BYTES = 4 << 20   # a sum this large (milliseconds here) is waited for asleep
WAIT_CAP_S = 1e-3            # the longest sleep between two polls


class Request(Protocol):
    def done(self) -> bool:
        """Whether the collective has completed (then ``wait`` does not block)."""

    def wait(self) -> None:
        """Block until the collective has completed; raise its failure."""


class Collectives(Protocol):
    def allreduce_sum(self, tensor: torch.Tensor, name: str) -> None:
        """Sum ``tensor`` over every rank, in place."""

    def allreduce_sum_async(self, tensors: list[torch.Tensor], name: str) -> Request:
        """Start summing each of ``tensors`` over every rank, in place, as one collective;
        they must not be touched until the request is waited on."""

    def allgather_object(self, obj, name: str) -> list:
        """Every rank's picklable ``obj``, in rank order."""

    def broadcast_object(self, obj, name: str, root: int = 0):
        """Rank ``root``'s ``obj`` on every rank."""


class Completed:
    """A request that needed no communication."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        pass


class Alone:
    """One process: every collective is the identity."""

    def allreduce_sum(self, tensor, name):
        pass

    def allreduce_sum_async(self, tensors, name):
        return Completed()

    def allgather_object(self, obj, name):
        return [obj]

    def broadcast_object(self, obj, name, root=0):
        return obj


CPU_CYCLE_MS = 5.0     # Horovod's cycle on the CPU where tensors wait for it
WAKING_CYCLE_MS = 20.0  # where a queued tensor wakes Horovod's loop: only its idle rounds
WAKE_ENV = "HOROVOD_WAKE_ON_ENQUEUE"   # tools/horovod-wake-on-enqueue.patch reads it
FUSION_ENV = "HOROVOD_FUSION_THRESHOLD"


@dataclass(frozen=True)
class HorovodSettings:
    """What Horovod runs with, as its ``hvd.init`` read it from the environment (None:
    Horovod's own default or its autotuner's; all None: Horovod not started)."""
    cycle_ms: float | None = None
    wakes: bool | None = None
    fusion_bytes: int | None = None


def start_horovod(cfg, env):
    """``hvd.init`` with a queued tensor waking Horovod's loop (where the Horovod build has
    the patch for it, and the environment does not say otherwise), the cycle
    :func:`horovod_cycle_ms` picks and the fusion :func:`horovod_fusion_bytes` picks, all
    left in the environment (Horovod reads them again on every reset). Returns the module
    and the :class:`HorovodSettings` in effect."""
    import horovod.torch as hvd
    wakes = horovod_wakes(env)
    os.environ[WAKE_ENV] = "1" if wakes else "0"
    cycle = horovod_cycle_ms(cfg.horovod_cycle_ms, env, wants_cpu(cfg.device or env.device), wakes)
    if cycle is not None:
        os.environ["HOROVOD_CYCLE_TIME"] = f"{cycle:g}"
    fusion = horovod_fusion_bytes(env)
    if fusion is not None:
        os.environ[FUSION_ENV] = str(fusion)
    hvd.init()
    read = Env.read(os.environ)   # what hvd.init read: the environment's values, or ours
    return hvd, HorovodSettings(read.horovod_cycle_time, wakes, read.horovod_fusion_threshold)


def horovod_fusion_bytes(env) -> int | None:
    """The tensor fusion threshold to start Horovod with: 0, so that Horovod never fuses,
    where the environment sets none and Horovod's autotuner (which tunes it) is off.

    Regatta's buckets are its fusion (dataparallel/buckets.py): each is one flat tensor
    summed in place. Horovod's fusion would copy two buckets that are queued in the same
    cycle (as the later buckets of a backward are, behind one in flight) into its fusion
    buffer and back, memory traffic the size of the gradients, on the thread every bucket
    waits for. Measured with the 26M-parameter MLP (bench_throughput, Regatta / DDP, 3 runs
    each way, alternating): fused 0.91, 0.93, 0.94; never fused 0.975, 0.93, 0.966
    (docs/measurements.md, "Horovod's fusion off")."""
    if env.horovod_fusion_threshold is not None or env.horovod_autotune:
        return None
    return 0


def horovod_wakes(env) -> bool:
    """Whether a tensor queued for Horovod wakes its background loop at once: Regatta's
    patch to Horovod (tools/horovod-wake-on-enqueue.patch, applied by tools/setup.sh), on
    unless ``HOROVOD_WAKE_ON_ENQUEUE`` says 0. Stock Horovod sleeps out its cycle first, so
    every collective waits half a cycle on average before it starts; Regatta's gradients
    come already fused in buckets, so there is nothing to gain from the wait. A Horovod
    built without the patch is found out by its library, which lacks the variable. Only
    under Gloo's controller (horovodrun's): Open MPI's blocking collectives poll, so a rank
    that enters a round before its peers (as a rank with pending tensors does at once)
    would spin a core its peers' backward needs."""
    return env.horovod_wake is not False and env.horovod_controller == "gloo" \
        and _horovod_library_wakes()


@functools.cache   # read once a process, not on every reset
def _horovod_library_wakes() -> bool:
    import horovod.torch
    library = next(Path(horovod.torch.__file__).parent.glob("mpi_lib_v2*.so"), None)
    return library is not None and WAKE_ENV.encode() in library.read_bytes()


def horovod_cycle_ms(requested: float, env, on_cpu: bool, wakes: bool = False) -> float | None:
    """The cycle (``HOROVOD_CYCLE_TIME``) to start Horovod with; None leaves Horovod's.

    Horovod's background thread runs a negotiation round (a collective: Gloo's under
    horovodrun elastic, with work for Gloo's socket thread) every cycle, busy or idle. At
    Horovod's 1 ms those two threads took a fifth of a rank's CPU beside its training thread
    (charlm, 2 ranks on 2 cores, per-thread CPU over 90 s), CPU the training threads, which
    fill the cores, lacked. Without the wake (:func:`horovod_wakes`) a longer cycle delays
    every collective's start: the last bucket's is on every step's path. Measured there with
    the cycle set for both Horovod arms alike, Regatta / DDP (charlm, one run each): 1 ms
    0.78, 2.5 ms 0.84, 5 ms 0.89, 10 ms 0.86; hence 5 ms on the CPU without the wake (and
    ``train.horovod_cycle_ms`` for a model whose step is mostly that latency). With it a
    collective starts at once whatever the cycle, which then only spaces the idle rounds:
    20 ms (docs/measurements.md, "Steady-state speed"). On a GPU the CPU has room for the
    thread: Horovod's default stays. An environment that sets the cycle, or turns on Horovod's
    autotuning (which a set cycle would pin), decides alone."""
    if env.horovod_cycle_time is not None or env.horovod_autotune:
        return None
    if requested > 0:
        return requested
    if not on_cpu:
        return None
    return WAKING_CYCLE_MS if wakes else CPU_CYCLE_MS


class HorovodCollectives:
    def __init__(self, hvd):
        self.hvd = hvd
        fine_timer_slack()   # the waits' short sleeps (HorovodRequest) end on time

    def allreduce_sum(self, tensor, name):
        if self.hvd.size() > 1:
            self.hvd.allreduce_(tensor, op=self.hvd.Sum, name=name)

    def allreduce_sum_async(self, tensors, name):
        if self.hvd.size() == 1:
            return Completed()
        return HorovodRequest(self.hvd, self.hvd.grouped_allreduce_async_(
            list(tensors), op=self.hvd.Sum, name=name), sum(t.numel() * t.element_size() for t in tensors))

    def allgather_object(self, obj, name):
        return self.hvd.allgather_object(obj, name=name) if self.hvd.size() > 1 else [obj]

    def broadcast_object(self, obj, name, root=0):
        return self.hvd.broadcast_object(obj, root_rank=root, name=name) if self.hvd.size() > 1 else obj


class HorovodRequest:
    def __init__(self, hvd, handle, nbytes: int = 0):
        self.hvd, self.handle, self.nbytes = hvd, handle, nbytes

    def done(self) -> bool:
        return self.hvd.poll(self.handle)

    def wait(self) -> None:
        # synchronize spins, yielding. A short sum is noticed sooner that way, but a long one
        # (a large model's bucket) runs slower beside the spin, which holds a core that
        # Horovod's threads need for the sum itself (bench_allreduce: one 100 MB sum on 2
        # ranks here took 1.40-1.57x torch.distributed's time spinning, 0.95-1.07x asleep),
        # so long sums are waited for asleep between polls.
        if self.nbytes >= SLEPT_WAIT_BYTES:
            poll(lambda: self.hvd.poll(self.handle), cap_s=WAIT_CAP_S, spin_s=0.0)
        self.hvd.synchronize(self.handle)   # raises the collective's failure


class MpiCollectives:
    def __init__(self):
        from mpi4py import MPI
        self.mpi, self.comm = MPI, MPI.COMM_WORLD

    def allreduce_sum(self, tensor, name):
        if self.comm.Get_size() > 1:
            self.comm.Allreduce(self.mpi.IN_PLACE, tensor.numpy(), op=self.mpi.SUM)

    def allgather_object(self, obj, name):
        return self.comm.allgather(obj)

    def broadcast_object(self, obj, name, root=0):
        return self.comm.bcast(obj, root=root)
