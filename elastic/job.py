"""What a training job hands to the loops in this package.

A job is a model, its data and how to score it; everything distributed lives here in
``elastic/``. Jobs implement this protocol (see jobs/digits.py for the smallest one).
"""
from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class Job(Protocol):
    name: str

    def build_model(self) -> nn.Module:
        """A freshly initialised model (call under a fixed torch seed)."""

    def train_data(self) -> tuple[torch.Tensor, ...]:
        """Training tensors, indexed along dim 0; identical on every rank."""

    def loss_sum(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, int]:
        """Summed (not averaged) loss over the batch and the number of samples it covers,
        so that ranks with different batch sizes average to the combined batch's mean."""

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Held-out metrics; the first key is the job's headline metric."""
