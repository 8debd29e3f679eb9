"""Horovod's ``TorchState`` for a user's own loop, on the data-parallel engine's state.

    state = hvd.elastic.TorchState(model, optimizer, epoch=1, batch=0)

Everything the data-parallel state does is kept (dataparallel/state.py): commits held in
shares in host memory, survivors going on from their live state, newcomers receiving it
striped over the survivors, the durable checkpoint written in the background. What
differs is where the step boundary comes from: the user's ``state.commit()``.

* A ``commit()`` is a step boundary, as in Horovod: the state is consistent there. It
  counts the step (``state.step``), reports the step's row (times, samples, bytes) and
  remembers the plain attributes (``epoch``, ``batch``) and small objects (a sampler, a
  scheduler) as they are. It snapshots the tensors only when the runtime's commit policy
  says so (``train.commit_every``, or ``auto``) or the membership changes: the live state
  is what a failure goes on from.
* A failure before this rank's optimizer applied the step leaves its model and optimizer
  at the boundary: the attributes go back to the boundary's values and the survivors go
  on from there, nothing restored. After an update the boundary has not reached, this
  rank's live state is not a boundary's: it rolls back to the commit (or receives the
  live state of a survivor that has it).
* Host updates and rank 0's commit vote travel in the optimizer's gradient reduction
  (optimizer.py); a commit with no optimizer step before it agrees on them in a small
  collective of its own, as Horovod's ``check_host_updates`` broadcasts.

Horovod's names that Regatta uses itself (``step``, ``cursor``, ...) cannot be attributes;
naming one is refused with the reason.
"""
from __future__ import annotations

import copy
import time

import torch
from horovod.common.exceptions import HostsUpdatedInterrupt
from torch import nn

from elastic.dataparallel import live
from elastic.dataparallel.state import TrainState
from elastic.runtime.control import Agreed, agree
from elastic.runtime.reporting import StepRow

OWN_NAMES = {"cursor", "objects", "runtime", "every_module"}   # beyond the class's attributes


class Marks:
    """The state's plain attributes and small objects as they were at the last boundary:
    committed with the tensors, put back after a failure."""

    def __init__(self, owner, names: list[str]):
        self._owner, self._names, self._values = owner, names, {}

    def mark(self) -> None:
        self._values = {name: _kept(getattr(self._owner, name)) for name in self._names}

    def put_back(self) -> None:
        for name, value in self._values.items():
            current = getattr(self._owner, name)
            if _has_state(current):
                current.load_state_dict(copy.deepcopy(value))   # a sampler re-partitions here
            else:
                object.__setattr__(self._owner, name, copy.deepcopy(value))

    def state_dict(self) -> dict:
        return dict(self._values)

    def load_state_dict(self, values: dict) -> None:
        self._values = {name: values[name] for name in self._names}
        self.put_back()


def _has_state(value) -> bool:
    return hasattr(value, "state_dict") and hasattr(value, "load_state_dict")


def _kept(value):
    return copy.deepcopy(value.state_dict() if _has_state(value) else value)


def _placeholder_optimizer() -> torch.optim.Optimizer:
    """For a state without an optimizer (ObjectState, ``optimizer=None``)."""
    return torch.optim.SGD([nn.Parameter(torch.zeros(0))], lr=0.0)


class TorchState(TrainState):
    def __init__(self, model=None, optimizer=None, **kwargs):
        from .session import current
        session = current()
        clash = sorted(n for n in kwargs if n.startswith("_") or n in OWN_NAMES or hasattr(TorchState, n))
        if clash:
            raise TypeError(f"TorchState({', '.join(clash)}=...): Regatta's state uses "
                            f"{'these names' if len(clash) > 1 else 'this name'} itself "
                            f"(step counts the commits); give the attribute another name")
        tensors = {"model": model if model is not None else nn.Module(),
                   "optimizer": optimizer if optimizer is not None else _placeholder_optimizer()}
        tensors.update({k: v for k, v in kwargs.items() if isinstance(v, (nn.Module, torch.optim.Optimizer))})
        plain = {k: v for k, v in kwargs.items() if k not in tensors}
        for name, value in kwargs.items():
            object.__setattr__(self, name, value)
        self._marks = Marks(self, list(plain))
        self._marks.mark()
        super().__init__(session.runtime, {**tensors, "attributes": self._marks}, session.cfg.checkpoint_path)
        self.every_module = nn.ModuleList([v for v in tensors.values() if isinstance(v, nn.Module)])
        self.forward_buffers = live.BufferStash(self.every_module)
        self._trains = optimizer is not None   # else the optimizer is a placeholder (no lr)
        self._moved = False              # an optimizer applied an update since the boundary
        self._flags = (0, False, False, False)  # host updates, commit, checkpoint, stop agreed since it
        self._last: Agreed | None = None
        self._measured = {"work": 0.0, "comm": 0.0, "wait": 0.0, "bytes": 0, "overlap": None}
        self._samples, self._boundary_at, self._entered = 0, time.perf_counter(), False
        self.model.register_forward_pre_hook(self._count_samples)
        for value in tensors.values():
            if hasattr(value, "attach"):
                value.attach(self)
        session.adopt(self)

    # -- what the optimizer tells it -------------------------------------------------------
    def work_seconds(self, now: float) -> float:
        return now - self._boundary_at - self._measured["comm"]

    def reduced(self, reduced, seconds: float) -> None:
        agreed, m = reduced.agreed, self._measured
        wait = agreed.wait_s(self.runtime.world.rank)
        m["work"] = self.work_seconds(time.perf_counter() - seconds)
        m["comm"] += max(0.0, seconds - wait)
        m["wait"] += wait
        m["bytes"] += reduced.nbytes
        m["overlap"] = reduced.overlap
        self._agreed(agreed)

    def applied(self) -> None:
        self._moved = True

    def _agreed(self, agreed: Agreed) -> None:
        host, commit, checkpoint, stop = self._flags
        self._flags = (host | agreed.host_update, commit or agreed.commit,
                       checkpoint or agreed.checkpoint, stop or agreed.stop)
        self._last = agreed

    def _count_samples(self, module, args) -> None:
        if module.training and args and torch.is_tensor(args[0]) and args[0].dim():
            self._samples += int(args[0].shape[0])

    # -- Horovod's state API -----------------------------------------------------------------
    def commit(self) -> None:
        """A step boundary: count it, report it, commit when due, leave for new hosts."""
        if self._last is None:
            self._agree_alone()
        host, commit, checkpoint, stop = self._flags
        self._boundary()
        if stop:
            self.runtime.stop(self)
        if host:
            self.runtime.commit(self, "membership")
            self.prepare_reset()
            raise HostsUpdatedInterrupt(False)
        if commit:
            self.runtime.commit(self, "periodic", checkpoint=checkpoint)

    def check_host_updates(self) -> None:
        """Horovod's: raise ``HostsUpdatedInterrupt`` on every rank at once when the
        driver announced new or lost hosts (one small collective)."""
        self._agree_alone()
        if self._flags[0]:
            self._flags = (0, *self._flags[1:])
            if not self._moved:
                self.runtime.commit(self, "membership")
            self.prepare_reset()
            raise HostsUpdatedInterrupt(False)

    def _agree_alone(self) -> None:
        runtime, world = self.runtime, self.runtime.world
        control = runtime.pending(self).control(0.0, 1, self.work_seconds(time.perf_counter()))
        with runtime.heartbeat.collective(self):
            self._agreed(agree(control, world.rank, world.size, runtime.collectives.allreduce_sum))

    def _boundary(self) -> None:
        now, m = time.perf_counter(), self._measured
        self.step += 1
        self._marks.mark()
        self.forward_buffers.keep()
        lr = self.optimizer.param_groups[0]["lr"] if self._trains else None
        row = StepRow(step_time=now - self._boundary_at, compute_time=m["work"], comm_time=m["comm"],
                      wait_time=m["wait"], samples=self._samples, bytes_sent=m["bytes"], lr=lr,
                      overlap=m["overlap"])
        self.runtime.after_step(self, row, self._last)
        if self._entered:   # the end of a recovery: first step done in this world
            self.runtime.events.record("resumed", self.step, size=self.runtime.world.size,
                                       step_time=row.step_time)
            self._entered = False
        self._since_boundary(now)
        self.runtime.env.faults.before_step(self.runtime.world, self.step, self.runtime.events)

    def _since_boundary(self, now: float) -> None:
        self._moved, self._flags, self._last, self._samples = False, (0, False, False, False), None, 0
        self._measured = {"work": 0.0, "comm": 0.0, "wait": 0.0, "bytes": 0, "overlap": None}
        self._boundary_at = now

    def entered(self) -> None:
        """The loop is (re-)entered in a new world: its first boundary ends the recovery."""
        self._entered = True
        self._since_boundary(time.perf_counter())

    # -- the data-parallel state, where the boundary changes it ------------------------------
    def restore_committed(self) -> None:
        if self._moved:
            self._live = False    # an update the boundary has not reached: not a live state
        super().restore_committed()
        self._marks.put_back()
        self._since_boundary(time.perf_counter())

    def sync_state(self) -> dict:
        detail = super().sync_state()
        self._marks.put_back()    # an ElasticSampler re-partitions for this world's ranks
        self.forward_buffers.keep()
        return detail


class ObjectState(TorchState):
    """Horovod's state of plain attributes; its broadcast and rank functions are
    Regatta's runtime's, so the two given are not used."""

    def __init__(self, bcast_object=None, get_rank=None, **kwargs):
        super().__init__(None, None, **kwargs)
