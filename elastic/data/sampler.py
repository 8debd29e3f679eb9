"""Which samples each rank trains on, derived from one global cursor.

Every epoch has one permutation of the data set, the same on every rank (seeded by the
epoch). The committed state holds how many samples of it the job has consumed; each step
takes the next ``global_batch`` of them and splits that slice across the ranks of the
current world. Because the cursor is global, a reset to any world size resumes exactly
where the last commit left off: within an epoch no sample is skipped or seen twice.
(Horovod's ElasticSampler tracks per-rank processed indices instead; that bookkeeping is
what goes wrong in horovod/horovod#3399.)
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass(frozen=True)
class Cursor:
    epoch: int = 0
    consumed: int = 0   # samples of this epoch's permutation already trained on

    def advance(self, taken: int, dataset_size: int) -> "Cursor":
        consumed = self.consumed + taken
        if consumed >= dataset_size:
            return Cursor(self.epoch + 1, 0)
        return Cursor(self.epoch, consumed)


@lru_cache(maxsize=2)
def epoch_permutation(dataset_size: int, epoch: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(dataset_size, generator=generator)


def global_batch(cursor: Cursor, dataset_size: int, batch: int, seed: int) -> torch.Tensor:
    """Indices of the whole step's batch; the epoch's last batch may be shorter."""
    order = epoch_permutation(dataset_size, cursor.epoch, seed)
    return order[cursor.consumed:cursor.consumed + batch]


def rank_share(indices: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous share of a global batch; sizes differ by at most one."""
    base, extra = divmod(len(indices), size)
    start = rank * base + min(rank, extra)
    return indices[start:start + base + (1 if rank < extra else 0)]
