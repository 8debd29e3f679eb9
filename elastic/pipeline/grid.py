"""Where each rank sits in the dp x pp grid, and the stage module it builds.

Ranks are laid out replica-major: ``rank = replica * pp + stage``. A replica's stages are
consecutive ranks, so with ``slots >= pp`` per host (mpirun fills a host's slots before
the next host) a whole pipeline stays on one host: the activations, sent ``m`` times per
step in both directions, travel over shared memory, and only the once-per-step gradient
allreduce between replicas crosses the network. It also means a lost host takes whole
replicas with it, which is what the supervisor re-plans around.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from elastic.runtime.world import World

from .config import Plan


@dataclass(frozen=True)
class Grid:
    rank: int
    pp: int
    dp: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.pp * self.dp:
            raise ValueError(f"rank {self.rank} outside a {self.dp} x {self.pp} grid")

    @classmethod
    def of(cls, world: World, plan: Plan) -> "Grid":
        if world.size != plan.size:
            raise ValueError(f"world of {world.size} ranks cannot hold {plan.dp} x {plan.pp}")
        return cls(rank=world.rank, pp=plan.pp, dp=plan.dp)

    @property
    def stage(self) -> int:
        return self.rank % self.pp

    @property
    def replica(self) -> int:
        return self.rank // self.pp

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.pp - 1

    @property
    def prev_rank(self) -> int | None:
        return None if self.is_first else self.rank - 1

    @property
    def next_rank(self) -> int | None:
        return None if self.is_last else self.rank + 1

    def rank_of(self, replica: int, stage: int) -> int:
        return replica * self.pp + stage

    def stage_peers(self) -> list[int]:
        """The ranks holding this rank's stage in every replica (its data-parallel group)."""
        return [self.rank_of(r, self.stage) for r in range(self.dp)]


def cut(model: nn.Sequential, start: int, end: int) -> nn.Sequential:
    """Children ``start..end-1`` of ``model`` as a Sequential that keeps the original child
    names, so the stage's ``state_dict`` keys are the full model's (``"3.attn.in_proj_weight"``)
    and a checkpoint written under one partition loads under any other."""
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"pipeline stages are cut from an nn.Sequential, got {type(model).__name__}")
    names = list(model._modules)
    return nn.Sequential(OrderedDict((name, model._modules[name]) for name in names[start:end]))


def build_stage(build_model, plan: Plan, stage: int, seed: int) -> nn.Sequential:
    """This stage's module. The whole model is built under the training seed and only the
    stage's children are kept: every rank then holds exactly the weights the single-process
    model would have (initialisation draws from one RNG stream in child order), at the
    cost of briefly allocating the whole model once per rank. The rest is freed on return."""
    torch.manual_seed(seed)
    full = build_model()
    start, end = plan.stages[stage]
    return cut(full, start, end)
