"""The durable checkpoints of a run as the runtime sees them: each write recorded as an
event (a background write when it ends, from the writer's thread), the checkpoint folder
marked as this run's, a resume checked against it, and the final write waited for.

The bytes themselves are written by the state (checkpoint.py, checkpoint_writer.py).
"""
from __future__ import annotations

import threading
import time

from .checkpoint import CheckpointError
from .checkpoint_writer import PendingWrite
from .runs import mark_checkpoint_folder


class Checkpoints:
    def __init__(self, events, cfg, run_id: str):
        self.events, self.cfg, self.run_id = events, cfg, run_id
        self.writing: PendingWrite | None = None     # the durable checkpoint still being written
        self._recorded = threading.Event()           # ... and once it is, its event recorded

    def write(self, state) -> None:
        """The durable copy. ``cost_s``: what training waited for; a write going on in the
        background is recorded when it ends (``write_s``, ``bytes``), from the writer."""
        started, step = time.perf_counter(), state.step
        detail = state.write_checkpoint()
        cost = time.perf_counter() - started
        if isinstance(detail, PendingWrite):
            recorded = threading.Event()
            self.writing, self._recorded = detail, recorded
            detail.add_done_callback(lambda done: self._written(step, cost, done, recorded))
        elif detail is not None:
            self.mark()
            self.events.record("checkpoint", step, cost_s=cost, **detail)

    def _written(self, step: int, cost: float, done: PendingWrite, recorded: threading.Event) -> None:
        """A background write ended (called from the writer's thread)."""
        try:
            error = done.exception()
            if error is not None:   # the previous checkpoint is still in place
                self.events.record("checkpoint_failed", step, cost_s=cost,
                                   error=f"{type(error).__name__}: {error}"[:2000])
                return
            self.mark()
            self.events.record("checkpoint", step, cost_s=cost, **done.result())
        finally:
            recorded.set()

    def wait(self) -> None:
        """Block until the background write is recorded (not just done: waiters wake before callbacks)."""
        if self.writing is not None:
            while not self._recorded.wait(0.1):
                self.writing.hurry()    # paced to land later: it is needed now
            self.writing = None

    def mark(self) -> None:
        """The checkpoint folder now holds this run's checkpoint."""
        mark_checkpoint_folder(self.cfg.checkpoint_path.parent, self.run_id)

    def resumed(self, state, detail: dict | None) -> None:
        """The state was loaded from the checkpoint folder (``train.resume``)."""
        folder = self.cfg.checkpoint_path.parent
        if detail is None:
            raise CheckpointError(f"train.resume = {self.cfg.resume!r}, but {folder} holds no checkpoint")
        if detail.get("run_id") not in (None, self.run_id):
            raise CheckpointError(f"train.resume = {self.cfg.resume!r}, but the checkpoint in {folder} "
                                  f"belongs to run {detail['run_id']!r}")
        self.events.record("resume", state.step, **detail)
