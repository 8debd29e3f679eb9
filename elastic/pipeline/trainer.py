"""Hybrid data x pipeline parallel training on a fixed world.

    mpirun -np 4 --hostfile hostfiles/pipeline.txt python -m jobs.charlm \
        --pp 2 --dp 2 --schedule 1f1b --microbatches 8

Every rank derives the step's global batch from the shared cursor (elastic/sampler.py),
takes its replica's share, and runs its stage's schedule; the stage's gradients are then
summed over its replicas and each rank updates its own stage. A failed rank ends an MPI
job: ``python -m elastic.pipeline.supervisor`` relaunches from the last checkpoint.
The epoch's last, short batch is skipped so that every microbatch has the same shape.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from elastic.config import TrainConfig
from elastic.events import EventLog, Progress
from elastic.sampler import Cursor, global_batch, rank_share
from elastic.world import World, launched_elastic, launcher_host_name, share_cores

from . import checkpoint as ckpt
from .config import Plan, PipelineConfig, make_plan
from .grid import Grid, cut
from .metrics import StepMetrics
from .planner import PlannerConfig
from .rebalance import Balancer
from elastic.checkpoint import parameter_hash

from .stage import PipelineJob, PipelineStage
from .transport import Transport, make_transport


def world_from_launcher() -> World:
    """The fixed world mpirun (OMPI_COMM_WORLD_*) or horovodrun (HOROVOD_*) started."""
    env = os.environ
    for prefix in ("OMPI_COMM_WORLD_", "HOROVOD_"):
        if prefix + "SIZE" in env:
            return World(rank=int(env[prefix + "RANK"]), size=int(env[prefix + "SIZE"]),
                         local_rank=int(env.get(prefix + "LOCAL_RANK", 0)),
                         local_size=int(env.get(prefix + "LOCAL_SIZE", 1)),
                         host=launcher_host_name())
    return World.single()


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
    events: EventLog
    on_metrics: list = field(default_factory=list)
    step: int = 0
    cursor: Cursor = Cursor()
    loss: float | None = None
    progress: Progress | None = None

    @property
    def folder(self) -> Path:
        return self.train.checkpoint_path.parent

    @property
    def children(self) -> tuple:
        return self.plan.stages[self.grid.stage]


def make_optimizer(module, cfg: TrainConfig) -> torch.optim.Optimizer:
    # The choices of elastic.dataparallel.make_optimizer (which would import Horovod).
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(module.parameters(), lr=cfg.lr, momentum=0.9)
    return torch.optim.Adam(module.parameters(), lr=cfg.lr)


def setup(job: PipelineJob, train: TrainConfig, pipe: PipelineConfig, world: World) -> Run:
    """Plan the grid, build this rank's stage, connect the transport, resume if possible."""
    torch.manual_seed(train.seed)
    full = job.build_model()     # the whole model, then only this stage's children are kept
    plan = make_plan(pipe, world.size, len(full), train.global_batch)
    grid = Grid.of(world, plan)
    module = cut(full, *plan.stages[grid.stage])
    del full
    events = EventLog(train.run_dir, world.host, world.slot)
    events.rank = world.rank
    groups = [[grid.rank_of(r, s) for r in range(plan.dp)] for s in range(plan.pp)]
    transport = make_transport(pipe.transport, world.rank, world.size, groups, grid.stage)
    run = Run(job=job, train=train, plan=plan, world=world, grid=grid, transport=transport,
              stage=PipelineStage(job, plan, grid, transport, module),
              optimizer=make_optimizer(module, train), events=events)
    events.record("start", None, size=world.size, stage=grid.stage, replica=grid.replica,
                  children=list(run.children), pp=plan.pp, dp=plan.dp, schedule=plan.schedule,
                  microbatches=plan.microbatches, transport=type(transport).__name__)
    manifest = ckpt.load_stage(run.folder, run.children, module, run.optimizer)
    if manifest is not None:
        run.step, run.cursor = manifest["step"], Cursor(manifest["epoch"], manifest["consumed"])
        events.record("resume", run.step, path=str(run.folder / manifest["folder"]),
                      saved_world_size=manifest["world_size"], saved_pp=manifest["pp"])
    return run


def next_batch(run: Run, size: int) -> torch.Tensor:
    """The step's global batch indices; skips an epoch's short tail (see module doc)."""
    indices = global_batch(run.cursor, size, run.train.global_batch, run.train.seed)
    if len(indices) < run.train.global_batch:
        run.cursor = Cursor(run.cursor.epoch + 1, 0)
        indices = global_batch(run.cursor, size, run.train.global_batch, run.train.seed)
    return indices


def train_step(run: Run, data: tuple) -> StepMetrics:
    started = time.perf_counter()
    indices = next_batch(run, len(data[0]))
    share = rank_share(indices, run.grid.replica, run.plan.dp)
    needs_data = run.grid.is_first or run.grid.is_last
    batch = tuple(t[share] for t in data) if needs_data else None
    count = run.job.loss_count(tuple(t[indices] for t in data)) if run.grid.is_last else 1
    # Dropout replays identically after a restart from a checkpoint.
    torch.manual_seed(run.train.seed * 1_000_003 + run.step * 1009 + run.world.rank)
    run.stage.module.train()
    run.optimizer.zero_grad(set_to_none=True)
    stats = run.stage.forward_backward(batch, count)
    loss_sum, reduce_time, reduce_bytes = run.stage.reduce(stats)
    run.optimizer.step()
    run.cursor = run.cursor.advance(len(indices), len(data[0]))
    run.step += 1
    run.loss = loss_sum / count if loss_sum is not None else None
    w, g = run.world, run.grid
    return StepMetrics.of(stats, step=run.step, wall_time=time.time(), rank=w.rank,
                          world_size=w.size, host=w.host, slot=w.slot, stage=g.stage,
                          replica=g.replica, schedule=run.plan.schedule,
                          microbatches=run.plan.microbatches,
                          step_time=time.perf_counter() - started, allreduce_time=reduce_time,
                          allreduce_bytes=reduce_bytes, samples=len(share), loss=run.loss)


def save_checkpoint(run: Run) -> None:
    """Replica 0 of every stage writes its file; rank 0 publishes after all have."""
    started = time.perf_counter()
    if run.grid.replica == 0:
        ckpt.save_stage(run.folder, run.step, run.children, run.stage.module, run.optimizer)
    run.transport.barrier()
    if run.world.is_root:
        ckpt.publish(run.folder, run.step, run.plan.stages,
                     {"epoch": run.cursor.epoch, "consumed": run.cursor.consumed,
                      "world_size": run.world.size, "pp": run.plan.pp, "dp": run.plan.dp,
                      "wall_time": time.time()})
        run.events.record("checkpoint", run.step, path=str(run.folder),
                          cost_s=time.perf_counter() - started)


def run_pipeline(job: PipelineJob, train: TrainConfig, pipe: PipelineConfig,
                 on_metrics=None, world: World | None = None,
                 planner: PlannerConfig | None = None) -> dict:
    """Train ``job`` to ``train.steps``; ``on_metrics(dict)`` gets every step's metrics;
    ``planner.rebalance`` moves stage boundaries from measured stage times (rebalance.py).
    Under horovodrun elastic the elastic trainer runs instead (re-plans on every reset)."""
    if world is None and launched_elastic():
        from .elastic_trainer import run_elastic   # imports Horovod, which mpirun runs never need
        return run_elastic(job, train, pipe, planner, on_metrics)
    world = world or world_from_launcher()
    Path(train.run_dir).mkdir(parents=True, exist_ok=True)
    share_cores(world)
    run = setup(job, train, pipe, world)
    if on_metrics is not None:
        run.on_metrics.append(on_metrics)
    balancer = Balancer(run, planner or PlannerConfig())
    data = job.train_data()
    # Pipelines checkpoint at a fixed cadence; "auto" is the elastic loop's (Young/Daly).
    every = (train.fixed_commit_every or 10) * train.checkpoint_every
    run.events.record("ready", run.step)
    while run.step < train.steps:
        metrics = train_step(run, data)
        for callback in run.on_metrics:
            callback(metrics.as_dict())
        _report(run)
        balancer.after_step(run, metrics)
        if every and run.step % every == 0 and run.step < train.steps:
            save_checkpoint(run)
    save_checkpoint(run)
    return finish(run)


def _report(run: Run) -> None:
    """Replica 0's last stage knows the loss: it keeps the step counter launchers poll."""
    if run.grid.replica == 0 and run.grid.is_last:
        run.progress = run.progress or Progress(run.train.run_dir)
        run.progress.update(run.step, run.world.size)
        if run.train.progress and run.step % max(1, run.train.steps // 20) == 0:
            print(f"step {run.step}/{run.train.steps} loss {run.loss:.4f}", flush=True)


def finish(run: Run) -> dict:
    """Rank 0 assembles the model from the final checkpoint, evaluates it and writes
    result.json; every rank writes final/<host>-<slot>.json with its stage's hash."""
    w, g, run_dir = run.world, run.grid, Path(run.train.run_dir)
    mine = {"host": w.host, "slot": w.slot, "rank": w.rank, "stage": g.stage, "replica": g.replica,
            "children": list(run.children), "param_hash": parameter_hash(run.stage.module),
            "step": run.step, "loss": run.loss, "world_size": w.size, "wall_time": time.time()}
    everyone = run.transport.gather_object(mine, root=0)
    (run_dir / "final").mkdir(exist_ok=True)
    (run_dir / "final" / f"{w.host}-{w.slot}.json").write_text(json.dumps(mine))
    result = dict(mine)
    if w.is_root:
        torch.manual_seed(run.train.seed)
        full = run.job.build_model()
        ckpt.load_full(run.folder, full)
        last = next(r for r in everyone if r["stage"] == g.pp - 1 and r["replica"] == 0)
        result = {"host": w.host, "slot": w.slot, "rank": w.rank, "world_size": w.size,
                  "step": run.step, "loss": last["loss"], "param_hash": parameter_hash(full),
                  "stages": [{k: r[k] for k in ("stage", "children", "param_hash")}
                             for r in everyone if r["replica"] == 0],
                  "pipeline": {"pp": g.pp, "dp": g.dp, "schedule": run.plan.schedule,
                               "microbatches": run.plan.microbatches},
                  "metrics": run.job.evaluate(full), "wall_time": time.time()}
        (run_dir / "result.json").write_text(json.dumps(result, indent=1))
    run.events.record("finish", run.step, size=w.size)
    run.events.close()
    run.transport.close()
    return result
