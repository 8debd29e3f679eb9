"""The explicit topology of one training generation.

A :class:`World` is immutable: after every elastic reset a new one is built and passed to
whatever needs rank, size or placement. Nothing reads these from globals.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

from .env import Env


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
    def single(cls, host: str = "localhost") -> "World":
        return cls(rank=0, size=1, local_rank=0, local_size=1, host=host)

    @classmethod
    def launched(cls, env: Env) -> "World":
        """The fixed world the launcher (mpirun, horovodrun, none) started."""
        w = env.launched
        return cls(rank=w.rank, size=w.size, local_rank=w.local_rank,
                   local_size=max(w.local_size, w.local_rank + 1), host=env.host)

    @classmethod
    def from_horovod(cls, hvd, host: str, generation: int = 0) -> "World":
        return cls(rank=hvd.rank(), size=hvd.size(), local_rank=hvd.local_rank(),
                   local_size=hvd.local_size(), host=host, generation=generation)


def share_cores(world: World, env: Env) -> int:
    """Several ranks on one machine must not each spin a thread per core: with 3 ranks on
    2 cores that oversubscription made steps 50x slower. ``regatta local`` says how many
    processes share the machine (simulated hosts); otherwise the local size does. An
    ``OMP_NUM_THREADS`` the user set wins, as it does for torch alone. Returns the count."""
    import torch
    sharing = env.procs_per_machine or world.local_size
    cores = os.cpu_count() or 1
    threads = env.threads or max(1, cores // sharing)
    if env.threads > 1 and threads * sharing > cores:
        warnings.warn(f"OMP_NUM_THREADS={threads} for each of {sharing} processes on {cores} cores: "
                      f"more threads than cores slows every step", stacklevel=2)
    torch.set_num_threads(threads)
    return threads
