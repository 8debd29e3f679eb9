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
  slow stage keeps it, but with fewer children. They are tried only if the predicted
  bottleneck falls by ``rebalance_min_gain`` and they were not tried before.
* Every window also records the step time under the boundaries in force. When another
  partition measured faster by ``rebalance_min_gain``, the boundaries go back to it (the
  model was wrong, e.g. stages sharing a busy core), and the model then waits twice as
  long before proposing again. Measured beats predicted: no flapping.

The move is in-process and exact: replica 0 of every stage contributes its parameters and
optimizer state (under the full model's key names, which grid.cut keeps), every rank
all-gathers them, builds its new children and loads them; training continues with
bitwise the same numbers as without the move. A ``rebalance`` event records the old and
new boundaries, the imbalance before, the predicted one after and the cost of the move.
Every rank holds the whole model's state briefly during a move.

``REGATTA_SLOW_RANKS=RANK:FACTOR[,...]`` (or ``regatta local --slow``'s host factors; the
runtime's Env reads both) slows a rank: after every child's forward and backward it sleeps
FACTOR - 1 times what that took, so its stage's busy time scales with its children, as on
a slower machine.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import replace

import torch
from torch import nn

from elastic.optim import make_optimizer

from .grid import cut
from .planner import PlannerConfig, measure_job, partition
from .stage import PipelineStage

SLOW_ENV = "REGATTA_SLOW_RANKS"
# A slowed first child whose input is token ids has its backward hook fire early (torch
# warns each time); slow_down accounts for that, so the warning says nothing new.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")


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
def export_stage(module: nn.Module, optimizer: torch.optim.Optimizer, copy: bool = True) -> dict:
    """A stage's parameters and optimizer state on the CPU, keyed by full-model names.
    ``copy=False``: the tensors themselves where already on the CPU (a stage that will not
    train again, kept for the next world)."""
    names = {id(p): n for n, p in module.named_parameters()}

    def take(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        return tensor.cpu().clone() if copy else tensor.cpu()

    return {"model": {k: take(v) for k, v in module.state_dict().items()},
            "optimizer": {names[id(p)]: {k: take(v) if torch.is_tensor(v) else v for k, v in s.items()}
                          for p, s in optimizer.state.items()}}


def import_stage(module: nn.Module, optimizer: torch.optim.Optimizer, pieces: list[dict]) -> None:
    """Load this module's children from the exported stages ``pieces`` (exactly)."""
    wanted = set(module.state_dict())
    model = {k: v for piece in pieces for k, v in piece["model"].items() if k in wanted}
    module.load_state_dict(model, strict=True)
    saved = {k: v for piece in pieces for k, v in piece["optimizer"].items()}

    def placed(key: str, value, device: torch.device):
        # Adam's "step" stays a CPU scalar; moments go where the parameter lives. Copies:
        # a piece may be this rank's commit, which training must not write into.
        if not torch.is_tensor(value):
            return value
        return value.clone() if key == "step" else value.to(device, copy=True)

    for name, param in module.named_parameters():
        if name in saved:
            optimizer.state[param] = {k: placed(k, v, param.device) for k, v in saved[name].items()}


def move_stages(run, stages: tuple) -> None:
    """Re-cut ``run`` to ``stages`` on the same ranks: all-gather replica 0's stage state,
    build this rank's new children, load them, rebuild its stage and optimizer."""
    mine = export_stage(run.stage.module, run.optimizer) if run.grid.replica == 0 else None
    pieces = [p for p in allgather_object(run.transport, mine) if p is not None]
    plan = replace(run.plan, stages=tuple(stages))
    module = cut(run.job.build_model(), *plan.stages[run.grid.stage])
    stage = PipelineStage(run.job, plan, run.grid, run.transport, module, run.stage.device)
    optimizer = make_optimizer(stage.module.parameters(), run.train)
    import_stage(stage.module, optimizer, pieces)
    run.plan, run.stage, run.optimizer = plan, stage, optimizer


TRUSTED_SHARE = 0.25    # of an even share of the nominal work


def speeds(stages: tuple, busy: list[float], base: list[float], seen: dict | None = None) -> list[float]:
    """Seconds each stage's rank takes per nominal second of work. ``seen`` (stage ->
    (work, speed)) remembers each rank's estimate from when it did the most work: a newer
    one replaces it when it covers at least half that work. A stage with almost no work
    (an embedding alone) measures mostly fixed per-microbatch overhead, not its machine:
    it gets the median speed of the stages that do work."""
    seen = {} if seen is None else seen
    for s, ((a, e), b) in enumerate(zip(stages, busy)):
        work = sum(base[a:e])
        if s not in seen or work >= seen[s][0] / 2:
            seen[s] = (work, b / max(work, 1e-12))
    enough = {s: w >= TRUSTED_SHARE * sum(base) / len(stages) for s, (w, _) in seen.items()}
    trusted = sorted(seen[s][1] for s in range(len(stages)) if enough[s])
    typical = trusted[len(trusted) // 2] if trusted else 1.0
    return [seen[s][1] if enough[s] else typical for s in range(len(stages))]


def recut(stages: tuple, busy: list[float], base: list[float],
          seen: dict | None = None) -> tuple[tuple, float, list[float]]:
    """Boundaries minimising the predicted bottleneck, that bottleneck, and the speeds."""
    f = speeds(stages, busy, base, seen)
    new = partition(len(base), len(stages), lambda a, b, s: f[s] * sum(base[a:b]))
    return new, max(f[s] * sum(base[a:b]) for s, (a, b) in enumerate(new)), f


class Balancer:
    """Slows this rank if asked (fault injection) and, with ``planner.rebalance``, moves
    the stage boundaries. ``after_step`` is called by every rank after every step; every
    rank takes the same decisions from the same all-gathered numbers."""

    def __init__(self, run, cfg: PlannerConfig, events, factor: float = 1.0,
                 base: list[float] | None = None):
        """``factor``: this rank's injected slowdown; ``base``: nominal child costs already
        measured (rank 0's are used), else rank 0 measures them now."""
        self.cfg, self.factor, self.events = cfg, factor, events
        slow_down(run.stage.module, self.factor)
        self.base = None
        if cfg.rebalance and run.world.is_root and run.plan.pp > 1:
            self.base = base or list(measure_job(run.job, run.train, run.plan.microbatches).seconds)
        self.origin = run.step + cfg.rebalance_warmup   # windows count from here
        self.busy, self.wall, self.above, self.misses = 0.0, 0.0, 0, 0
        self.seen: dict = {}        # stage -> (work, speed), see speeds()
        self.measured: dict = {}    # boundaries -> seconds per step, last window under them
        self.moves: list[dict] = []

    def after_step(self, run, metrics) -> None:
        if not self.cfg.rebalance or run.plan.pp == 1 or run.step <= self.origin:
            return
        self.busy += metrics.compute_time
        self.wall += metrics.step_time
        if (run.step - self.origin) % self.cfg.rebalance_window:
            return
        rows = allgather_object(run.transport, (run.grid.stage, self.busy, self.wall, self.base))
        self.busy = self.wall = 0.0
        base = next(r[3] for r in rows if r[3] is not None)
        busy = [max(r[1] for r in rows if r[0] == s) for s in range(run.plan.pp)]
        imbalance = max(busy) / (sum(busy) / len(busy))
        # Partitions are compared by what matters, the step time (stages that share cores
        # with other work can be balanced in busy time and still slower).
        self.measured[run.plan.stages] = max(r[2] for r in rows) / self.cfg.rebalance_window
        speeds(run.plan.stages, busy, base, self.seen)     # remember what this window says
        self.above = self.above + 1 if imbalance > self.cfg.rebalance_threshold else 0
        target = self._decide(run.plan.stages, busy, base)
        if target is not None:
            self._move(run, *target, imbalance=imbalance, busy=busy)

    def _decide(self, current: tuple, busy: list[float], base: list[float]):
        """(boundaries, reason, predicted imbalance) or None. Go back to a partition whose
        steps measured faster than this one's; else, once the imbalance has stayed high, try
        the model's best untried partition if it predicts a gain. Measured beats predicted,
        so boundaries never flap between partitions already tried, and each time the model
        was wrong it waits twice as many windows before it is trusted again."""
        keep = 1 - self.cfg.rebalance_min_gain
        best = min(self.measured, key=self.measured.get)
        if best != current and self.measured[best] < self.measured[current] * keep:
            self.misses += 1
            return best, "return to the fastest measured", None
        if self.above < self.cfg.rebalance_patience * 2 ** self.misses:
            return None
        self.above = 0
        new, predicted, f = recut(current, busy, base, self.seen)
        if new in self.measured or predicted > max(busy) * keep:
            return None
        times = [f[s] * sum(base[a:b]) for s, (a, b) in enumerate(new)]
        return new, "model", predicted / (sum(times) / len(times))

    def _move(self, run, new: tuple, reason: str, predicted, imbalance: float, busy: list) -> None:
        started, old = time.perf_counter(), run.plan.stages
        move_stages(run, new)
        slow_down(run.stage.module, self.factor)
        self.origin, self.busy, self.wall, self.above = run.step + self.cfg.rebalance_warmup, 0.0, 0.0, 0
        self.moves.append(self.events.record(
            "rebalance", run.step, old=[a for a, _ in old], new=[a for a, _ in new], reason=reason,
            imbalance_before=imbalance, imbalance_predicted=predicted, stage_busy=busy,
            step_time_before=self.measured[old],
            speeds=[self.seen[s][1] for s in sorted(self.seen)], cost_s=time.perf_counter() - started))
