"""Straggler detection from the work times every rank already learns at each step.

Every rank's work seconds (time from step start until it was ready to communicate) ride
in the step's agreement (control.py), so rank 0 can flag a straggler with no extra
collective. Ranks are compared within groups of ranks doing the same work: all ranks for
data parallelism, the replicas of one stage for a pipeline.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass
class StragglerDetector:
    """Flags a rank whose work time has been above ``factor`` x the median of its group's
    other ranks over the last ``window`` steps (the median of its ratios, so one noisy
    step neither flags nor clears it); flags it once until it recovers."""
    factor: float = 1.3
    window: int = 8
    history: dict = field(default_factory=dict)
    flagged: set = field(default_factory=set)

    def observe(self, work: list[float], groups: list[list[int]] | None = None) -> list[int]:
        new = []
        for group in groups or [list(range(len(work)))]:
            if len(group) < 2:
                continue
            for rank in group:
                others = statistics.median(work[r] for r in group if r != rank)
                if others > 0 and self._record(rank, work[rank] / others):
                    new.append(rank)
        return sorted(new)

    def _record(self, rank: int, ratio: float) -> bool:
        ratios = self.history.setdefault(rank, deque(maxlen=self.window))
        ratios.append(ratio)
        if len(ratios) < self.window:
            return False
        typical = statistics.median(ratios)
        if typical > self.factor and rank not in self.flagged:
            self.flagged.add(rank)
            return True
        if typical <= 1 + (self.factor - 1) / 2:
            # Cleared only well below the threshold: a rank hovering at it is one
            # straggler, not an event every few steps.
            self.flagged.discard(rank)
        return False

    def ratio(self, rank: int) -> float:
        return statistics.median(self.history[rank])

    def reset(self) -> None:
        self.history.clear()
        self.flagged.clear()
