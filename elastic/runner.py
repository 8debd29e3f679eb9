"""Run one job to completion on whatever world the launcher made.

The same entry serves ``horovodrun`` elastic (``hvd.elastic.run`` re-enters the loop after
every reset), ``mpirun`` (a fixed world) and a single process.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path

import horovod.torch as hvd
import psutil
import torch
from tqdm import tqdm

from .commit_policy import CommitPolicy
from .config import TrainConfig
from .checkpoint import parameter_hash
from .dataparallel import Session, make_optimizer, train_loop
from .events import EventLog, Progress
from .faults import FaultPlan
from .job import Job
from .state import TrainState
from .lifeline import FastRecovery
from .liveness import Heartbeat
from .metrics import StepReporter, memcpy_bandwidth, open_sink, run_id_for, run_row
from .world import World, launched_elastic, launcher_host_name, share_cores


def run(job: Job, cfg: TrainConfig, on_step: list | None = None) -> dict:
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    sink, run_id = open_sink(cfg), run_id_for(job.name, cfg.run_dir)
    events = EventLog(run_dir, launcher_host_name(), int(os.environ.get("HOROVOD_LOCAL_RANK", 0)),
                      sink=sink, run_id=run_id)
    elastic = launched_elastic()
    heartbeat = Heartbeat()
    recovery = FastRecovery(events, heartbeat, cfg.stall_after) \
        if elastic and os.environ.get("REGATTA_FAST_RECOVERY", "1") == "1" else None
    if recovery:
        recovery.before_init()
    init_started = time.time()
    hvd.init()
    world = World.from_horovod(hvd)
    share_cores(world)
    events.rank = world.rank
    events.record("start", None, size=world.size, elastic=elastic, fast_recovery=bool(recovery),
                  process_created=psutil.Process().create_time(), init_started=init_started)

    torch.manual_seed(cfg.seed)   # identical initial weights everywhere, before any sync
    model = job.build_model()
    state = TrainState(model, make_optimizer(model, cfg), events=events,
                       checkpoint_path=cfg.checkpoint_path,
                       checkpoint_every=cfg.checkpoint_every)
    if world.is_root:
        state.resume_from_checkpoint()
    session = Session(job=job, cfg=cfg, data=job.train_data(), events=events,
                      faults=FaultPlan.from_env(), world=world, on_step=list(on_step or []),
                      heartbeat=heartbeat, commits=CommitPolicy(fixed=cfg.fixed_commit_every))
    state.restore_hooks.append(session.commits.observe_failure)
    session.on_step.append(_progress_reporter(run_dir, cfg))
    session.on_enter.append(_rebuild_world)
    reporter = StepReporter(sink, run_id, world.host)
    session.on_enter.append(lambda session, state: reporter.on_enter(session, state, hvd))
    session.on_step.append(reporter.on_step)
    if world.is_root:
        events.record("calibration", None, memcpy_bytes_per_s=memcpy_bandwidth())
        sink.emit(run_row(run_id, job.name, "running", config=asdict(cfg),
                          launcher="horovodrun" if elastic else ("mpirun" if world.size > 1 else "local")))
    if recovery:
        state.before_reset_hooks.append(recovery.before_init)
        session.on_enter.append(lambda session, state: recovery.enter(hvd, session.world))

    def on_reset() -> None:
        events.rank = hvd.rank()
        events.record("reset", state.step, size_before=session.world.size, size_after=hvd.size(),
                      rank_before=session.world.rank)

    state.register_reset_callbacks([on_reset])
    events.record("ready", state.step)
    if elastic:
        hvd.elastic.run(train_loop)(state, session)
    else:
        state.sync()
        train_loop(state, session)
    if recovery:
        recovery.close()
    result = finish(state, session)
    reporter.close()
    if session.world.is_root:
        sink.emit(run_row(run_id, job.name, "finished", finished_at=time.time()))
    sink.close()
    return result


def _rebuild_world(session: Session, state: TrainState) -> None:
    """A new immutable World for this generation, before anything uses rank or size."""
    session.world = World.from_horovod(hvd, generation=session.entries - 1)
    session.events.rank = session.world.rank


def finish(state: TrainState, session: Session) -> dict:
    """Evaluate, record the outcome and this rank's parameter hash."""
    world, run_dir = session.world, Path(session.cfg.run_dir)
    if session.bar is not None:
        session.bar.close()
    result = {"host": world.host, "slot": world.slot, "rank": world.rank,
              "world_size": world.size, "step": state.step,
              "param_hash": parameter_hash(state.model), "wall_time": time.time()}
    if world.is_root:
        state.write_checkpoint()
        result["metrics"] = session.job.evaluate(state.model)
        (run_dir / "result.json").write_text(json.dumps(result, indent=1))
    (run_dir / "final").mkdir(exist_ok=True)
    (run_dir / "final" / f"{world.host}-{world.slot}.json").write_text(json.dumps(result))
    session.events.record("finish", state.step, size=world.size, **result.get("metrics", {}))
    session.events.close()
    return result


def _progress_reporter(run_dir: Path, cfg: TrainConfig):
    """Rank 0 keeps a tqdm bar and the step counter the launcher polls."""
    progress = None

    def report(session: Session, state: TrainState, stats) -> None:
        nonlocal progress
        if not session.world.is_root:
            return
        if progress is None:
            progress = Progress(run_dir)
        progress.update(state.step, session.world.size)
        if cfg.progress:
            if session.bar is None:
                session.bar = tqdm(total=cfg.steps, initial=state.step, desc=session.job.name,
                                   unit="step", dynamic_ncols=True)
            session.bar.n = state.step
            session.bar.set_postfix(loss=f"{stats.loss:.4f}", np=session.world.size,
                                    refresh=False)
            session.bar.update(0)
    return report
