"""A worker's life, the same for every engine: init and re-init, the World, failure
detection, events and their sink, the commit policy, host updates, step reporting, host
samples, stragglers and stalls, the final checkpoint and the run's final status.

The engine (data parallel, pipeline) supplies only what differs: its state, one step and
the end of training (engine.py). ``train`` below is the one entry of every launch: one
process, ``mpirun``, ``horovodrun`` elastic (``hvd.elastic.run`` re-enters ``loop`` on reset).
"""
from __future__ import annotations

import json
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from horovod.common.exceptions import HostsUpdatedInterrupt
from tqdm import tqdm

from elastic.failures.recovery import FastRecovery
from elastic.failures.liveness import Heartbeat
from elastic.whole_files import replace_text

from .collectives import (Alone, HorovodCollectives, HorovodSettings, MpiCollectives,
                          start_horovod)
from .commit_policy import CommitPolicy
from .control import Pending
from .env import Env
from .checkpoint_records import Checkpoints
from .events import EventLog, Progress
from .memory import keep_freed_memory
from .registration import EarlyRegistration
from .reporting import HostSampler, StepReporter, memcpy_bandwidth, process_started
from .runs import code_revision, launcher_name, new_run_id, open_sink, resumed_run_id, run_row
from .torch_group import WorldGroup
from .world import World, share_cores

_current: "Runtime | None" = None   # the runtime of the training running in this process


def current() -> "Runtime":
    """The runtime of the training in progress (``regatta.log`` and ``context`` use it)."""
    if _current is None:
        raise RuntimeError("no training is running in this process: call regatta.log() and "
                           "regatta.context() from code that fit() or train() runs")
    return _current


def make_current(runtime: "Runtime | None") -> None:
    """The runtime ``current`` returns (a user's own loop sets it for its whole process)."""
    global _current
    _current = runtime


class Stopped(SystemExit):
    """Told to stop (SIGTERM: ``scancel``, a Slurm time limit's ``--signal``): every rank
    left after the same step, the state committed and checkpointed. Exits with 0."""

    def __init__(self, step: int):
        super().__init__(0)
        self.step = step


STOP_SIGNALS = (signal.SIGTERM,)


class Runtime:
    def __init__(self, env: Env, cfg, job: str, config: dict, callbacks: list | None = None):
        self.created = time.time()
        self.env, self.cfg, self.job, self.config = env, cfg, job, config
        self.keeps_freed_memory = env.keep_freed_memory and keep_freed_memory()
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.run_id = resumed_run_id(cfg) or new_run_id(job, env)
        self.sink = open_sink(cfg, env)
        self.world = World.launched(env)
        self.events = EventLog(self.run_dir, env.host, self.world.slot, sink=self.sink,
                               run_id=self.run_id)
        self.heartbeat = Heartbeat()
        self.recovery = FastRecovery(
            self.events, self.heartbeat, cfg.stall_after, committed_step=lambda: self.policy.last_commit_step,
            dies_recovering=lambda step: env.faults.dies_recovering(env.host, step),
            step_time=lambda: self.policy.step_time_s) \
            if env.elastic and env.fast_recovery else None
        self.policy = CommitPolicy(fixed=cfg.fixed_commit_every)
        self.reporter = StepReporter(self.sink, self.run_id, self.events, callbacks)
        self.collectives, self.hvd, self.engine = Alone(), None, None
        self.group = WorldGroup(env)   # this world's torch.distributed group, once one needs it
        self.sampler: HostSampler | None = None
        self.progress: Progress | None = None
        self.bar: tqdm | None = None
        self.commits = self.entries = 0    # commits made; entries into the training loop
        self.checkpoints = Checkpoints(self.events, cfg, self.run_id)
        self.state = None
        self.stop_signal = 0   # the signal that asked this process to stop, once one did

    # -- start and end -------------------------------------------------------------------
    def init(self, engine) -> None:
        """Initialise the world the engine runs on (Horovod, MPI or one process)."""
        self.engine = engine   # the driver's registration overlaps hvd.init (registration.py)
        self.registration = EarlyRegistration() if engine.uses_horovod and self.env.elastic else None
        if self.recovery:
            self.recovery.before_init()
        started, horovod = time.time(), HorovodSettings()
        if engine.uses_horovod:
            hvd, horovod = start_horovod(self.cfg, self.env)
            self.hvd, self.collectives = hvd, HorovodCollectives(hvd)
            self.world = World.from_horovod(hvd, self.env.host)
        elif self.world.size > 1:
            self.collectives = MpiCollectives()
        share_cores(self.world, self.env)
        self.events.rank = self.world.rank
        if self.world.is_root:   # before any row of the run: the store takes none without it
            self.sink.emit(run_row(self.run_id, self.job, "running", config=self.config,
                                   launcher=launcher_name(self.env), code_revision=code_revision()))
        self.events.record("start", None, size=self.world.size, elastic=self.env.elastic,
                           engine=engine.name, fast_recovery=bool(self.recovery),
                           process_created=process_started(), runtime_created=self.created,
                           init_started=started, horovod_cycle_ms=horovod.cycle_ms,
                           horovod_wakes=horovod.wakes, horovod_fusion_bytes=horovod.fusion_bytes,
                           keeps_freed_memory=self.keeps_freed_memory)
        self.sampler = HostSampler(self.sink, self.run_id, self.world.host, self.world.slot)
        self._listen_for_stop()
        if self.world.is_root and not self.env.replacing:   # once a run: 0.2 s of a recovery
            self.events.record("calibration", None, memcpy_bytes_per_s=memcpy_bandwidth())

    def _listen_for_stop(self) -> None:
        """A stop signal only marks the wish: it rides the next step's agreement, so every
        rank stops after the same step (one rank's signal stops them all)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._told_to_stop)

    def _told_to_stop(self, signum, frame) -> None:
        self.stop_signal = signum

    @property
    def step(self) -> int:
        return self.state.step if self.state is not None else 0

    @contextmanager
    def running(self):
        """The run's final status, whatever happens: finished, or failed with the error."""
        global _current
        _current = self
        try:
            yield self
        except Stopped:
            raise
        except BaseException as err:
            self.failed(err)
            raise
        finally:
            _current = None
            self.close()

    def failed(self, err: BaseException) -> None:
        """The run's final status: failed, with the error (an interrupt is no failure)."""
        if self.world.is_root and not isinstance(err, KeyboardInterrupt):
            message = f"{type(err).__name__}: {err}"[:2000]
            self.events.record("run_failed", None, error=message)
            self.sink.emit(run_row(self.run_id, self.job, "failed", finished_at=time.time(),
                                   error=message))

    def close(self) -> None:
        self.wait_for_checkpoint()
        if self.recovery:
            self.recovery.close()
        if self.sampler:
            self.sampler.stop()
        if self.bar is not None:
            self.bar.close()
        self.events.close()
        self.sink.close()

    # -- the loop ------------------------------------------------------------------------
    def run(self, state, loop=None):
        """Run ``loop(state)`` (the engine's: train until ``train.steps``), surviving resets
        under horovodrun elastic; what it returns."""
        loop = loop or self.loop
        self.events.record("ready", state.step, registration_s=self.registration and self.registration.wait(),
                           **self.engine.settings())
        if not self.env.elastic:
            state.sync()
            return loop(state)
        try:
            return self.hvd.elastic.run(loop)(state)
        except ValueError:   # hvd.init's "initialization failed" (it has no type of its own)
            if self.recovery and not self.hvd.is_initialized():
                self.recovery.init_failed()   # replaced with its hand-off: does not return
            raise

    def loop(self, state) -> None:
        """The body ``hvd.elastic.run`` re-enters after every reset (sync ran first)."""
        self.enter(state)
        entered = True
        while state.step < self.cfg.steps:
            self.env.faults.before_step(self.world, state.step, self.events)
            started = time.perf_counter()
            with self.heartbeat.collective(state):
                row, agreed = self.engine.step(state, self.pending(state))
            if entered:   # the end of a recovery: first step done in this world
                self.events.record("resumed", state.step, size=self.world.size,
                                   step_time=time.perf_counter() - started)
                entered = False
            self.after_step(state, row, agreed)
            if agreed.stop:
                self.stop(state, agreed.loss)
            if agreed.host_update:
                self.commit(state, "membership", agreed.loss)
                state.prepare_reset()
                raise HostsUpdatedInterrupt(agreed.removed_only and not self.engine.replans)
            if agreed.commit or state.step == self.cfg.steps:
                self.commit(state, "periodic", agreed.loss, checkpoint=agreed.checkpoint)
        if state.step == self.cfg.steps:   # inside the elastic loop: a failure here restores
            self.checkpoint(state)

    def enter(self, state) -> None:
        self.entries += 1
        self.policy.entered(state.step)
        self.reporter.on_enter(self.world, self.collectives, state)
        self.engine.enter(state)
        if self.recovery:
            self.recovery.enter(self.world, self.collectives.allgather_object)

    def pending(self, state) -> Pending:
        """Host flags from Horovod's driver and rank 0's commit vote for this step."""
        vote = 0
        if self.world.is_root and self.policy.due(state.step + 1):
            every = self.cfg.checkpoint_every
            vote = 2 if every and (self.commits + 1) % every == 0 else 1
        return Pending(host_update=state.take_host_updates(), commit_vote=vote,
                       stop=bool(self.stop_signal))

    def after_step(self, state, row, agreed) -> None:
        record = self.reporter.on_step(self.world, state.step, row, agreed,
                                       self.engine.straggler_groups(state))
        self.policy.observe_step(row.step_time)
        if self.world.is_root:
            self._show_progress(state, record)
            every = self.cfg.eval_every
            if every and state.step % every == 0 and state.step < self.cfg.steps:
                self.log({f"eval/{k}": v for k, v in self.engine.evaluate(state).items()}, state.step)

    def _show_progress(self, state, record: dict) -> None:
        self.progress = self.progress or Progress(self.run_dir)
        self.progress.update(state.step, self.world.size)
        if self.cfg.progress:
            if self.bar is None:
                self.bar = tqdm(total=self.cfg.steps, initial=state.step, desc=self.job,
                                unit="step", dynamic_ncols=True)
            self.bar.n = state.step
            loss = record.get("loss")
            self.bar.set_postfix(loss="-" if loss is None else f"{loss:.4f}", np=self.world.size,
                                 refresh=False)
            self.bar.update(0)

    def log(self, values: dict, step: int | None = None) -> None:
        """Custom scalars from user code on any rank: one ``metric`` row each."""
        now = time.time()
        for name, value in values.items():
            self.sink.emit({"type": "metric", "run_id": self.run_id, "name": name, "step": step,
                            "value": float(value.item() if torch.is_tensor(value) else value),
                            "rank": self.world.rank, "host": self.world.host, "wall_time": now})

    # -- commits and checkpoints ---------------------------------------------------------
    def commit(self, state, reason: str, loss: float | None = None, checkpoint: bool = False) -> None:
        """Commit, record what it cost, let the policy re-choose the interval."""
        started = time.perf_counter()
        detail = state.save() or {}
        cost = time.perf_counter() - started
        self.commits += 1
        if detail.get("durable") and detail.get("path"):   # a fixed world commits to disk
            self.checkpoints.mark()
        audit = {}
        try:
            audit = self.audit(state)
        finally:    # a failure cutting the audit's collective short does not unmake the commit
            self.events.record("commit", state.step, reason=reason, cost_s=cost, loss=loss,
                               **detail, **audit)
        interval = self.policy.observe_commit(state.step, cost)
        if interval is not None and self.world.is_root:
            p = self.policy
            self.events.record("commit_interval", state.step, interval=interval,
                               commit_cost_s=p.commit_cost_s, step_time_s=p.step_time_s,
                               mtbf_s=p.mtbf_s(), failures=p.failures,
                               mtbr_s=p.mtbr_s(), rollbacks=p.rollbacks)
        if checkpoint:
            self.checkpoint(state)

    def stop(self, state, loss: float | None = None) -> None:
        """Every rank agreed to stop after this step: commit, put the state on disk (rank
        0, waited for), mark the run stopped, leave with :class:`Stopped`."""
        self.commit(state, "stopped", loss, checkpoint=True)
        self.wait_for_checkpoint()
        self.events.record("run_stopped", state.step, signal=self.stop_signal or None,
                           size=self.world.size)
        if self.world.is_root:
            self.sink.emit(run_row(self.run_id, self.job, "stopped", finished_at=time.time()))
        raise Stopped(state.step)

    def checkpoint(self, state) -> None:
        self.checkpoints.write(state)

    @property
    def writing(self):
        """The durable checkpoint still being written in the background, if any."""
        return self.checkpoints.writing

    def wait_for_checkpoint(self) -> None:
        self.checkpoints.wait()

    def resumed(self, state, detail: dict | None) -> None:
        """The state was loaded from the checkpoint folder (``train.resume``)."""
        self.checkpoints.resumed(state, detail)

    def audit(self, state) -> dict:
        digest = state.audit_hash() if self.env.audit else None
        if isinstance(digest, dict):
            return digest
        return {} if digest is None else {"param_hash": digest}

    # -- what the state tells the runtime (state.py) ---------------------------------------
    def new_world(self) -> None:
        if self.recovery:
            self.recovery.initialised()
        if self.hvd is not None:
            self.world = World.from_horovod(self.hvd, self.env.host, generation=self.entries)
            self.events.rank = self.world.rank

    def world_broken(self) -> bool:
        """Whether a peer of the current world was seen dying (fast recovery only): an
        engine abandons the step it is computing, which cannot complete."""
        return self.recovery is not None and self.recovery.world_broken()

    def before_reset(self) -> None:
        """Membership is about to change: lifelines must not call it a death, and this
        world's group goes with it."""
        self.group.close()
        if self.recovery:
            self.recovery.before_init()

    def restored(self, state, failed_at: int) -> None:
        self.policy.observe_failure()
        self.events.record("restore", state.step, from_step=failed_at,
                           steps_redone=failed_at - state.step, **self.audit(state))

    def was_reset(self, state) -> None:
        size = self.hvd.size() if self.hvd is not None else self.world.size
        self.events.rank = self.hvd.rank() if self.hvd is not None else self.world.rank
        self.events.record("reset", state.step, size_before=self.world.size, size_after=size,
                           rank_before=self.world.rank)

    def synced(self, state, cost: float, detail: dict | None = None) -> None:
        detail = detail or {}
        self.events.record("sync", state.step, cost_s=cost, size=self.world.size,
                           **detail, **self.audit(state))
        if state.restored_from is not None:
            self.policy.observe_recovery(detail.get("recovery"))
        if detail.get("recovery") and self.entries:   # which state a re-forming went on from
            failed_at = state.restored_from
            self.events.record(detail["recovery"], state.step, cost_s=cost, size=self.world.size,
                               moved_bytes=detail.get("moved_bytes", 0), from_step=failed_at,
                               steps_redone=0 if failed_at is None else max(0, failed_at - state.step))

    # -- the end -------------------------------------------------------------------------
    def finish(self, state) -> dict:
        """The engine's result, written where launchers and tests look for it."""
        self.wait_for_checkpoint()     # the final checkpoint is on disk before any result
        mine, result = self.engine.finish(state)
        self.group.close()
        folder = self.run_dir / "final"
        folder.mkdir(exist_ok=True)
        replace_text(folder / f"{self.world.host}-{self.world.slot}.json", json.dumps(mine))
        if self.world.is_root:
            replace_text(self.run_dir / "result.json", json.dumps(result, indent=1))
            self.sink.emit(run_row(self.run_id, self.job, "finished", finished_at=time.time()))
        self.events.record("finish", state.step, size=self.world.size, **result.get("metrics", {}))
        return result if self.world.is_root else mine


def train(engine, cfg, job: str, config: dict, env: Env | None = None,
          callbacks: list | None = None) -> dict:
    """Run ``engine`` to ``cfg.steps`` on whatever world the launcher made."""
    runtime = Runtime(env or Env.read(), cfg, job, config, callbacks)
    with runtime.running():
        runtime.init(engine)
        state = runtime.state = engine.build(runtime)
        if runtime.recovery:   # a worker restarted in place resumes its predecessor's commit
            runtime.recovery.adopt(state)
        runtime.run(state)
        return runtime.finish(state)


