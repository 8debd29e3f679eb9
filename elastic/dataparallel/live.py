"""Recovering from the survivors' live state instead of the last commit.

A data-parallel step changes the state only after its last collective has returned
(step.py: every sum is in the reducer's ``finish``; clipping and the optimizer's update
are local). So a failure raised in a step leaves each survivor exactly at the step before
it, and since replicas apply the same sums they hold the same state: nothing needs to be
restored or moved between them, and the failed step's global batch is simply done again
on the new world. A death inside the step's last collective can let some survivors
finish the step and others not: they are then one step apart, each group consistent, and
the ranks behind take the advanced state (``adopted``).

Two side effects of a step come before its collectives and are undone here: the
forward's writes to the model's buffers (BatchNorm's running statistics), kept by
:class:`BufferStash` at the start of every step; and the gradients, which the next step
zeroes anyway.

    summary     what each rank tells the others in the sync's inventory
    choose      every rank computes the same answer from the same inventory: which state
                wins, who sends it (each survivor holding it sends a stripe), who receives
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch


class BufferStash:
    """The model's buffers as they were when the step began, until it is applied."""

    def __init__(self, model: torch.nn.Module):
        self._buffers = [b for b in model.buffers() if b.numel()]
        self._kept = [torch.empty_like(b) for b in self._buffers]
        self._holding = False

    def keep(self) -> None:
        for kept, buffer in zip(self._kept, self._buffers):
            kept.copy_(buffer)
        self._holding = bool(self._buffers)

    def applied(self) -> None:
        """The step is done: the buffers it wrote are the state's now."""
        self._holding = False

    def put_back(self) -> None:
        """After a failed step: its forward's writes taken back (none if it had finished)."""
        if self._holding:
            for kept, buffer in zip(self._kept, self._buffers):
                buffer.copy_(kept)
        self._holding = False


def summary(step: int, epoch: int, consumed: int, total: int, digest: str | None) -> dict:
    """This rank's live state, as the inventory carries it (no bytes)."""
    return {"step": step, "epoch": epoch, "consumed": consumed, "total": total, "digest": digest}


@dataclass(frozen=True)
class LivePlan:
    step: int                    # the step of the state every rank ends with
    sources: tuple[int, ...]     # ranks holding it: each sends a stripe to those that need it
    behind: tuple[int, ...]      # live ranks at an older step: they take it (adopted)
    disagreeing: tuple[int, ...]  # live at that step, but another cursor, size or digest
    needs: tuple[int, ...]       # every rank that receives it (behind, disagreeing, new)

    @property
    def kind(self) -> str:
        """The recovery event: nothing restored, or ranks behind took the advanced state."""
        return "adopted" if self.behind or self.disagreeing else "recovered_live"


def _version(live: dict) -> tuple:
    return live["epoch"], live["consumed"], live["total"], live["digest"]


def choose(lives: list[dict | None]) -> LivePlan | None:
    """``lives[r]``: rank r's summary, or None where it holds no state of the job (a new
    worker, one replaced in place, one whose live tensors a cut transfer left half
    written). The most advanced step wins; among ranks at it, the version most of them
    hold (the lowest rank's on a tie). None: no rank is live, the commit must serve."""
    live = {rank: s for rank, s in enumerate(lives) if s is not None}
    if not live:
        return None
    top = max(s["step"] for s in live.values())
    at_top = [rank for rank, s in live.items() if s["step"] == top]
    counts = Counter(_version(live[rank]) for rank in at_top)
    first = {}
    for rank in at_top:
        first.setdefault(_version(live[rank]), rank)
    winner = max(counts, key=lambda version: (counts[version], -first[version]))
    sources = tuple(rank for rank in at_top if _version(live[rank]) == winner)
    return LivePlan(step=top, sources=sources,
                    behind=tuple(rank for rank, s in live.items() if s["step"] < top),
                    disagreeing=tuple(rank for rank in at_top if rank not in sources),
                    needs=tuple(rank for rank in range(len(lives)) if rank not in sources))
