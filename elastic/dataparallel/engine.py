"""The data-parallel engine: what the runtime needs that is particular to it.

    build     the model on this rank's device, its optimizer, scheduler, GradScaler and
              tracked objects in one TrainState (rank 0 resumes from disk when asked)
    enter     on every (re)entry: this world's reducer; the data loader from the cursor
    step      one optimizer step (step.py)
    evaluate  the user's evaluation on rank 0 (train.eval_every, and at the end)
    finish    this rank's parameter hash; on rank 0 the held-out evaluation
"""
from __future__ import annotations

import time

import torch
from horovod.common.exceptions import HorovodInternalError

from elastic.config import ConfigError
from elastic.data.loader import Batches, Plan, dataset_size
from elastic.runtime.checkpoint import parameter_hash
from elastic.runtime.device import choose_device

from .buckets import plan_buckets
from .gloo_sums import GlooSums, over_gloo
from .reduce import BucketReducer
from .state import TrainState
from .step import StepKit, train_step


class DataParallelEngine:
    name = "dataparallel"
    uses_horovod = True
    # Every membership change syncs, removals too: the survivors agree on the state, but
    # the commit's shares must be re-placed over the new world (a small inventory; no
    # state moves when every survivor's live state is the commit).
    replans = True

    def __init__(self, training, cfg):
        self.training, self.cfg = training, cfg
        self.runtime, self.device, self.kit = None, None, None
        self.batches: Batches | None = None    # one loader for the rank's life
        self._reducer: tuple | None = None    # (the world it was made for, reducer)
        self._gloo = False                      # the buckets summed over a torch.distributed group
        self._sums: GlooSums | None = None      # over the runtime's group of this world
        self._spare: list = []                  # the last world's bucket buffers, free to reuse

    def build(self, runtime) -> TrainState:
        self.runtime = runtime
        self.device = choose_device(self.cfg.device or runtime.env.device, runtime.world.local_rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(self.cfg.seed)   # identical initial weights everywhere, before any sync
        model = self.training.build_model().to(self.device)
        objects = self.training.build_objects(model, self.cfg)
        if self.cfg.autocast == "fp16" and "scaler" not in objects:
            objects["scaler"] = torch.amp.GradScaler(self.device.type)
        if dataset_size(self.training.data) == 0:
            raise ConfigError(f"{self.training.name}: the training data is empty")
        state = TrainState(runtime, objects, self.cfg.checkpoint_path)
        self.batches = Batches(self.training.data, workers=self.cfg.loader_workers,
                               pin_memory=self.device.type == "cuda", loader_options=self.training.loader)
        self.batches.start()   # its workers start while the state is synced
        self._gloo = over_gloo(self.cfg.gradient_sums, runtime.hvd, self.device.type == "cpu",
                               len(plan_buckets(trained(model), self.bucket_bytes)))
        if self.cfg.resume and runtime.world.is_root:
            runtime.resumed(state, state.load_checkpoint())
        return state

    def enter(self, state) -> None:
        """A new world (or the first): the reducer and the loader start from the cursor."""
        world, cfg = self.runtime.world, self.cfg
        plan = Plan(size=dataset_size(self.training.data), global_batch=cfg.global_batch,
                    seed=cfg.seed, rank=world.rank, world=world.size, microsteps=cfg.accumulate)
        self.batches.restart(plan, state.cursor, cfg.steps - state.step)
        self.kit = StepKit(self.training, self.batches, plan, self.reducer(state), self.device)

    def step(self, state, pending):
        try:
            return train_step(state, self.kit, pending, self.runtime)
        except HorovodInternalError as err:
            # How far the step's gradients had got when the world broke (a restore follows).
            self.runtime.events.record("reduce_failed", state.step, error=str(err)[:500],
                                       **self.kit.reducer.progress())
            raise

    def reducer(self, state) -> BucketReducer:
        """One per world: rank and size change at every reset. The old one's gradient
        hooks go with it. Where its buckets are summed over a torch.distributed group of
        this world (``train.gradient_sums``, gloo_sums.py), the group is opened here unless
        the sync opened it."""
        world = self.runtime.world
        if self._reducer is None or self._reducer[0] != world:
            self.leave_world()
            spare, self._spare = self._spare, []
            sums = self.runtime.collectives
            if world.size > 1 and self._gloo:
                self._sums = sums = GlooSums(self.runtime.group, world, self.runtime.collectives)
            reducer = BucketReducer(trained(state.model), world.rank, world.size, sums,
                                    bucket_bytes=self.bucket_bytes,
                                    compression=self.cfg.compression,
                                    expected_count=self.cfg.global_batch,
                                    broken=self.runtime.world_broken, spare=spare)
            self._reducer = (world, reducer)
        return self._reducer[1]

    @property
    def bucket_bytes(self) -> int:
        return int(self.cfg.bucket_mb * 2 ** 20)

    def settings(self) -> dict:
        """What the runtime's ``ready`` event records of this engine's choices (a world of
        one rank sums nothing, whatever it says)."""
        return {"gradient_sums": "gloo" if self._gloo else "horovod"}

    def leave_world(self) -> None:
        """Before a reset and at the end: the torch.distributed group of the buckets' sums
        belongs to this world alone, and so does the reducer made for it. A reducer over
        Horovod outlives a reset that gives back the same world. The closed reducer's
        bucket buffers that nothing writes into any more wait for the next one."""
        if self._reducer is not None:
            world_gone = self._reducer[0] != self.runtime.world
            if world_gone or self._sums is not None:   # closed before the group it sums over
                self._reducer[1].close()
                self._spare = self._reducer[1].released()
                self._reducer = None
        self._sums = None     # the runtime closes the group itself before the reset

    def straggler_groups(self, state):
        return None   # every rank does the same work

    def evaluate(self, state) -> dict:
        evaluate = self.training.evaluate
        if evaluate is None:
            return {}
        state.model.eval()
        with torch.no_grad():
            return {k: float(v) for k, v in evaluate(state.model).items()}

    def finish(self, state) -> tuple[dict, dict]:
        if self.batches is not None:
            self.batches.close()
        self.leave_world()
        self._spare = []
        world = self.runtime.world
        mine = {"host": world.host, "slot": world.slot, "rank": world.rank,
                "world_size": world.size, "step": state.step,
                "param_hash": parameter_hash(state.model), "wall_time": time.time()}
        if not world.is_root:
            return mine, mine
        return mine, {**mine, "metrics": self.evaluate(state)}


def trained(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters backward gives gradients to, in the model's order."""
    return [p for p in model.parameters() if p.requires_grad]
