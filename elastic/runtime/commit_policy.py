"""How often to commit: a fixed interval, or ``auto`` from measurements (Young/Daly).

With ``auto`` the interval is the Young/Daly optimum, sqrt(2 x commit cost x mean time
between rollbacks), converted to steps with the measured step time, and never so short
that commits cost more than ``max_overhead`` of the training time.

Why rollbacks, not failures: Young/Daly balances the commits' cost against the work a
failure throws away, on average half an interval. A failure the survivors recover from
their live state (``recovered_live``, ``adopted``) throws away only the step it
interrupted, whatever the interval; only one that goes back to a commit or to the
checkpoint (``restored_commit``, ``restored_checkpoint``; a sync that names no recovery
counts as one) loses the steps since the commit. So the failures that count are the rollbacks, and a job
whose failures recover live commits less often: with a rollback fraction p of failures,
the interval is 1/sqrt(p) times the one counting every failure.

Both inputs are re-measured as the job runs (commit cost and step time as moving
averages; the rollback rate as rollbacks seen over time watched, with a prior of one
rollback per ``prior_mtbf_s``, so a job that has seen none still commits, and a first
failure that recovers live does not shorten the interval). Each new choice is an event.

Only rank 0 decides; its vote rides in the step's fused allreduce, so every rank commits
at the same step and a restore brings all of them to the same point.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

# the recoveries that throw away no step but the one the failure interrupted
LIVE_RECOVERIES = ("recovered_live", "adopted")


def young_daly_steps(commit_cost_s: float, mtbf_s: float, step_time_s: float,
                     max_overhead: float = 0.01, max_steps: int = 10_000) -> int:
    """The commit interval in steps (see the module docstring)."""
    step_time_s = max(step_time_s, 1e-6)
    optimal = math.sqrt(2 * commit_cost_s * mtbf_s) / step_time_s
    overhead_floor = commit_cost_s / (max_overhead * step_time_s)
    return int(min(max_steps, max(1, round(optimal), math.ceil(overhead_floor))))


@dataclass
class CommitPolicy:
    fixed: int | None                 # None means auto
    max_overhead: float = 0.01
    prior_mtbf_s: float = 3600.0
    alpha: float = 0.2                # weight of a new measurement in the moving averages
    commit_cost_s: float = 0.0
    step_time_s: float = 0.0
    failures: int = 0
    rollbacks: int = 0                # failures that went back to a commit or the checkpoint
    started: float = field(default_factory=time.monotonic)
    interval: int = 10
    last_commit_step: int = 0

    def __post_init__(self) -> None:
        if self.fixed is not None:
            self.interval = self.fixed

    @property
    def auto(self) -> bool:
        return self.fixed is None

    def watched_s(self) -> float:
        return time.monotonic() - self.started + self.prior_mtbf_s

    def mtbf_s(self) -> float:
        """Mean time between failures, reported beside the interval."""
        return self.watched_s() / (self.failures + 1)

    def mtbr_s(self) -> float:
        """Mean time between rollbacks: what the interval is chosen from."""
        return self.watched_s() / (self.rollbacks + 1)

    def due(self, next_step: int) -> bool:
        """Should the step that ends at ``next_step`` be committed?"""
        return next_step - self.last_commit_step >= self.interval

    def observe_step(self, seconds: float) -> None:
        self.step_time_s = seconds if not self.step_time_s else \
            (1 - self.alpha) * self.step_time_s + self.alpha * seconds

    def observe_commit(self, step: int, seconds: float) -> int | None:
        """Record a commit; returns the new interval when ``auto`` changed it."""
        self.last_commit_step = step
        self.commit_cost_s = seconds if not self.commit_cost_s else \
            (1 - self.alpha) * self.commit_cost_s + self.alpha * seconds
        if not self.auto or not self.step_time_s:
            return None
        chosen = young_daly_steps(self.commit_cost_s, self.mtbr_s(), self.step_time_s,
                                  self.max_overhead)
        # Hysteresis: noise in the averages should not make an event every commit.
        if abs(chosen - self.interval) <= max(1, self.interval // 10):
            return None
        self.interval = chosen
        return chosen

    def observe_failure(self) -> None:
        self.failures += 1

    def observe_recovery(self, recovery: str | None) -> None:
        """A failure's re-forming went on from ``recovery`` (the sync's; None where the
        engine does not say: taken for a rollback, the safe side)."""
        if recovery not in LIVE_RECOVERIES:
            self.rollbacks += 1

    def entered(self, step: int) -> None:
        """The loop (re)starts from a synced, committed state at ``step``."""
        self.last_commit_step = step
