"""Elastic data-parallel training on Horovod.

Each step every rank computes the summed loss of its share of the global batch, then one
fused allreduce carries the gradients, the loss, the sample count and the host-update
flags; gradients are divided by the global count, so any split of the batch (uneven
shares, a new world size) gives the combined batch's mean gradient. Carrying the host
flags in that allreduce lets workers react to an added host at the very next step without
the extra broadcast Horovod's ``check_host_updates`` costs.

Launched by ``horovodrun`` (elastic), ``mpirun`` (fixed world) or as one process; see
jobs/*.py for the commands.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import horovod.torch as hvd
import torch
from horovod.common.exceptions import HostsUpdatedInterrupt
from horovod.runner.elastic.worker import HostUpdateResult
from tqdm import tqdm

from .commit_policy import CommitPolicy
from .config import TrainConfig
from .events import EventLog
from .faults import FaultPlan
from .job import Job
from .liveness import Heartbeat
from .sampler import global_batch, rank_share
from .state import TrainState
from .world import World


@dataclass
class StepStats:
    loss: float
    samples: int
    data_time: float
    compute_time: float
    comm_time: float
    wait_time: float
    step_time: float
    bytes_sent: int
    host_update: int = 0   # HostUpdateResult flags agreed by all ranks
    arrivals: list = field(default_factory=list)   # every rank's data+compute seconds
    commit: bool = False   # every rank commits after this step (rank 0's vote)


@dataclass
class Session:
    """What the loop needs besides the state; ``world`` is replaced on every reset."""
    job: Job
    cfg: TrainConfig
    data: tuple
    events: EventLog
    faults: FaultPlan
    world: World
    on_enter: list = field(default_factory=list)  # callbacks(session, state) on every (re)entry
    on_step: list = field(default_factory=list)   # callbacks(session, state, stats)
    bar: tqdm | None = None
    heartbeat: Heartbeat = field(default_factory=Heartbeat)   # what lifelines announce
    commits: CommitPolicy = field(default_factory=lambda: CommitPolicy(fixed=10))
    entries: int = 0        # times this process entered the loop (1 + resets it lived through)


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=cfg.lr)


def drain_host_updates(state: TrainState) -> int:
    """Host-change notifications Horovod's driver sent this rank since the last step."""
    update = HostUpdateResult.no_update
    while not state._host_messages.empty():
        timestamp, result = state._host_messages.get()
        if timestamp > state._last_updated_timestamp:
            state._last_updated_timestamp = timestamp
            update |= result
    if update and state.interrupted_at is None:
        state.interrupted_at = time.time()
    return int(update)


HEADER = 5   # loss, count, removed, added, commit vote; then one arrival time per rank


@dataclass
class Reduced:
    loss: float           # mean loss over the global batch
    count: int            # samples (or tokens) in the global batch
    host_update: int      # HostUpdateResult flags any rank received
    commit: bool          # rank 0 voted to commit after this step
    nbytes: int           # payload of the allreduce
    arrivals: list        # seconds each rank took from step start to the allreduce


def allreduce_step(model, loss_sum: float, count: int, host_update: int, arrival: float,
                   world: World, commit_vote: bool = False) -> Reduced:
    """Sum gradients, loss, count, host flags, rank 0's commit vote and per-rank arrival
    times in one fused allreduce and leave mean gradients in ``.grad``."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    extras = torch.zeros(HEADER + world.size)
    extras[:HEADER] = torch.tensor([loss_sum, float(count),
                                    float(host_update & HostUpdateResult.removed),
                                    float(host_update & HostUpdateResult.added), float(commit_vote)])
    extras[HEADER + world.rank] = arrival
    flat = torch.cat([g.reshape(-1) for g in grads] + [extras])
    if world.size > 1:
        hvd.allreduce_(flat, op=hvd.Sum, name="regatta.step")
    tail = flat[-len(extras):].tolist()
    total = int(round(tail[1]))
    flat[:-len(extras)].div_(max(total, 1))
    offset = 0
    for param, grad in zip(params, grads):
        param.grad = flat[offset:offset + grad.numel()].view_as(grad)
        offset += grad.numel()
    flags = (HostUpdateResult.removed if tail[2] > 0 else 0) | \
            (HostUpdateResult.added if tail[3] > 0 else 0)
    return Reduced(loss=tail[0] / max(total, 1), count=total, host_update=int(flags),
                   commit=tail[4] > 0, nbytes=flat.numel() * flat.element_size(),
                   arrivals=tail[HEADER:])


def train_step(state: TrainState, session: Session) -> StepStats:
    cfg, world, job = session.cfg, session.world, session.job
    started = time.perf_counter()
    dataset_size = len(session.data[0])
    step_indices = global_batch(state.cursor, dataset_size, cfg.global_batch, cfg.seed)
    indices = rank_share(step_indices, world.rank, world.size)
    batch = tuple(t[indices] for t in session.data)
    # Dropout and other randomness replay identically after a restore.
    torch.manual_seed(cfg.seed * 1_000_003 + state.step * 1009 + world.rank)
    data_done = time.perf_counter()

    state.model.train()
    state.optimizer.zero_grad(set_to_none=True)
    if len(indices):
        loss_sum, count = job.loss_sum(state.model, batch)
        loss_sum.backward()
        loss_value = loss_sum.item()
    else:
        loss_value, count = 0.0, 0
    session.faults.after_compute(world, state.step, data_done)
    compute_done = time.perf_counter()

    session.heartbeat.enter_collective(state.step, time.time())
    vote = world.is_root and session.commits.due(state.step + 1)
    reduced = allreduce_step(state.model, loss_value, count, drain_host_updates(state),
                             compute_done - started, world, commit_vote=vote)
    session.heartbeat.leave_collective(state.step + 1)
    comm_done = time.perf_counter()
    state.optimizer.step()
    state.cursor = state.cursor.advance(len(step_indices), dataset_size)
    state.step += 1
    # Time in the allreduce spent waiting for the last rank to arrive is wait, not comm.
    wait = max(0.0, max(reduced.arrivals) - (compute_done - started))
    return StepStats(loss=reduced.loss, samples=len(indices), data_time=data_done - started,
                     compute_time=compute_done - data_done,
                     comm_time=max(0.0, comm_done - compute_done - wait), wait_time=wait,
                     step_time=time.perf_counter() - started, bytes_sent=reduced.nbytes,
                     host_update=reduced.host_update, arrivals=reduced.arrivals,
                     commit=reduced.commit)


def train_loop(state: TrainState, session: Session) -> None:
    """The body ``hvd.elastic.run`` re-enters after every reset."""
    cfg = session.cfg
    session.entries += 1
    session.commits.entered(state.step)
    for callback in session.on_enter:
        callback(session, state)
    entered = True
    while state.step < cfg.steps:
        session.faults.before_step(session.world, state.step, session.events)
        stats = train_step(state, session)
        if entered:   # the end of a recovery: first step done in this world
            session.events.record("resumed", state.step, size=session.world.size,
                                  step_time=stats.step_time)
            entered = False
        for callback in session.on_step:
            callback(session, state, stats)
        session.commits.observe_step(stats.step_time)
        if stats.host_update:
            commit(state, session, "membership", stats.loss)
            state.before_reset()
            raise HostsUpdatedInterrupt(stats.host_update == HostUpdateResult.removed)
        if stats.commit or state.step == cfg.steps:
            commit(state, session, "periodic", stats.loss)


def commit(state: TrainState, session: Session, reason: str, loss: float) -> None:
    """Commit, and let the policy re-choose the interval from what the commit cost."""
    cost = state.commit(reason=reason, loss=loss)
    interval = session.commits.observe_commit(state.step, cost)
    if interval is not None and session.world.is_root:
        policy = session.commits
        session.events.record("commit_interval", state.step, interval=interval,
                              commit_cost_s=policy.commit_cost_s, step_time_s=policy.step_time_s,
                              mtbf_s=policy.mtbf_s(), failures=policy.failures)
