"""Move stage boundaries while training, from measured per-stage compute times.

    mpirun -np 2 --hostfile hostfiles/localhost.txt python -m jobs.charlm --pp 2 \
        --set planner.rebalance=true --set model.layers=6      # optional: REGATTA_SLOW_RANKS=1:3

Every ``planner.rebalance_window`` steps (after ``rebalance_warmup``) the ranks all-gather
their summed busy time (forward + backward, StageStats). A stage's time is its slowest
replica's (the allreduce waits for it); the imbalance is max / mean over stages. When it
stays above ``rebalance_threshold`` for ``rebalance_patience`` windows in a row, the
boundaries are re-cut:

* Rank 0 measured every child's forward+backward once at start (planner.measure_job): the
  children's *nominal* costs c_i. Stage s then ran at speed f_s = busy_s / sum c_i over
  its children; a slowed host shows up as a large f_s, a heavy layer as a large c_i. (A
  stage with almost no work measures overhead, not speed: it gets the typical f.)
* The new boundaries minimise max_s f_s * sum c_i (planner.partition): the rank holding a
  slow stage keeps it, but with fewer children. They are used only if the predicted
  bottleneck falls by ``rebalance_min_gain``, so noise does not make boundaries flap.

The move is in-process and exact: replica 0 of every stage contributes its parameters and
optimizer state (under the full model's key names, which grid.cut keeps), every rank
all-gathers them, builds its new children and loads them; training continues with
bitwise the same numbers as without the move. A ``rebalance`` event records the old and
new boundaries, the imbalance before, the predicted one after and the cost of the move.
Every rank holds the whole model's state briefly during a move.

``REGATTA_SLOW_RANKS=RANK:FACTOR[,...]`` (or ``regatta local --slow``'s host factors)
slows a rank: after every child's forward and backward it sleeps FACTOR - 1 times what
that took, so its stage's busy time scales with its children, as on a slower machine.
"""
from __future__ import annotations

import os
import time
import warnings
from dataclasses import replace

import torch
from torch import nn

from elastic.faults import FaultPlan

from .grid import cut
from .planner import PlannerConfig, measure_job, partition
from .stage import PipelineStage

SLOW_ENV = "REGATTA_SLOW_RANKS"
# A slowed first child whose input is token ids has its backward hook fire early (torch
# warns each time); slow_down accounts for that, so the warning says nothing new.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")


def slow_factor(rank: int, host: str) -> float:
    """This rank's injected slowdown: ``REGATTA_SLOW_RANKS`` by rank, else the fault plan's
    ``slow`` by host (``regatta local --slow``)."""
    for item in filter(None, os.environ.get(SLOW_ENV, "").split(",")):
        who, _, factor = item.partition(":")
        if int(who) == rank:
            return float(factor)
    return float(FaultPlan.from_env().slow.get(host, 1.0))


def slow_down(module: nn.Module, factor: float) -> None:
    """Make every child of ``module`` take ``factor`` times as long, forward and backward,
    by sleeping (factor - 1) x the time each just took (see module doc)."""
    if factor <= 1:
        return
    started = {}

    def stretch(key) -> None:
        time.sleep((time.perf_counter() - started.pop(key)) * (factor - 1))

    def before_forward(child, inputs):
        started["fwd", id(child)] = time.perf_counter()

    def after_forward(child, inputs, output):
        took = time.perf_counter() - started["fwd", id(child)]
        stretch(("fwd", id(child)))
        if not any(torch.is_tensor(x) and x.requires_grad for x in inputs):
            # Its backward hook fires before its backward runs (no input gradient to
            # wait for): stretch that backward here, as twice the forward.
            time.sleep(2 * took * (factor - 1))

    def before_backward(child, grad_output):
        started["bwd", id(child)] = time.perf_counter()

    def after_backward(child, grad_input, grad_output):
        if any(g is not None for g in grad_input):
            stretch(("bwd", id(child)))
        else:
            started.pop(("bwd", id(child)), None)

    for child in module.children():
        child.register_forward_pre_hook(before_forward)
        child.register_forward_hook(after_forward)
        child.register_full_backward_pre_hook(before_backward)
        child.register_full_backward_hook(after_backward)


def allgather_object(transport, obj) -> list:
    """Every rank's ``obj``, in rank order (mpi4py's allgather or torch.distributed's)."""
    comm = getattr(transport, "comm", None)
    if comm is not None:
        return comm.allgather(obj)
    import torch.distributed as dist
    out = [None] * transport.size
    dist.all_gather_object(out, obj)
    return out


# -- moving stage state between owners -------------------------------------------------------
def export_stage(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """A stage's parameters and optimizer state on the CPU, keyed by full-model names."""
    names = {id(p): n for n, p in module.named_parameters()}
    return {"model": {k: v.detach().cpu().clone() for k, v in module.state_dict().items()},
            "optimizer": {names[id(p)]: {k: v.detach().cpu().clone() if torch.is_tensor(v) else v
                                         for k, v in s.items()}
                          for p, s in optimizer.state.items()}}


def import_stage(module: nn.Module, optimizer: torch.optim.Optimizer, pieces: list[dict]) -> None:
    """Load this module's children from the exported stages ``pieces`` (exactly)."""
    wanted = set(module.state_dict())
    model = {k: v for piece in pieces for k, v in piece["model"].items() if k in wanted}
    module.load_state_dict(model, strict=True)
    saved = {k: v for piece in pieces for k, v in piece["optimizer"].items()}
    for name, param in module.named_parameters():
        if name in saved:
            # Adam's "step" stays a CPU scalar; moments go where the parameter lives.
            optimizer.state[param] = {k: v.to(param.device) if torch.is_tensor(v) and k != "step" else v
                                      for k, v in saved[name].items()}


def move_stages(run, stages: tuple) -> None:
    """Re-cut ``run`` to ``stages`` on the same ranks: all-gather replica 0's stage state,
    build this rank's new children, load them, rebuild its stage and optimizer."""
    from .trainer import make_optimizer   # trainer imports this module
    mine = export_stage(run.stage.module, run.optimizer) if run.grid.replica == 0 else None
    pieces = [p for p in allgather_object(run.transport, mine) if p is not None]
    plan = replace(run.plan, stages=tuple(stages))
    module = cut(run.job.build_model(), *plan.stages[run.grid.stage])
    stage = PipelineStage(run.job, plan, run.grid, run.transport, module)
    optimizer = make_optimizer(stage.module, run.train)
    import_stage(stage.module, optimizer, pieces)
    run.plan, run.stage, run.optimizer = plan, stage, optimizer


TRUSTED_SHARE = 0.25    # of an even share of the nominal work


def speeds(stages: tuple, busy: list[float], base: list[float]) -> list[float]:
    """Seconds each stage's rank takes per nominal second of work. A stage with almost no
    work (an embedding alone) measures mostly fixed per-microbatch overhead, which says
    nothing about its machine: it gets the median speed of the stages that do work."""
    work = [sum(base[a:e]) for a, e in stages]
    raw = [b / max(w, 1e-12) for w, b in zip(work, busy)]
    enough = [w >= TRUSTED_SHARE * sum(base) / len(stages) for w in work]
    trusted = sorted(f for f, ok in zip(raw, enough) if ok)
    typical = trusted[len(trusted) // 2] if trusted else 1.0
    return [f if ok else typical for f, ok in zip(raw, enough)]


def recut(stages: tuple, busy: list[float], base: list[float]) -> tuple[tuple, float]:
    """Boundaries minimising the predicted bottleneck, and that bottleneck."""
    f = speeds(stages, busy, base)
    new = partition(len(base), len(stages), lambda a, b, s: f[s] * sum(base[a:b]))
    return new, max(f[s] * sum(base[a:b]) for s, (a, b) in enumerate(new))


class Balancer:
    """Slows this rank if asked (fault injection) and, with ``planner.rebalance``, moves
    the stage boundaries. ``after_step`` is called by every rank after every step."""

    def __init__(self, run, cfg: PlannerConfig):
        self.cfg, self.factor = cfg, slow_factor(run.world.rank, run.world.host)
        slow_down(run.stage.module, self.factor)
        self.base = None
        if cfg.rebalance and run.world.is_root and run.plan.pp > 1:
            self.base = list(measure_job(run.job, run.train, run.plan.microbatches).seconds)
        self.origin = run.step + cfg.rebalance_warmup   # windows count from here
        self.busy, self.above = 0.0, 0
        self.moves: list[dict] = []

    def after_step(self, run, metrics) -> None:
        if not self.cfg.rebalance or run.plan.pp == 1 or run.step <= self.origin:
            return
        self.busy += metrics.busy_time
        if (run.step - self.origin) % self.cfg.rebalance_window:
            return
        rows = allgather_object(run.transport, (run.grid.stage, self.busy, self.base))
        self.busy = 0.0
        base = next(r[2] for r in rows if r[2] is not None)
        busy = [max(r[1] for r in rows if r[0] == s) for s in range(run.plan.pp)]
        imbalance = max(busy) / (sum(busy) / len(busy))
        self.above = self.above + 1 if imbalance > self.cfg.rebalance_threshold else 0
        if self.above < self.cfg.rebalance_patience:
            return
        self.above = 0
        new, predicted = recut(run.plan.stages, busy, base)
        if new == run.plan.stages or predicted > max(busy) * (1 - self.cfg.rebalance_min_gain):
            return
        started, old = time.perf_counter(), run.plan.stages
        move_stages(run, new)
        slow_down(run.stage.module, self.factor)
        self.origin = run.step + self.cfg.rebalance_warmup
        f = speeds(old, busy, base)
        predicted_imbalance = predicted / (sum(f[s] * sum(base[a:b]) for s, (a, b) in enumerate(new)) / len(new))
        self.moves.append(run.events.record(
            "rebalance", run.step, old=[a for a, _ in old], new=[a for a, _ in new],
            imbalance_before=imbalance, imbalance_predicted=predicted_imbalance,
            stage_busy=busy, speeds=f, cost_s=time.perf_counter() - started))
