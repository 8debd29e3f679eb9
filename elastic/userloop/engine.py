"""The engine of a loop the user writes: the runtime's step is theirs, so this engine only
follows worlds (each DistributedOptimizer's reducer is rebuilt for every one) and says
what the run ended with."""
from __future__ import annotations

import time

from elastic.runtime.checkpoint import parameter_hash


class UserLoopEngine:
    name = "horovod"
    uses_horovod = True
    # As the data-parallel engine's state: every membership change re-places the commit.
    replans = True

    def __init__(self):
        self.runtime = None
        self.optimizers: list = []    # every regatta.horovod DistributedOptimizer made

    def enter(self, state) -> None:
        for optimizer in self.optimizers:
            optimizer.enter_world(self.runtime.world, self.runtime.collectives)

    def leave_world(self) -> None:
        for optimizer in self.optimizers:
            optimizer.leave_world()

    def settings(self) -> dict:
        return {"gradient_sums": "horovod", "loop": "user"}

    def straggler_groups(self, state):
        return None

    def evaluate(self, state) -> dict:
        return {}   # the user's loop evaluates; regatta.log stores what it measures

    def finish(self, state) -> tuple[dict, dict]:
        self.leave_world()
        world = self.runtime.world
        mine = {"host": world.host, "slot": world.slot, "rank": world.rank,
                "world_size": world.size, "step": state.step,
                "param_hash": parameter_hash(state.every_module), "wall_time": time.time()}
        return mine, {**mine, "metrics": {}}
