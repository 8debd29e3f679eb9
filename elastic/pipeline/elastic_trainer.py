"""Pipeline and hybrid dp x pp training under ``horovodrun`` elastic (and ``regatta local``).

    regatta local charlm --hosts 4 --steps 120 --commit-every 10 --kill 2@60 -- \
        --pp 2 --global-batch 24 --microbatches 2
    horovodrun -np 4 --min-np 1 --max-np 8 --host-discovery-script \
        "hostfiles/discover.sh hostfiles/hosts.txt" python -m jobs.charlm --pp 2

``run_pipeline`` (trainer.py) hands over here when Horovod launched the job elastic. The
loop is the fixed-world trainer's step; around it, ``ElasticPipeline`` (elastic_state.py)
re-plans the grid and moves stage state on every reset. Host additions and removals are
agreed by a one-number Horovod allreduce per step, so every rank leaves at the same step
after committing; failures surface as ``HorovodInternalError`` (Horovod's own
collectives, lifelines, or a torch.distributed error translated) and roll back to the last
commit.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import horovod.torch as hvd
import torch
from horovod.common.exceptions import HostsUpdatedInterrupt

from elastic.config import TrainConfig
from elastic.events import EventLog
from elastic.faults import FaultPlan
from elastic.lifeline import FastRecovery
from elastic.liveness import Heartbeat
from elastic.world import World, launcher_host_name, share_cores

from . import trainer
from .config import PipelineConfig
from .elastic_state import ElasticPipeline, translated
from .planner import PlannerConfig
from .rebalance import Balancer
from .stage import PipelineJob


def run_elastic(job: PipelineJob, train: TrainConfig, pipe: PipelineConfig,
                planner: PlannerConfig | None = None, on_metrics=None) -> dict:
    Path(train.run_dir).mkdir(parents=True, exist_ok=True)
    events = EventLog(train.run_dir, launcher_host_name(), int(os.environ.get("HOROVOD_LOCAL_RANK", 0)))
    heartbeat = Heartbeat()
    recovery = None
    if os.environ.get("REGATTA_FAST_RECOVERY", "1") == "1":
        recovery = FastRecovery(events, heartbeat, getattr(train, "stall_after", 5.0))
        recovery.before_init()
    hvd.init()
    world = World.from_horovod(hvd)
    share_cores(world)
    events.rank = world.rank
    events.record("start", None, size=world.size, elastic=True, engine="pipeline",
                  fast_recovery=bool(recovery))
    state = ElasticPipeline(job, train, pipe, planner or PlannerConfig(), events, recovery)
    if on_metrics is not None:
        state.on_metrics.append(on_metrics)
    events.record("ready", 0)
    hvd.elastic.run(loop)(state, heartbeat)
    if recovery:
        recovery.close()
    return trainer.finish(state.run)


def loop(state: ElasticPipeline, heartbeat: Heartbeat) -> None:
    """The body ``hvd.elastic.run`` re-enters after every reset (state.sync ran first)."""
    run, cfg = state.run, state.train
    data = run.job.train_data()
    faults = FaultPlan.from_env()
    balancer = Balancer(run, state.planner, base=list(state.costs.seconds))
    every = cfg.fixed_commit_every or 10
    entered = True
    while run.step < cfg.steps:
        faults.before_step(run.world, run.step, state.events)
        heartbeat.enter_collective(run.step, time.time())
        with translated():
            metrics = trainer.train_step(run, data)
            balancer.after_step(run, metrics)
        heartbeat.leave_collective(run.step)
        if entered:   # the end of a recovery: first step done in this world
            state.events.record("resumed", run.step, size=run.world.size, pp=run.plan.pp,
                                dp=run.plan.dp, step_time=metrics.step_time, loss=run.loss)
            entered = False
        for callback in run.on_metrics:
            callback(metrics.as_dict())
        trainer._report(run)
        changed = hosts_changed(state)
        state.gens = state.gens[:1]   # every rank got past its last commit: drop the one before
        if changed:
            state.commit(reason="membership")
            state.prepare_reset()
            raise HostsUpdatedInterrupt(False)   # never skip sync: the plan must change
        if run.step % every == 0 or run.step == cfg.steps:
            state.commit()
        if cfg.checkpoint_every and run.step % (every * cfg.checkpoint_every) == 0 \
                and run.step < cfg.steps:
            with translated():
                trainer.save_checkpoint(run)
    with translated():   # the final checkpoint, inside the elastic loop: a failure here restores
        trainer.save_checkpoint(run)


def hosts_changed(state: ElasticPipeline) -> bool:
    """Whether any rank heard of a host addition or removal since the last step."""
    update = 0
    while not state._host_messages.empty():
        timestamp, result = state._host_messages.get()
        if timestamp > state._last_updated_timestamp:
            state._last_updated_timestamp = timestamp
            update |= int(result)
    flag = torch.tensor([1.0 if update else 0.0])
    return hvd.allreduce(flag, op=hvd.Sum, name="regatta.pipe.hosts").item() > 0
