"""One pipelined optimizer step, top to bottom.

Every rank derives the step's global batch from the shared cursor (data/sampler.py), takes
its replica's share, runs its stage's schedule (stage.py), sums the stage's gradients over
its replicas, joins the step's agreement (runtime/control.py: the global loss and count,
commit vote, host updates, every rank's busy time) and updates its own stage.
"""
from __future__ import annotations

import time

from elastic.data.sampler import rank_share
from elastic.runtime.control import Agreed, Pending, agree
from elastic.runtime.randomness import seed_step
from elastic.runtime.reporting import StepRow

from .run import Run, next_batch


def train_step(run: Run, data: tuple, pending: Pending, allreduce_sum) -> tuple[StepRow, Agreed]:
    started = time.perf_counter()
    grid, job = run.grid, run.job
    indices = next_batch(run, len(data[0]))
    share = rank_share(indices, grid.replica, run.plan.dp)
    batch = tuple(t[share] for t in data) if grid.is_first or grid.is_last else None
    # The last stage scales each microbatch's loss by 1 / the whole step's count.
    count = job.loss_count(tuple(t[indices] for t in data)) if grid.is_last else 1
    # Dropout replays identically after a restart from a checkpoint.
    seed_step(run.train.seed, run.step, run.world.rank)
    data_done = time.perf_counter()

    run.stage.module.train()
    run.optimizer.zero_grad(set_to_none=True)
    stats = run.stage.forward_backward(batch, count)
    reduce_time, reduce_bytes = run.stage.reduce()
    control = pending.control(stats.loss_sum if grid.is_last else 0.0,
                              job.loss_count(batch) if grid.is_last else 0, stats.busy_time)
    agreed = agree(control, run.world.rank, run.world.size, allreduce_sum)
    run.optimizer.step()
    run.cursor = run.cursor.advance(len(indices), len(data[0]))
    run.step += 1
    run.loss = agreed.loss
    step_time = time.perf_counter() - started
    return StepRow(
        step_time=step_time, data_time=data_done - started, compute_time=stats.busy_time,
        # Receive waits are mostly the bubble (idle until a neighbour is done), so they
        # count as waiting; send completion and the replicas' gradient sum as communication.
        comm_time=stats.send_wait + reduce_time, wait_time=stats.recv_wait, samples=len(share),
        bytes_sent=stats.activation_bytes + reduce_bytes, loss=agreed.loss,
        lr=run.optimizer.param_groups[0]["lr"], stage=grid.stage, replica=grid.replica,
        bubble=stats.bubble,
        detail={"busy_time": stats.busy_time, "schedule_time": stats.step_time,
                "recv_wait": stats.recv_wait, "send_wait": stats.send_wait,
                "activation_bytes": stats.activation_bytes, "allreduce_time": reduce_time,
                "allreduce_bytes": reduce_bytes, "peak_activation_bytes": stats.peak_activation_bytes,
                "schedule": run.plan.schedule, "microbatches": run.plan.microbatches}), agreed
