"""One rank's pipeline as it stands in one world: plan, grid, transport, stage, optimizer,
step and cursor. Fixed worlds build it once (fixed_state.py); elastic ones rebuild it on
every reset (elastic_state.py).

The durable checkpoint (checkpoint.py): replica 0 of every stage writes its children,
then, after a barrier, rank 0 publishes the manifest.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from elastic.config import TrainConfig
from elastic.data.sampler import Cursor, global_batch
from elastic.optim import make_optimizer
from elastic.runtime.world import World

from . import checkpoint as ckpt
from .config import Plan
from .grid import Grid, cut
from .stage import PipelineJob, PipelineStage
from .transport import Transport


@dataclass
class Run:
    job: PipelineJob
    train: TrainConfig
    plan: Plan
    world: World
    grid: Grid
    transport: Transport
    stage: PipelineStage
    optimizer: torch.optim.Optimizer
    step: int = 0
    cursor: Cursor = Cursor()
    loss: float | None = None

    @property
    def folder(self) -> Path:
        return self.train.checkpoint_path.parent

    @property
    def children(self) -> tuple:
        return self.plan.stages[self.grid.stage]

    @property
    def dp_groups(self) -> list[list[int]]:
        """The world ranks of each stage's replicas (who compares with whom)."""
        return [[self.grid.rank_of(r, s) for r in range(self.plan.dp)] for s in range(self.plan.pp)]


def build_run(job: PipelineJob, train: TrainConfig, plan: Plan, world: World,
              transport: Transport, device: str = "") -> Run:
    """This rank's stage of ``plan``: the whole model built under the training seed (so
    every stage holds exactly the single-process weights), then cut to its children."""
    grid = Grid.of(world, plan)
    torch.manual_seed(train.seed)
    module = cut(job.build_model(), *plan.stages[grid.stage])
    stage = PipelineStage(job, plan, grid, transport, module, device or None)
    return Run(job=job, train=train, plan=plan, world=world, grid=grid, transport=transport,
               stage=stage, optimizer=make_optimizer(stage.module.parameters(), train))


def resume(run: Run) -> dict | None:
    """Load this stage from the durable checkpoint; the resume event's detail, or None."""
    manifest = ckpt.load_stage(run.folder, run.children, run.stage.module, run.optimizer)
    if manifest is None:
        return None
    run.step, run.cursor = manifest["step"], Cursor(manifest["epoch"], manifest["consumed"])
    return {"path": str(run.folder / manifest["folder"]), "saved_world_size": manifest["world_size"],
            "saved_pp": manifest["pp"], "run_id": manifest.get("run_id")}


def next_batch(run: Run, size: int) -> torch.Tensor:
    """The step's global batch indices. An epoch's short tail is skipped, so every
    microbatch has the same shape and peers agree on buffer shapes once."""
    indices = global_batch(run.cursor, size, run.train.global_batch, run.train.seed)
    if len(indices) < run.train.global_batch:
        run.cursor = Cursor(run.cursor.epoch + 1, 0)
        indices = global_batch(run.cursor, size, run.train.global_batch, run.train.seed)
    return indices


def save_checkpoint(run: Run, run_id: str) -> dict | None:
    """Every rank calls this at the same step; rank 0 returns the event detail."""
    if run.grid.replica == 0:
        ckpt.save_stage(run.folder, run.step, run.children, run.stage.module, run.optimizer)
    run.transport.barrier()
    if not run.world.is_root:
        return None
    ckpt.publish(run.folder, run.step, run.plan.stages,
                 {"epoch": run.cursor.epoch, "consumed": run.cursor.consumed, "run_id": run_id,
                  "world_size": run.world.size, "pp": run.plan.pp, "dp": run.plan.dp,
                  "wall_time": time.time()})
    return {"path": str(run.folder)}
