"""One rank's stage: split its replica's batch into microbatches, run the schedule,
then sum gradients over the stage's data-parallel peers in one flat buffer.

The last stage scales every microbatch's summed loss by 1 / (the whole step's loss-term
count over all replicas) before backward, so after the sum over replicas each gradient
is exactly the combined batch's mean gradient, as the single-process model computes it.

A stage lives on one device (runtime/device.py): CPU unless asked, else the rank's GPU. Its
module, its microbatches and the buffers its activations and gradients arrive in are
there; the transport moves device tensors (transport.py).
"""
from __future__ import annotations

import time
from typing import Protocol

import torch
from torch import nn

from .config import Plan
from .executor import StageExecutor, StageStats
from .grid import Grid
from .schedule import make_schedule
from .transport import Transport


class PipelineJob(Protocol):
    """What a job adds to elastic.job.Job to be pipelined (see jobs/charlm.py)."""
    name: str

    def build_model(self) -> nn.Sequential: ...
    def train_data(self) -> tuple[torch.Tensor, ...]: ...
    def pipeline_input(self, batch: tuple) -> torch.Tensor:
        """Stage 0's input for a (micro)batch."""
    def pipeline_loss(self, output: torch.Tensor, batch: tuple) -> torch.Tensor:
        """Summed loss of the last stage's output on a (micro)batch."""
    def loss_count(self, batch: tuple) -> int:
        """How many loss terms the batch has (the divisor of the mean)."""
    def evaluate(self, model: nn.Module) -> dict[str, float]: ...


def split(batch: tuple, microbatches: int) -> list[tuple]:
    """``microbatches`` equal consecutive slices of every tensor of ``batch``."""
    n = len(batch[0])
    if n % microbatches:
        raise ValueError(f"batch of {n} does not split into {microbatches} equal microbatches")
    size = n // microbatches
    return [tuple(t[i * size:(i + 1) * size] for t in batch) for i in range(microbatches)]


class PipelineStage:
    def __init__(self, job: PipelineJob, plan: Plan, grid: Grid, transport: Transport,
                 module: nn.Module, device: torch.device | None = None):
        """Moves ``module`` to ``device`` (default: the CPU; runtime.device chooses).
        Build the optimizer after this."""
        self.device = torch.device(device or "cpu")
        module.to(self.device)
        self.job, self.plan, self.grid, self.transport, self.module = job, plan, grid, transport, module
        self.executor = StageExecutor(module, grid, transport,
                                      loss_fn=lambda out, mb: job.pipeline_loss(out, mb),
                                      device=self.device)
        self.actions = make_schedule(plan.schedule, grid.stage, plan.pp, plan.microbatches)

    def forward_backward(self, batch: tuple | None, global_count: int) -> StageStats:
        """Accumulate this stage's share of the step's gradients. ``batch`` is this
        replica's share (needed only by the first and last stage), on any device."""
        if batch is not None:
            batch = tuple(t.to(self.device) for t in batch)   # one copy, then sliced there
        micro = split(batch, self.plan.microbatches) if batch is not None else None
        inputs = [self.job.pipeline_input(mb) for mb in micro] if self.grid.is_first else None
        targets = micro if self.grid.is_last else None
        return self.executor.run(self.actions, inputs, targets, scale=1.0 / global_count)

    def reduce(self) -> tuple[float, int]:
        """Sum gradients over replicas in place. Returns (seconds spent, bytes reduced)."""
        started = time.perf_counter()
        params = [p for p in self.module.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        self.transport.allreduce_dp(flat)
        offset = 0
        for param, grad in zip(params, grads):
            param.grad = flat[offset:offset + grad.numel()].view_as(grad).to(grad.dtype)
            offset += grad.numel()
        return time.perf_counter() - started, flat.numel() * 4 if self.grid.dp > 1 else 0
