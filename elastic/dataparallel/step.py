"""One data-parallel optimizer step, top to bottom.

Each rank takes its share of the step's global batch from the shared cursor (data/), in
``train.accumulate`` microbatches; for each it computes the *summed* loss (under autocast
when asked) and accumulates its gradients; the reducer sums gradients and the step's
agreement over the world and leaves the combined batch's mean gradient (reduce.py); then
every rank unscales (fp16), clips, and applies the same update.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from elastic.data.loader import to_device
from elastic.runtime.control import Pending
from elastic.runtime.randomness import seed_step
from elastic.runtime.reporting import StepRow

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class StepKit:
    """What the engine prepared for this world: where the data comes from, the reducer,
    the device and the training's pieces."""
    training: object            # elastic.training.Training
    batches: object             # elastic.data.loader.Batches, restarted at every entry
    plan: object                # elastic.data.loader.Plan
    reducer: object
    device: torch.device


def summed_loss(loss_fn, model, batch, samples: int) -> tuple[torch.Tensor, int]:
    """The user's loss as (sum, count): a mean is taken over the microbatch's samples."""
    out = loss_fn(model, batch)
    if isinstance(out, (tuple, list)):
        loss_sum, count = out
        return loss_sum, int(count)
    return out * samples, samples


def train_step(state, kit: StepKit, pending: Pending, runtime) -> tuple[StepRow, object]:
    cfg, world = runtime.cfg, runtime.world
    model, optimizer = state.model, state.optimizer
    scaler, scheduler = state.objects.get("scaler"), state.objects.get("scheduler")
    started = time.perf_counter()
    micro, next_cursor = kit.plan.step(state.cursor)
    # Dropout and other randomness replay identically after a restore.
    seed_step(cfg.seed, state.step, world.rank)
    state.forward_buffers.keep()   # a failed step's forward must not have moved them (live.py)
    model.train()
    optimizer.zero_grad(set_to_none=True)
    autocast = torch.autocast(kit.device.type, AUTOCAST[cfg.autocast]) if cfg.autocast else nullcontext()
    loss_total, count, data_time = 0.0, 0, 0.0
    for i, indices in enumerate(micro):
        fetch = time.perf_counter()
        batch = kit.batches.take(indices)
        batch = None if batch is None else to_device(batch, kit.device)
        data_time += time.perf_counter() - fetch
        kit.reducer.before_backward(last=i == len(micro) - 1)
        if batch is None:
            continue
        with autocast:
            loss_sum, n = summed_loss(kit.training.loss, model, batch, len(indices))
        (scaler.scale(loss_sum) if scaler is not None else loss_sum).backward()
        loss_total, count = loss_total + loss_sum.item(), count + n
    runtime.env.faults.after_compute(world, state.step, started)
    compute_done = time.perf_counter()

    reduced = kit.reducer.finish(pending.control(loss_total, count, compute_done - started))
    comm_done = time.perf_counter()
    if scaler is not None:
        scaler.unscale_(optimizer)
    if cfg.clip_grad_norm:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm)
    lr = optimizer.param_groups[0]["lr"]
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    if scheduler is not None:
        scheduler.step()
    state.cursor = next_cursor
    state.step += 1
    state.forward_buffers.applied()
    agreed = reduced.agreed
    wait = agreed.wait_s(world.rank)   # in the reduction, waiting for the last rank
    return StepRow(step_time=time.perf_counter() - started, data_time=data_time,
                   compute_time=compute_done - started - data_time,
                   comm_time=max(0.0, comm_done - compute_done - wait), wait_time=wait,
                   samples=sum(len(m) for m in micro), bytes_sent=reduced.nbytes, loss=agreed.loss,
                   lr=lr, overlap=reduced.overlap), agreed
