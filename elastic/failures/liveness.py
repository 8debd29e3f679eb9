"""Stall detection from the progress every rank announces on its lifelines.

Each rank's lifeline watchdog sends its (step, waiting-in-collective) to its lifeline
neighbours four times a second; every rank is watched by its neighbours, and the first
of them that is not itself stalled records the stall (lifeline.watchers gives the order).
A peer is *stalled* when it has been silent for ``stall_after`` seconds (SIGSTOPped, or
its whole interpreter hung), or when it has not moved for that long while not waiting in
the collective this rank has been waiting in for as long (a hung data loader, a stuck
step). Peers blocked in the collective behind a stalled rank are never blamed: they say
they are waiting. Slow but progressing ranks are stragglers, not stalls.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class Heartbeat:
    """What this rank announces; the training loop updates it, the watchdog reads it."""
    step: int = 0
    waiting: bool = False
    waiting_since: float = 0.0

    def enter_collective(self, step: int, now: float) -> None:
        self.step, self.waiting, self.waiting_since = step, True, now

    def leave_collective(self, step: int) -> None:
        self.step, self.waiting = step, False

    @contextmanager
    def collective(self, state):
        """Waiting in ``state``'s step from entry until it returns or raises (a severed
        collective raises: the rank is no longer waiting in it)."""
        self.enter_collective(state.step, time.time())
        try:
            yield
        finally:
            self.leave_collective(state.step)


@dataclass
class PeerProgress:
    step: int
    waiting: bool
    heard_at: float
    changed_at: float


@dataclass
class StallWatch:
    stall_after: float = 5.0
    peers: dict = field(default_factory=dict)    # rank -> PeerProgress
    stalled: dict = field(default_factory=dict)  # rank -> reason

    def heard(self, rank: int, step: int, waiting: bool, now: float) -> None:
        last = self.peers.get(rank)
        changed = last is None or (last.step, last.waiting) != (step, waiting)
        self.peers[rank] = PeerProgress(step, waiting, now, now if changed else last.changed_at)

    def forgive(self, now: float) -> None:
        """This rank was not looking (stopped, starved): judge everyone afresh from now."""
        for peer in self.peers.values():
            peer.heard_at = max(peer.heard_at, now)
            peer.changed_at = max(peer.changed_at, now)

    def check(self, mine: Heartbeat, now: float) -> tuple[list, list]:
        """Ranks newly stalled (with reasons) and ranks that came back."""
        new, cleared = [], []
        for rank, peer in self.peers.items():
            reason = None
            if now - peer.heard_at > self.stall_after:
                reason = "silent"
            elif (not peer.waiting and now - peer.changed_at > self.stall_after
                  and mine.waiting and now - mine.waiting_since > self.stall_after):
                reason = "no progress"
            if reason and rank not in self.stalled:
                self.stalled[rank] = reason
                new.append((rank, reason, now - min(peer.heard_at, peer.changed_at)))
            elif reason is None and rank in self.stalled:
                del self.stalled[rank]
                cleared.append(rank)
        return new, cleared



def first_healthy(order: list[int], unable: set[int]) -> int | None:
    """The first rank of ``order`` that can still speak: the one that records a stall, so
    that each stall is one event although several ranks see it."""
    return next((rank for rank in order if rank not in unable), None)
