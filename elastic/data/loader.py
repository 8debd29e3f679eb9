"""A rank's batches for the steps ahead, from the global cursor (sampler.py).

For a map-style ``Dataset`` the indices drive a real torch ``DataLoader`` as its batch
sampler, so its workers, prefetching and pinned memory work as usual; the loader is
rebuilt at every (re)entry of the training loop, from the cursor the world agreed on, so
across any number of resets no sample of an epoch is skipped or repeated. Tensors that
fit in memory are indexed directly (no loader, no copies beyond the batch).

Each step's share is split into ``microsteps`` consecutive slices (gradient accumulation);
a rank whose share is empty (a global batch smaller than the world, an epoch's short
tail) still yields a batch, ``None``, so every rank stays on the same step.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader

from .sampler import Cursor, global_batch, rank_share


@dataclass(frozen=True)
class Plan:
    """Which indices this rank takes, step by step."""
    size: int            # samples in the data set
    global_batch: int
    seed: int
    rank: int
    world: int
    microsteps: int = 1

    def step(self, cursor: Cursor) -> tuple[list[torch.Tensor], Cursor]:
        """This rank's microbatches of the step at ``cursor``, and the next cursor."""
        indices = global_batch(cursor, self.size, self.global_batch, self.seed)
        share = rank_share(indices, self.rank, self.world)
        return list(share.tensor_split(self.microsteps)), cursor.advance(len(indices), self.size)


class CursorBatches:
    """A DataLoader batch sampler: this rank's microbatches from ``cursor`` on. It keeps
    what it handed out, so the step can check the loader is where the cursor says."""

    def __init__(self, plan: Plan, cursor: Cursor, steps: int):
        self.plan, self.cursor, self.steps = plan, cursor, steps
        self.issued: deque = deque()

    def __iter__(self):
        cursor = self.cursor
        for _ in range(self.steps):
            micro, cursor = self.plan.step(cursor)
            for indices in micro:
                self.issued.append(indices)
                yield indices.tolist()

    def __len__(self) -> int:
        return self.steps * self.plan.microsteps


class Batches:
    """What the step asks for: this step's microbatches, in order."""

    def __init__(self, data, plan: Plan, cursor: Cursor, steps: int, workers: int = 0,
                 pin_memory: bool = False, loader_options: dict | None = None):
        self.plan, self.tensors = plan, isinstance(data, (tuple, list))
        if self.tensors:
            self.data, self.loader = tuple(data), None
            return
        self.sampler = CursorBatches(plan, cursor, steps)
        options = {"num_workers": workers, "pin_memory": pin_memory, **(loader_options or {})}
        collate = options.pop("collate_fn", None) or torch.utils.data.default_collate
        self.loader = iter(DataLoader(data, batch_sampler=self.sampler,
                                      collate_fn=_EmptyAware(collate), **options))

    def take(self, indices: torch.Tensor):
        """The batch of ``indices`` (the step's own computation of them)."""
        if self.tensors:
            return tuple(t[indices] for t in self.data) if len(indices) else None
        batch = next(self.loader)
        expected = self.sampler.issued.popleft()
        if not torch.equal(expected, indices):
            raise RuntimeError("data loader and cursor disagree on this step's samples")
        return batch

    def close(self) -> None:
        if self.loader is not None:
            del self.loader   # stops its workers
            self.loader = None


class _EmptyAware:
    """A collate function that lets an empty share through as ``None`` (picklable, so
    loader workers started by spawn or forkserver can take it)."""

    def __init__(self, collate):
        self.collate = collate

    def __call__(self, items):
        return self.collate(items) if items else None


def dataset_size(data) -> int:
    return len(data[0]) if isinstance(data, (tuple, list)) else len(data)


def to_device(batch, device: torch.device):
    """``batch`` (tensors nested in tuples, lists and dicts) on ``device``."""
    if torch.is_tensor(batch):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch
