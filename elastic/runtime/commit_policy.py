"""How often to commit: a fixed interval, or ``auto`` from measurements (Young/Daly).

With ``auto`` the interval is the Young/Daly optimum, sqrt(2 x commit cost x mean time
between failures), converted to steps with the measured step time, and never so short
that commits cost more than ``max_overhead`` of the training time. Both inputs are
re-measured as the job runs (commit cost and step time as moving averages; the failure
rate as failures seen over time watched, with a prior of one failure per
``prior_mtbf_s`` so a job that has seen none still commits). Each new choice is an event.

Only rank 0 decides; its vote rides in the step's fused allreduce, so every rank commits
at the same step and a restore brings all of them to the same point.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field


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
    started: float = field(default_factory=time.monotonic)
    interval: int = 10
    last_commit_step: int = 0

    def __post_init__(self) -> None:
        if self.fixed is not None:
            self.interval = self.fixed

    @property
    def auto(self) -> bool:
        return self.fixed is None

    def mtbf_s(self) -> float:
        return (time.monotonic() - self.started + self.prior_mtbf_s) / (self.failures + 1)

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
        chosen = young_daly_steps(self.commit_cost_s, self.mtbf_s(), self.step_time_s,
                                  self.max_overhead)
        # Hysteresis: noise in the averages should not make an event every commit.
        if abs(chosen - self.interval) <= max(1, self.interval // 10):
            return None
        self.interval = chosen
        return chosen

    def observe_failure(self) -> None:
        self.failures += 1

    def entered(self, step: int) -> None:
        """The loop (re)starts from a synced, committed state at ``step``."""
        self.last_commit_step = step
