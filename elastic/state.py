"""Training state under Horovod's elastic contract: commit, restore, sync, reset.

``TrainState`` extends ``hvd.elastic.TorchState`` (model, optimizer) with the step and the
sampler cursor. Three things differ from stock Horovod, each on purpose:

* ``sync()`` ends with a commit, so a worker that just joined can restore to the synced
  state (stock Horovod leaves its snapshot at its random initialisation).
* ``restore()`` drops every gradient, so nothing computed before a failure is applied.
* every ``checkpoint_every``-th commit is also written to disk, atomically, by rank 0.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import horovod.torch as hvd

from . import checkpoint
from .events import EventLog
from .sampler import Cursor


class TrainState(hvd.elastic.TorchState):
    def __init__(self, model, optimizer, *, events: EventLog, checkpoint_path: Path,
                 checkpoint_every: int):
        self._events = events
        self._checkpoint_path = checkpoint_path
        self._checkpoint_every = checkpoint_every
        self._commits = 0
        self._checkpointed_step: int | None = None   # the final commit may have written it
        # Tests and audits ask for a parameter hash on every commit, restore and sync.
        self._audit = os.environ.get("REGATTA_AUDIT") == "1"
        self.before_reset_hooks: list = []   # run before Horovod re-initialises
        self.restore_hooks: list = []        # run after a failure's restore
        self.restored_from: int | None = None  # step a failure interrupted, until re-entry
        self.interrupted_at: float | None = None  # when this membership change was noticed
        super().__init__(model=model, optimizer=optimizer, step=0, epoch=0, consumed=0)

    # -- the sampler cursor lives in two plain attributes so ObjectState can sync them
    @property
    def cursor(self) -> Cursor:
        return Cursor(self.epoch, self.consumed)

    @cursor.setter
    def cursor(self, value: Cursor) -> None:
        self.epoch, self.consumed = value.epoch, value.consumed

    def _audit_fields(self) -> dict:
        if not self._audit:
            return {}
        return {"param_hash": checkpoint.parameter_hash(self.model)}

    def commit(self, reason: str = "periodic", loss: float | None = None) -> float:
        """Snapshot in memory (and to disk every N commits). Host updates are checked in
        the training step's own allreduce, so unlike Horovod's commit this is local."""
        started = time.perf_counter()
        self.save()
        self._commits += 1
        cost = time.perf_counter() - started
        self._events.record("commit", self.step, reason=reason, cost_s=cost, loss=loss,
                            epoch=self.epoch, consumed=self.consumed, **self._audit_fields())
        if self._checkpoint_every and self._commits % self._checkpoint_every == 0:
            self.write_checkpoint()
        return cost

    def before_reset(self) -> None:
        for hook in self.before_reset_hooks:
            hook()

    def restore(self) -> None:
        """Called by ``hvd.elastic.run`` after a failed collective, before the reset."""
        self.before_reset()
        self.interrupted_at = self.interrupted_at or time.time()
        failed_at = self.restored_from = self.step
        super().restore()
        self.optimizer.zero_grad(set_to_none=True)
        self._events.record("restore", self.step, from_step=failed_at,
                            steps_redone=failed_at - self.step, **self._audit_fields())
        for hook in self.restore_hooks:
            hook()

    def sync(self) -> None:
        started = time.perf_counter()
        super().sync()
        self.optimizer.zero_grad(set_to_none=True)
        self.save()
        self._events.record("sync", self.step, cost_s=time.perf_counter() - started,
                            size=hvd.size(), **self._audit_fields())

    def write_checkpoint(self) -> None:
        if hvd.rank() != 0 or self._checkpointed_step == self.step:
            return
        started = time.perf_counter()
        checkpoint.save_atomic({"model": self.model.state_dict(),
                                "optimizer": self.optimizer.state_dict(),
                                "step": self.step, "epoch": self.epoch,
                                "consumed": self.consumed, "world_size": hvd.size(),
                                "wall_time": time.time()}, self._checkpoint_path)
        self._checkpointed_step = self.step
        self._events.record("checkpoint", self.step, path=str(self._checkpoint_path),
                            cost_s=time.perf_counter() - started)

    def resume_from_checkpoint(self) -> bool:
        """Load the durable checkpoint, if any, into this rank's state (then ``sync``
        spreads rank 0's copy). Returns whether one was found."""
        saved = checkpoint.load(self._checkpoint_path)
        if saved is None:
            return False
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.step, self.epoch, self.consumed = saved["step"], saved["epoch"], saved["consumed"]
        self.save()
        self._events.record("resume", self.step, path=str(self._checkpoint_path),
                            saved_world_size=saved["world_size"])
        return True
