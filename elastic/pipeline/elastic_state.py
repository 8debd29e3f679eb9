"""The elastic pipeline's state under Horovod's contract (commit, restore, reset, sync);
the loop and the launch commands are in elastic_trainer.py.

On every (re)entry ``sync`` makes the grid fit the world: the configured ``pipeline.pp``
(and ``dp``) when the world size allows, otherwise the planner's choice within
``planner.pp_min..pp_max`` from layer costs rank 0 measured once (every rank keeps them,
so the costs outlive rank 0). The stage state comes from the last commit held in memory
(shards.py: own shards, dp peers, buddy copies), else from the durable pipeline
checkpoint, else from the seed. The torch.distributed Gloo group is destroyed and rebuilt
(rank 0 picks a port and broadcasts the address over Horovod under an explicit name), and
a transport error is re-raised as ``HorovodInternalError`` so ``hvd.elastic.run``
restores. Under ``REGATTA_AUDIT=1`` commits and syncs record the full model's digest
(shards.model_digest).
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager

import horovod.torch as hvd
import torch
import torch.distributed as dist
from horovod.common.elastic import State
from horovod.common.exceptions import HorovodInternalError

from elastic.config import TrainConfig
from elastic.events import EventLog
from elastic.lifeline import FastRecovery
from elastic.sampler import Cursor
from elastic.world import World

from . import checkpoint as ckpt
from .config import Plan, PipelineConfig, make_plan
from .grid import Grid, cut
from .planner import PlannerConfig, choose, measure_job, plan_grid
from .rebalance import export_stage, import_stage
from .shards import (buddies, contributors, covering_step, exchange, model_digest, shard_bytes,
                     tensor_digests)
from .stage import PipelineJob, PipelineStage
from .transport import GlooTransport, free_port
from . import trainer


def comm_error(err: RuntimeError) -> bool:
    text = str(err).lower()
    return isinstance(err, getattr(dist, "DistError", ())) or any(
        word in text for word in ("connection", "gloo", "timed out", "broken pipe", "socket", "peer"))


@contextmanager
def translated():
    """torch.distributed's failures as the error ``hvd.elastic.run`` restores from."""
    try:
        yield
    except RuntimeError as err:
        if isinstance(err, HorovodInternalError) or not comm_error(err):
            raise
        raise HorovodInternalError(f"pipeline transport: {err}") from err


class ElasticPipeline(State):
    def __init__(self, job: PipelineJob, train: TrainConfig, pipe: PipelineConfig,
                 planner: PlannerConfig, events: EventLog, recovery: FastRecovery | None):
        # No broadcast function: Horovod's check_host_updates is never called (the loop
        # agrees on host changes in its own per-step allreduce).
        super().__init__(bcast_object=None, get_rank=hvd.rank)
        self.job, self.train, self.pipe, self.planner = job, train, pipe, planner
        self.events, self.recovery = events, recovery
        self.run: trainer.Run | None = None
        # Commits, newest first: {"step", "epoch", "consumed", "held": {(start, end): shard}}.
        # The previous one stays until every rank has finished the newest (a rank that died
        # during a commit's buddy exchange must not leave the survivors with half of each).
        self.gens: list[dict] = []
        self.buddy: list[int] = []
        self.costs = None                  # planner.LayerCosts, measured once by rank 0
        self.last_plan: dict | None = None
        self.entries = 0
        self.on_metrics: list = []
        self.audit = os.environ.get("REGATTA_AUDIT") == "1"

    # -- Horovod's contract --------------------------------------------------------------
    def commit(self, reason: str = "periodic") -> None:
        """Snapshot this rank's stage (and pass it to the buddy); host updates are agreed
        per step in the loop, so unlike Horovod's commit this broadcasts nothing."""
        started, run = time.perf_counter(), self.run
        with translated():
            own = export_stage(run.stage.module, run.optimizer)
            held = {run.children: own}
            me = run.world.rank
            if run.plan.dp == 1 and run.world.size > 1:
                senders = [r for r, b in enumerate(self.buddy) if b == me and r != me]
                for rng, shard in exchange(run.transport, (run.children, own), self.buddy[me], senders):
                    held[tuple(rng)] = shard
        self.gens = [{"step": run.step, "epoch": run.cursor.epoch, "consumed": run.cursor.consumed,
                      "held": held}] + self.gens[:1]
        audit = {"param_hash": self._committed_digest(own)} if self.audit else {}
        self.events.record("commit", run.step, reason=reason, cost_s=time.perf_counter() - started,
                           loss=run.loss, held=[list(r) for r in held],
                           held_bytes=shard_bytes(held), **audit)

    def save(self) -> None:
        self.commit()

    def restore(self) -> None:
        """After a failed collective: drop the live stage; sync rebuilds from the commit."""
        failed_at = self.run.step if self.run else None
        self.prepare_reset()
        step = self.gens[0]["step"] if self.gens else 0
        self.events.record("restore", step, from_step=failed_at,
                           steps_redone=(failed_at - step) if failed_at is not None else 0)

    def prepare_reset(self) -> None:
        """Before Horovod re-initialises: close the Gloo group (peers blocked on this rank
        fail at once instead of at the timeout), then let lifelines know it is coming."""
        self._close_transport()
        if self.recovery:
            self.recovery.before_init()

    def reset(self) -> None:
        self.events.rank = hvd.rank()
        self.events.record("reset", self.gens[0]["step"] if self.gens else None, size_after=hvd.size(),
                           size_before=self.run.world.size if self.run else None)

    def sync(self) -> None:
        started = time.perf_counter()
        self.entries += 1
        world = World.from_horovod(hvd, generation=self.entries - 1)
        self.events.rank = world.rank
        with translated():
            gens = [{k: g[k] for k in ("step", "epoch", "consumed")} | {"ranges": list(g["held"])}
                    for g in self.gens]
            inventory = hvd.allgather_object({"host": world.host, "costs": self.costs, "gens": gens},
                                             name="regatta.pipe.inventory")
            self._share_costs(inventory, world)
            plan = self._plan(world.size)
            pieces, position = self._gather([{"rank": r, **g} for r, i in enumerate(inventory)
                                             for g in i["gens"]], world)
            moved = time.perf_counter() - started
            self._build(world, plan, pieces, position, [i["host"] for i in inventory])
            self.commit(reason="sync")
        self._record_sync(plan, pieces, moved, started)
        if self.recovery:
            self.recovery.enter(hvd, world)

    # -- pieces of sync ------------------------------------------------------------------
    def _share_costs(self, inventory: list[dict], world: World) -> None:
        known = next((i["costs"] for i in inventory if i["costs"] is not None), None)
        if known is None:   # the first start: rank 0 measures, everyone keeps a copy
            known = measure_job(self.job, self.train, self.pipe.microbatches) if world.is_root else None
            known = hvd.broadcast_object(known, root_rank=0, name="regatta.pipe.costs")
        self.costs = known

    def _plan(self, size: int) -> Plan:
        """The configured grid when it fits ``size`` ranks, else the planner's choice."""
        pipe, gb, m = self.pipe, self.train.global_batch, self.pipe.microbatches
        if size % pipe.pp == 0 and pipe.dp in (0, size // pipe.pp):
            if pipe.boundaries:
                return make_plan(pipe, size, len(self.costs), gb)
            fit = plan_grid(self.costs, size // pipe.pp, pipe.pp, m, gb, self.planner)
            if fit.feasible:
                return Plan(pp=fit.pp, dp=fit.dp, schedule=pipe.schedule, microbatches=m,
                            stages=fit.stages, microbatch_size=gb // (fit.dp * m))
        best = choose(self.costs, size, gb, m, self.planner)
        return Plan(pp=best.pp, dp=best.dp, schedule=pipe.schedule, microbatches=m,
                    stages=best.stages, microbatch_size=gb // (best.dp * m))

    def _gather(self, items: list[dict], world: World):
        """One copy of every shard of the newest fully held commit, on every rank; None
        on a fresh start (then the checkpoint on disk, if any, or the seed)."""
        step = covering_step(items, len(self.costs))
        if step is None:
            if items:   # more than one rank lost at once: only the disk can help
                held = sorted({i["step"] for i in items})
                self.events.record("state_lost", None, steps_held=held)
                if ckpt.read_manifest(self.train.checkpoint_path.parent) is None:
                    raise RuntimeError(f"no commit is fully held by the ranks left (steps held: "
                                       f"{held}) and there is no durable checkpoint to resume from")
            return None, None
        mine = [next(g["held"][rng] for g in self.gens if g["step"] == step and rng in g["held"])
                for rng, owner in contributors(items, step).items() if owner == world.rank]
        gathered = hvd.allgather_object(mine, name="regatta.pipe.shards")
        item = next(i for i in items if i["step"] == step)
        return [p for per_rank in gathered for p in per_rank], (step, item["epoch"], item["consumed"])

    def _build(self, world: World, plan: Plan, pieces, position, hosts: list[str]) -> None:
        grid = Grid.of(world, plan)
        torch.manual_seed(self.train.seed)
        module = cut(self.job.build_model(), *plan.stages[grid.stage])
        transport = self._connect(world, plan, grid)
        stage = PipelineStage(self.job, plan, grid, transport, module)
        optimizer = trainer.make_optimizer(stage.module, self.train)
        run = trainer.Run(job=self.job, train=self.train, plan=plan, world=world, grid=grid,
                          transport=transport, stage=stage, optimizer=optimizer,
                          events=self.events, on_metrics=self.on_metrics)
        if pieces is not None:
            import_stage(stage.module, optimizer, pieces)
            run.step, run.cursor = position[0], Cursor(position[1], position[2])
        else:
            manifest = ckpt.load_stage(run.folder, run.children, stage.module, optimizer)
            if manifest is not None:
                run.step, run.cursor = manifest["step"], Cursor(manifest["epoch"], manifest["consumed"])
                self.events.record("resume", run.step, path=str(run.folder / manifest["folder"]),
                                   saved_world_size=manifest["world_size"])
        self.run, self.buddy = run, buddies(hosts, plan.pp, plan.dp)

    def _connect(self, world: World, plan: Plan, grid: Grid) -> GlooTransport:
        self._close_transport()
        mine = f"tcp://{_address(world.host)}:{free_port()}" if world.is_root else None
        init = hvd.broadcast_object(mine, root_rank=0, name="regatta.pipe.init_method")
        groups = [[grid.rank_of(r, s) for r in range(plan.dp)] for s in range(plan.pp)]
        return GlooTransport(world.rank, world.size, init, groups, grid.stage, timeout_s=120)

    def _close_transport(self) -> None:
        if self.run is not None and self.run.transport is not None:
            try:
                self.run.transport.close()
            except Exception:  # noqa: BLE001 - a group whose peers died may not close cleanly
                pass
            self.run.transport = None

    def _committed_digest(self, own: dict) -> str:
        """The full model's digest at this commit (replica 0 of each stage contributes)."""
        digests = tensor_digests(own["model"]) if self.run.grid.replica == 0 else {}
        everyone = hvd.allgather_object(digests, name="regatta.pipe.audit")
        return model_digest({k: v for d in everyone for k, v in d.items()})

    def _record_sync(self, plan: Plan, pieces, moved: float, started: float) -> None:
        run = self.run
        audit = {}
        if self.audit and pieces is not None:
            audit["param_hash"] = model_digest({k: v for p in pieces
                                                for k, v in tensor_digests(p["model"]).items()})
        self.events.record("sync", run.step, size=run.world.size, cost_s=time.perf_counter() - started,
                           **audit)
        old = self.last_plan
        new = {"pp": plan.pp, "dp": plan.dp, "stages": [list(s) for s in plan.stages]}
        if old is not None and old != new:
            self.events.record("replan", run.step, old=old, new=new, size=run.world.size,
                               move_s=moved, cost_s=time.perf_counter() - started,
                               from_memory=pieces is not None, **audit)
        self.last_plan = new


def _address(host: str) -> str:
    import socket
    try:
        return socket.gethostbyname(host)
    except OSError:
        return "127.0.0.1"
