"""What a user brings to a data-parallel run: model, data, loss, optimizer, and whatever
else must survive a failure. ``regatta.fit`` builds one from keyword arguments; a
``Job`` (elastic/job.py, the short way for simple jobs) is adapted into one.

The engine takes it from here: it moves the model to the rank's device, builds what was
given as a factory, commits every object with ``state_dict``/``load_state_dict``, and
feeds the data through the elastic sampler.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from elastic.config import ConfigError
from elastic.optim import make_optimizer


@dataclass
class Training:
    name: str
    model: nn.Module | Callable[[], nn.Module]
    # A map-style torch Dataset (read through a DataLoader), or a tuple of tensors indexed
    # along dim 0 (the fast path for data that fits in memory).
    data: Any
    # loss(model, batch) -> the batch's mean loss, or (summed loss, number of loss terms);
    # the sum form keeps any split of the global batch exact (tokens, masked terms).
    loss: Callable
    optimizer: Any = None          # an Optimizer, a factory params -> Optimizer, or None (train.optimizer)
    scheduler: Any = None          # an LR scheduler, a factory optimizer -> scheduler, or None
    scaler: Any = None             # a torch GradScaler (fp16 autocast), or None
    evaluate: Callable | None = None   # evaluate(model) -> {"metric": value}, on rank 0
    track: dict = field(default_factory=dict)   # more objects with state_dict/load_state_dict
    loader: dict = field(default_factory=dict)  # DataLoader keyword arguments (collate_fn, ...)

    def build_model(self) -> nn.Module:
        return self.model() if callable(self.model) and not isinstance(self.model, nn.Module) \
            else self.model

    def build_objects(self, model: nn.Module, cfg) -> dict:
        """model, optimizer, scheduler, scaler and the tracked objects, by name."""
        optimizer = self.optimizer
        if optimizer is None:
            optimizer = make_optimizer(model.parameters(), cfg)
        elif not isinstance(optimizer, torch.optim.Optimizer):
            optimizer = optimizer(model.parameters())
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if not owned <= {id(p) for p in model.parameters()}:
            raise ConfigError("the optimizer holds parameters that are not the model's: build it "
                              "from model.parameters() (or pass a factory params -> optimizer)")
        objects = {"model": model, "optimizer": optimizer}
        scheduler = self.scheduler
        if scheduler is not None and not hasattr(scheduler, "state_dict"):
            scheduler = scheduler(optimizer)
        for name, obj in (("scheduler", scheduler), ("scaler", self.scaler), *self.track.items()):
            if obj is None:
                continue
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise ConfigError(f"{name!r} cannot be committed: it has no state_dict/load_state_dict")
            if name in objects:
                raise ConfigError(f"tracked object name {name!r} is taken")
            objects[name] = obj
        return objects


def from_job(job) -> Training:
    """A Job (build_model, train_data, loss_sum, evaluate) as a Training."""
    return Training(name=job.name, model=job.build_model, data=job.train_data(),
                    loss=job.loss_sum, evaluate=job.evaluate)
