"""A rank's batches for the steps ahead, from the global cursor (sampler.py).

For a map-style ``Dataset`` the indices drive a real torch ``DataLoader`` as its batch
sampler, so its workers, prefetching and pinned memory work as usual; at every (re)entry
of the training loop the loader is iterated again from the cursor the world agreed on, so
across any number of resets no sample of an epoch is skipped or repeated, and its
persistent workers survive every reset the rank survives. Tensors that
fit in memory are indexed directly (no loader, no copies beyond the batch).

Each step's share is split into ``microsteps`` consecutive slices (gradient accumulation);
a rank whose share is empty (a global batch smaller than the world, an epoch's short
tail) still yields a batch, ``None``, so every rank stays on the same step.
"""
from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader

from elastic.runtime.parent_death import die_with

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
    what it handed out, so the step can check the loader is where the cursor says. A new
    world points it at the agreed cursor (``restart``) before the loader is iterated again."""

    def __init__(self, plan: Plan, cursor: Cursor, steps: int):
        self.restart(plan, cursor, steps)

    def restart(self, plan: Plan, cursor: Cursor, steps: int) -> None:
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
    """What the step asks for: this step's microbatches, in order.

    A Dataset is read by one DataLoader for the rank's whole life. Its workers are
    persistent (unless the user's loader options say otherwise): a reset only points the
    batch sampler at the new world's cursor and iterates the loader again, which drops
    what the workers had prefetched for the old world; the workers themselves, and what
    they hold (open files, caches), survive. ``start`` forks them before the first world's
    cursor is known, so a new rank's workers start while it receives the state."""

    def __init__(self, data, workers: int = 0, pin_memory: bool = False,
                 loader_options: dict | None = None):
        self.tensors = isinstance(data, (tuple, list))
        self.loader = None          # the iterator of this world's batches
        if self.tensors:
            self.data, self._dataloader = tuple(data), None
            return
        self.sampler = CursorBatches(Plan(len(data), 1, 0, 0, 1), Cursor(0, 0), 0)
        options = {"num_workers": workers, "pin_memory": pin_memory,
                   "persistent_workers": workers > 0, **(loader_options or {})}
        collate = options.pop("collate_fn", None) or torch.utils.data.default_collate
        if options["num_workers"]:
            options["worker_init_fn"] = _DieWithRank(os.getpid(), options.get("worker_init_fn"))
        self._dataloader = DataLoader(data, batch_sampler=self.sampler,
                                      collate_fn=_EmptyAware(collate), **options)

    def start(self) -> None:
        """Fork the loader's workers now (they are idle until ``restart``)."""
        if self._dataloader is not None and self._dataloader.persistent_workers and self.loader is None:
            self.loader = iter(self._dataloader)

    def restart(self, plan: Plan, cursor: Cursor, steps: int) -> None:
        """This world's batches: ``steps`` steps of ``plan`` from ``cursor``."""
        self.plan = plan
        if self.tensors:
            return
        self.sampler.restart(plan, cursor, steps)
        if not self._dataloader.persistent_workers:
            self.loader = None   # its workers stop before the next ones start
        self.loader = iter(self._dataloader)

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
        """Stop the loader's workers (at the end of training)."""
        self.loader = self._dataloader = None   # the iterator, when freed, stops them


class _DieWithRank:
    """Loader workers go the instant their rank dies: torch's own watchdog notices only
    within 5 s (MP_STATUS_CHECK_INTERVAL), and until then the workers hold the dead
    rank's inherited pipes and sockets open. Then the user's own worker_init_fn."""

    def __init__(self, rank_pid: int, then=None):
        self.rank_pid, self.then = rank_pid, then

    def __call__(self, worker_id: int) -> None:
        die_with(self.rank_pid)
        if self.then is not None:
            self.then(worker_id)


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
