"""Fault injection for tests, benchmarks and the demo, planned by the launcher.

``regatta local`` passes the plan to every worker in ``REGATTA_FAULTS`` (JSON). Workers
act on it at exact steps, which keeps fault tests repeatable:

* ``kill``: ``[{"host": H, "step": S}]``: every worker on host H SIGKILLs itself when it
  reaches step S (a real SIGKILL; the process gets no chance to clean up).
* ``slow``: ``{H: factor}``: workers on H stretch their compute time by ``factor``.
* ``pause``: ``[{"host": H, "step": S, "seconds": T}]``: workers on H stall for T seconds
  (a hung data loader): alive, silent, and must not be declared dead.
* ``kill_connecting``: ``[{"host": H, "step": S}]``: every worker on host H SIGKILLs itself
  in the first recovery after step S, the instant Gloo connects it to the new world: the
  survivors are mid mesh connection, the worst moment for a second death. A watch that
  missed the instant (unscheduled on a loaded machine) kills it as its ``hvd.init``
  returns (the event says ``after_init``).
* ``kill_syncing``: the same, the instant its ``hvd.init`` of the new world has returned:
  the survivors' Gloo meshes are complete and their sync's first collectives start.
* ``kill_entering``: the same, as it starts building the new world's lifelines (after the
  sync): the survivors are in the lifelines' address exchange, a Horovod collective.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field

ENV = "REGATTA_FAULTS"
_KILLING = threading.Lock()


@dataclass(frozen=True)
class FaultPlan:
    kill: list = field(default_factory=list)
    slow: dict = field(default_factory=dict)
    pause: list = field(default_factory=list)
    kill_connecting: list = field(default_factory=list)
    kill_syncing: list = field(default_factory=list)
    kill_entering: list = field(default_factory=list)

    @classmethod
    def from_env(cls) -> "FaultPlan":
        text = os.environ.get(ENV, "")
        return cls(**json.loads(text)) if text else cls()

    def to_env(self) -> str:
        return json.dumps({"kill": self.kill, "slow": self.slow, "pause": self.pause,
                           "kill_connecting": self.kill_connecting, "kill_syncing": self.kill_syncing,
                           "kill_entering": self.kill_entering})

    def dies_recovering(self, host: str, step: int) -> str:
        """When this host's workers die in the recovery of the world re-formed at ``step``:
        "connecting", "syncing", "entering", or "" (they do not)."""
        for when, planned in (("connecting", self.kill_connecting), ("syncing", self.kill_syncing),
                              ("entering", self.kill_entering)):
            if any(f["host"] == host and step >= f["step"] for f in planned):
                return when
        return ""

    @staticmethod
    def kill_now(events, step: int | None, **detail) -> None:
        # once: the watch and the main thread can both reach their instant together; the
        # second waits here for the signal
        _KILLING.acquire()
        # The store, not only the JSONL, must learn of the kill: the dashboard measures
        # recovery from it. Pending rows first, so that the flush between the recorded
        # instant and the kill carries one row.
        events.flush()
        events.record("kill_injected", step, **detail)
        events.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def before_step(self, world, step: int, events) -> None:
        for fault in self.pause:
            if fault["host"] == world.host and fault["step"] == step:
                time.sleep(fault["seconds"])
        for fault in self.kill:
            if fault["host"] == world.host and fault["step"] == step:
                self.kill_now(events, step, size=world.size)

    def after_compute(self, world, step: int, compute_started: float) -> None:
        factor = self.slow.get(world.host)
        if factor and factor > 1:
            time.sleep((time.perf_counter() - compute_started) * (factor - 1))
