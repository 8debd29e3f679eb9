"""The step's agreement: what every rank must learn from every other once per step.

Each rank contributes its summed loss, its sample (or token) count, the host-update flags
Horovod's driver sent it, rank 0's commit (and checkpoint) vote, whether it was told to
stop (SIGTERM: scancel, a time limit's warning) and how long its own work took before it
was ready to communicate. One sum over the ranks tells everyone the global mean loss, the
divisor for the gradients, whether to commit or leave for a membership change (all at the
same step), and every rank's work time (wait time and stragglers, with no extra
collective). An engine reduces this vector with its own step's collective where it can
(the data-parallel gradients), else on its own.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

REMOVED, ADDED = 1, 2          # horovod.runner.elastic.worker.HostUpdateResult's bits
HEADER = 6                     # loss, count, removed, added, commit vote, stop; then one time per rank


@dataclass(frozen=True)
class Control:
    loss_sum: float
    count: int
    host_update: int       # HostUpdateResult flags this rank received since the last step
    commit_vote: int       # rank 0's: 0 no, 1 commit, 2 commit and write a checkpoint
    work_s: float          # seconds from step start until ready to communicate
    stop: bool = False     # this rank was told to stop (any rank's stops them all)

    def encode(self, rank: int, size: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
        """The vector to sum over the world. Floating dtypes narrower than float32 would
        round counts and losses, so they travel as float32."""
        if dtype not in (torch.float32, torch.float64):
            dtype = torch.float32
        out = torch.zeros(HEADER + size, dtype=dtype)
        out[:HEADER] = torch.tensor([self.loss_sum, float(self.count),
                                     float(bool(self.host_update & REMOVED)),
                                     float(bool(self.host_update & ADDED)),
                                     float(self.commit_vote if rank == 0 else 0),
                                     float(self.stop)], dtype=dtype)
        out[HEADER + rank] = self.work_s
        return out.to(device)


@dataclass(frozen=True)
class Agreed:
    loss: float | None     # mean loss over the global batch (None when no rank had one)
    count: int
    host_update: int
    commit: bool
    checkpoint: bool
    work: tuple            # every rank's work seconds, by rank
    stop: bool = False     # every rank stops after this step

    @classmethod
    def decode(cls, summed: torch.Tensor) -> "Agreed":
        values = summed.double().cpu().tolist()
        count = int(round(values[1]))
        flags = (REMOVED if values[2] > 0 else 0) | (ADDED if values[3] > 0 else 0)
        return cls(loss=values[0] / count if count else None, count=count, host_update=flags,
                   commit=values[4] > 0, checkpoint=values[4] > 1, work=tuple(values[HEADER:]),
                   stop=values[5] > 0)

    def wait_s(self, rank: int) -> float:
        """How long this rank waited in the collective for the last rank to be ready."""
        return max(0.0, max(self.work) - self.work[rank]) if self.work else 0.0

    @property
    def removed_only(self) -> bool:
        return self.host_update == REMOVED


def agree(control: Control, rank: int, size: int, allreduce_sum) -> Agreed:
    """The agreement on its own collective (engines that cannot fuse it with theirs)."""
    vector = control.encode(rank, size, torch.float64)
    allreduce_sum(vector, "regatta.control")
    return Agreed.decode(vector)


@dataclass(frozen=True)
class Pending:
    """The runtime's part of a step's agreement; the engine adds what it measured."""
    host_update: int = 0
    commit_vote: int = 0
    stop: bool = False

    def control(self, loss_sum: float, count: int, work_s: float) -> Control:
        return Control(loss_sum=loss_sum, count=count, host_update=self.host_update,
                       commit_vote=self.commit_vote, work_s=work_s, stop=self.stop)
