"""What one pipeline rank measured in one optimizer step.

Trainers hand ``StepMetrics.as_dict()`` to an optional ``on_metrics`` callback; the sink
wiring lives with the monitor (``as_step_row`` maps onto the store's ``step`` columns,
which have no place for the pipeline-only fields, so those stay in the dict).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from .executor import StageStats


@dataclass
class StepMetrics:
    step: int
    wall_time: float
    rank: int
    world_size: int
    host: str
    slot: int
    stage: int
    replica: int
    schedule: str
    microbatches: int
    step_time: float          # whole optimizer step: schedule + gradient sum + update
    schedule_time: float      # the schedule alone (what the bubble is measured against)
    busy_time: float          # forward + backward compute
    recv_wait: float          # blocked on activations / gradients from neighbours
    send_wait: float          # completing sends at the end of the schedule
    allreduce_time: float     # summing gradients over data-parallel peers
    activation_bytes: int     # activations + activation gradients sent
    allreduce_bytes: int
    peak_activation_bytes: int
    bubble: float             # 1 - busy / schedule_time, this stage
    samples: int              # samples this replica trained on
    loss: float | None        # mean loss of the step (last stage only)

    @classmethod
    def of(cls, stats: StageStats, **fields) -> "StepMetrics":
        return cls(schedule_time=stats.step_time, busy_time=stats.busy_time,
                   recv_wait=stats.recv_wait, send_wait=stats.send_wait,
                   activation_bytes=stats.activation_bytes,
                   peak_activation_bytes=stats.peak_activation_bytes, bubble=stats.bubble,
                   **fields)

    def as_dict(self) -> dict:
        return {"type": "pipeline_step", **asdict(self)}

    def as_step_row(self, run_id: str) -> dict:
        """The store's ``step`` row (DESIGN.md metric names)."""
        return {"type": "step", "run_id": run_id, "step": self.step, "wall_time": self.wall_time,
                "rank": self.rank, "world_size": self.world_size, "host": self.host,
                "slot": self.slot, "stage": self.stage, "step_time": self.step_time,
                "compute_time": self.busy_time,
                # Receive waits are mostly the bubble (idle until a neighbour is done), so
                # they count as waiting; send completion and the allreduce as communication.
                "comm_time": self.send_wait + self.allreduce_time,
                "wait_time": self.recv_wait, "samples": self.samples,
                "bytes_sent": self.activation_bytes + self.allreduce_bytes, "loss": self.loss}
