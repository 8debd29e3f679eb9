"""The pipeline engine: dp x pp stages of an ``nn.Sequential`` (see jobs/charlm.py).

    mpirun -np 4 --hostfile hostfiles/pipeline.txt python -m jobs.charlm \
        --pp 2 --dp 2 --schedule 1f1b --microbatches 8

On a fixed world (mpirun, one process) the stages are built once (fixed_state.py) and a
dead rank ends the job (``regatta supervise`` relaunches it from the checkpoint); under
``horovodrun`` elastic they are re-planned and rebuilt from memory on every reset
(elastic_state.py). Everything else (the loop, commits, events, reporting, lifelines) is
the runtime's, as for data parallelism.
"""
from __future__ import annotations

import time
from contextlib import nullcontext

import torch

from elastic.config import ConfigError
from elastic.runtime.checkpoint import parameter_hash
from elastic.runtime.device import choose_device
from elastic.runtime.torch_group import meeting_point

from . import checkpoint as ckpt
from .config import PipelineConfig, make_plan
from .elastic_state import ElasticPipeline, translated
from .fixed_state import FixedPipeline
from .gloo_transport import GlooTransport
from .planner import PlannerConfig
from .rebalance import Balancer
from .run import build_run
from .step import train_step
from .transport import MpiTransport, Transport


class PipelineEngine:
    name = "pipeline"
    replans = True        # every membership change re-plans the grid: never skip sync

    def __init__(self, job, train, pipe: PipelineConfig, planner: PlannerConfig | None, env):
        if train.eval_every:
            raise ConfigError("train.eval_every is not supported by the pipeline engine: it "
                              "evaluates the assembled model once, at the end")
        if train.accumulate > 1 or train.autocast:
            raise ConfigError("train.accumulate and train.autocast are data-parallel options; a "
                              "pipeline accumulates over pipeline.microbatches")
        self.job, self.train, self.pipe = job, train, pipe
        self.planner = planner or PlannerConfig()
        self.elastic = env.elastic
        self.uses_horovod = env.launcher == "horovodrun"   # an mpirun pipeline never inits Horovod
        self.runtime, self.data, self.device = None, (), None
        self._balancer: tuple | None = None     # (the run it was made for, Balancer)

    def build(self, runtime):
        self.runtime = runtime
        world, env = runtime.world, runtime.env
        self.device = choose_device(env.device, world.local_rank)
        self.data = self.job.train_data()
        if self.elastic:
            return ElasticPipeline(runtime, self)
        torch.manual_seed(self.train.seed)
        plan = make_plan(self.pipe, world.size, len(self.job.build_model()), self.train.global_batch)
        groups = [[r * plan.pp + s for r in range(plan.dp)] for s in range(plan.pp)]
        transport = make_transport(self.pipe.transport, world, groups, world.rank % plan.pp,
                                   runtime.collectives, env)
        state = FixedPipeline(runtime, build_run(self.job, self.train, plan, world, transport, self.device))
        runtime.events.record("plan", None, stage=state.run.grid.stage, replica=state.run.grid.replica,
                              children=list(state.run.children), pp=plan.pp, dp=plan.dp,
                              schedule=plan.schedule, microbatches=plan.microbatches,
                              transport=type(transport).__name__)
        if self.train.resume:
            runtime.resumed(state, state.load_checkpoint())
        return state

    def settings(self) -> dict:
        """What the runtime's ``ready`` event records of this engine's choices: the plan
        has events of its own."""
        return {}

    def enter(self, state) -> None:
        pass   # an elastic sync already rebuilt the run for this world

    def evaluate(self, state) -> dict:
        return {}

    def step(self, state, pending):
        with translated() if self.elastic else nullcontext():
            row, agreed = train_step(state.run, self.data, pending,
                                     self.runtime.collectives.allreduce_sum)
            self.balancer(state).after_step(state.run, row)
        if self.elastic:
            state.step_done()
        return row, agreed

    def balancer(self, state) -> Balancer:
        """One per Run (an elastic reset builds a new one); costs measured once are reused."""
        if self._balancer is None or self._balancer[0] is not state.run:
            run = state.run
            costs = getattr(state, "costs", None)
            factor = self.runtime.env.slow_factor(run.world.rank, run.world.host)
            self._balancer = (run, Balancer(run, self.planner, self.runtime.events, factor,
                                            base=list(costs.seconds) if costs else None))
        return self._balancer[1]

    def straggler_groups(self, state) -> list[list[int]]:
        return state.run.dp_groups      # replicas of one stage do the same work

    def finish(self, state) -> tuple[dict, dict]:
        """Every rank's stage hash; rank 0 assembles the model from the final checkpoint
        and evaluates it."""
        run, world = state.run, self.runtime.world
        mine = {"host": world.host, "slot": world.slot, "rank": world.rank, "stage": run.grid.stage,
                "replica": run.grid.replica, "children": list(run.children),
                "param_hash": parameter_hash(run.stage.module), "step": run.step, "loss": run.loss,
                "world_size": world.size, "wall_time": time.time()}
        with translated() if self.elastic else nullcontext():
            everyone = run.transport.gather_object(mine, root=0)
        run.transport.close()
        if not world.is_root:
            return mine, mine
        torch.manual_seed(self.train.seed)
        full = self.job.build_model()
        ckpt.load_full(run.folder, full)
        return mine, {"host": world.host, "slot": world.slot, "rank": world.rank,
                      "world_size": world.size, "step": run.step, "loss": run.loss,
                      "param_hash": parameter_hash(full),
                      "stages": [{k: r[k] for k in ("stage", "children", "param_hash")}
                                 for r in everyone if r["replica"] == 0],
                      "pipeline": {"pp": run.plan.pp, "dp": run.plan.dp, "schedule": run.plan.schedule,
                                   "microbatches": run.plan.microbatches},
                      "metrics": self.job.evaluate(full), "wall_time": time.time()}


def make_transport(kind: str, world, stage_groups: list[list[int]], my_group: int,
                   collectives, env) -> Transport:
    """``kind``: mpi | gloo | auto (mpi under mpirun, else gloo). A Gloo group meets at
    ``REGATTA_PIPE_INIT`` if set, else at an address rank 0 picks and broadcasts over the
    runtime's collectives (MPI or Horovod)."""
    if kind == "auto":
        kind = "mpi" if env.launcher == "mpirun" else "gloo"
    if kind == "mpi":
        return MpiTransport(dp_color=my_group, dp_key=world.rank, cuda_aware=env.mpi_cuda_aware,
                            progress_thread=env.mpi_progress)
    init = env.pipe_init
    if not init:
        init = meeting_point(world, collectives.broadcast_object, "regatta.pipe.init_method")
    return GlooTransport(world.rank, world.size, init, stage_groups, my_group,
                         interface=env.gloo_iface)
