"""A pipeline on a fixed world (mpirun, or one process): the Run is built once.

MPI ends the whole job when a rank dies, so nothing in memory survives a failure: the
only commit worth making is the durable checkpoint. ``save`` therefore writes it (every
rank takes part), and the commit policy sees what a checkpoint costs; a relaunch
(``regatta supervise``) resumes from it.
"""
from __future__ import annotations

from elastic.runtime.state import RuntimeState

from .run import Run, resume, save_checkpoint
from .shards import model_digest, tensor_digests


class FixedPipeline(RuntimeState):
    def __init__(self, runtime, run: Run):
        super().__init__(runtime)
        self.run = run
        self._checkpointed_step: int | None = None

    @property
    def step(self) -> int:
        return self.run.step

    def save(self) -> dict:
        detail = self.write_checkpoint() or {}
        return {"durable": True, **detail}

    def restore_committed(self) -> None:
        raise RuntimeError("a fixed-world pipeline cannot restore in memory; relaunch it "
                           "(regatta supervise) to resume from its checkpoint")

    def sync_state(self) -> None:
        pass   # every rank built its stage from the same seed or the same checkpoint

    def write_checkpoint(self) -> dict | None:
        if self._checkpointed_step == self.run.step:
            return None
        self._checkpointed_step = self.run.step
        return save_checkpoint(self.run, self.runtime.run_id)

    def load_checkpoint(self) -> dict | None:
        return resume(self.run)

    def audit_hash(self) -> str:
        """The whole model's digest (replica 0 of each stage contributes; a collective)."""
        digests = tensor_digests(self.run.stage.module.state_dict()) if self.run.grid.replica == 0 else {}
        everyone = self.runtime.collectives.allgather_object(digests, "regatta.pipe.audit")
        return model_digest({k: v for d in everyone for k, v in d.items()})
