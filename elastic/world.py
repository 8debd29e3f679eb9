"""The explicit topology of one training generation.

A :class:`World` is immutable: after every elastic reset a new one is built from Horovod
and passed to whatever needs rank, size or placement. Nothing reads these from globals.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int
    local_size: int
    host: str           # the host name as the launcher sees it (simulated hosts differ)
    generation: int = 0  # how many resets this process has been through

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside world of size {self.size}")
        if not 0 <= self.local_rank < self.local_size:
            raise ValueError(f"local_rank {self.local_rank} outside local size {self.local_size}")

    @property
    def slot(self) -> int:
        return self.local_rank

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    @classmethod
    def single(cls) -> "World":
        return cls(rank=0, size=1, local_rank=0, local_size=1, host=launcher_host_name())

    @classmethod
    def from_horovod(cls, hvd, generation: int = 0) -> "World":
        return cls(rank=hvd.rank(), size=hvd.size(), local_rank=hvd.local_rank(),
                   local_size=hvd.local_size(), host=launcher_host_name(), generation=generation)


def share_cores(world: World) -> None:
    """Several ranks on one machine must not each spin a thread per core: with 3 ranks on
    2 cores that oversubscription made steps 50x slower. ``regatta local`` says how many
    processes share the machine (simulated hosts); otherwise the local size does."""
    import torch
    sharing = int(os.environ.get("REGATTA_PROCS_PER_MACHINE", 0)) or world.local_size
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // sharing))


def launcher_host_name() -> str:
    """The name the launcher gave this process's host (horovodrun sets HOROVOD_HOSTNAME)."""
    return os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()


def launched_elastic() -> bool:
    """True inside a worker started by ``horovodrun`` in elastic mode."""
    return os.environ.get("HOROVOD_ELASTIC") == "1"
