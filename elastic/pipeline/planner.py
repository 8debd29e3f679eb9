"""Choose the dp x pp grid and stage boundaries from measured per-layer costs.

    regatta plan charlm --np 4 -- --config jobs/charlm_pipeline.toml
    python -m elastic.pipeline.planner charlm --np 4 --pp-max 4 --json -- --set model.layers=6

Cost model (what the planner minimises) for dp replicas x pp stages, m microbatches per
replica, stage s holding children [a_s, b_s):

    t_s = C(a_s, b_s) * u / batch + sent_s * u / batch / bandwidth + sends_s * latency
    T   = max_s t_s * (m + pp - 1) + max_s ring(P(a_s, b_s), dp)

with C the measured forward+backward seconds of those children on ``batch`` samples,
u = global_batch / (dp m) the samples of one microbatch (cost taken as linear in samples),
sent_s the bytes of the activation sent forward plus the gradient sent back, P the
stage's parameter bytes and ring(P, dp) = 2 (dp-1)/dp P / bandwidth + 2 (dp-1) latency
(a ring allreduce). Both GPipe and 1F1B take m + pp - 1 slots of the slowest stage per
step, which is the ``bottleneck x (m + pp - 1) / m`` of the whole-batch stage time.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
from torch import nn

from elastic.config import ConfigError


@dataclass
class PlannerConfig:
    """The ``[planner]`` config section: limits for the grid and the rebalancer's knobs."""
    pp_min: int = 1                  # fewest stages the planner may choose
    pp_max: int = 0                  # most stages (0: as many as ranks and children allow)
    bandwidth_gbps: float = 1.0      # assumed link bandwidth (activations and allreduce)
    latency_us: float = 50.0         # assumed per-message latency
    rebalance: bool = False          # move stage boundaries from measured stage times
    rebalance_threshold: float = 1.2   # act when max/mean stage busy time stays above this
    rebalance_window: int = 4        # steps summed per measurement (one collective per window)
    rebalance_patience: int = 2      # windows in a row above the threshold before acting
    rebalance_warmup: int = 4        # steps ignored at the start and after every move
    rebalance_min_gain: float = 0.1  # predicted bottleneck must fall by this fraction

    def __post_init__(self) -> None:
        checks = [(self.pp_min >= 1, f"planner.pp_min must be >= 1, got {self.pp_min}"),
                  (self.pp_max == 0 or self.pp_max >= self.pp_min,
                   f"planner.pp_max ({self.pp_max}) must be 0 or >= planner.pp_min ({self.pp_min})"),
                  (self.bandwidth_gbps > 0, f"planner.bandwidth_gbps must be > 0, got {self.bandwidth_gbps}"),
                  (self.latency_us >= 0, f"planner.latency_us must be >= 0, got {self.latency_us}"),
                  (self.rebalance_threshold > 1,
                   f"planner.rebalance_threshold must be > 1 (max/mean), got {self.rebalance_threshold}"),
                  (self.rebalance_window >= 1, f"planner.rebalance_window must be >= 1, got {self.rebalance_window}"),
                  (self.rebalance_patience >= 1,
                   f"planner.rebalance_patience must be >= 1, got {self.rebalance_patience}"),
                  (self.rebalance_warmup >= 0, f"planner.rebalance_warmup must be >= 0, got {self.rebalance_warmup}"),
                  (0 <= self.rebalance_min_gain < 1,
                   f"planner.rebalance_min_gain must be in [0, 1), got {self.rebalance_min_gain}")]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    @property
    def bandwidth(self) -> float:
        return self.bandwidth_gbps * 1e9

    @property
    def latency(self) -> float:
        return self.latency_us * 1e-6


@dataclass(frozen=True)
class LayerCosts:
    seconds: tuple          # forward+backward of each child on `batch` samples
    param_bytes: tuple      # parameter bytes of each child
    out_bytes: tuple        # bytes of each child's output on `batch` samples
    batch: int
    names: tuple = ()

    def __len__(self) -> int:
        return len(self.seconds)


@dataclass(frozen=True)
class Candidate:
    dp: int
    pp: int
    microbatches: int
    stages: tuple = ()           # ((start, end), ...) when feasible
    step_time: float = math.inf  # predicted seconds per optimizer step
    slot_time: float = 0.0       # slowest stage's seconds per microbatch (forward+backward)
    allreduce: float = 0.0       # predicted gradient allreduce seconds
    reason: str = ""             # why not feasible ("" when it is)

    @property
    def feasible(self) -> bool:
        return not self.reason


# -- contiguous partition ----------------------------------------------------------------
def partition(n: int, pp: int, cost: Callable[[int, int, int], float]) -> tuple:
    """Split children 0..n-1 into ``pp`` contiguous non-empty stages minimising the largest
    ``cost(start, end, stage)``; among optimal splits, the smallest sum of squared stage
    costs (the most even), and on exact ties the one whose later stages start last."""
    if not 1 <= pp <= n:
        raise ConfigError(f"cannot split {n} children into {pp} non-empty stages")
    best = [[math.inf] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = 0.0
    for k in range(1, pp + 1):
        for i in range(k, n - (pp - k) + 1):
            best[k][i] = min(max(best[k - 1][j], cost(j, i, k - 1)) for j in range(k - 1, i))
    bound = best[pp][n] * (1 + 1e-9)
    squares = [[math.inf] * (n + 1) for _ in range(pp + 1)]
    start = [[0] * (n + 1) for _ in range(pp + 1)]
    squares[0][0] = 0.0
    for k in range(1, pp + 1):
        for i in range(k, n - (pp - k) + 1):
            for j in range(k - 1, i):
                c = cost(j, i, k - 1)
                value = squares[k - 1][j] + c * c
                if c <= bound and value <= squares[k][i] * (1 + 1e-12):
                    squares[k][i], start[k][i] = value, j
    stages, end = [], n
    for k in range(pp, 0, -1):
        stages.append((start[k][end], end))
        end = start[k][end]
    return tuple(reversed(stages))


# -- predictions ---------------------------------------------------------------------------
def ring(nbytes: float, dp: int, cfg: PlannerConfig) -> float:
    return 0.0 if dp == 1 else 2 * (dp - 1) / dp * nbytes / cfg.bandwidth + 2 * (dp - 1) * cfg.latency


def slot_cost(costs: LayerCosts, a: int, b: int, micro: float, cfg: PlannerConfig) -> float:
    """Seconds stage [a, b) spends on one microbatch of ``micro`` samples, sends included."""
    scale = micro / costs.batch
    sent = (costs.out_bytes[b - 1] if b < len(costs) else 0) + (costs.out_bytes[a - 1] if a else 0)
    sends = (b < len(costs)) + (a > 0)
    return sum(costs.seconds[a:b]) * scale + sent * scale / cfg.bandwidth + sends * cfg.latency


def predict(costs: LayerCosts, dp: int, m: int, stages: tuple, global_batch: int,
            cfg: PlannerConfig) -> Candidate:
    micro = global_batch / (dp * m)
    slot = max(slot_cost(costs, a, b, micro, cfg) for a, b in stages)
    reduce = max(ring(sum(costs.param_bytes[a:b]), dp, cfg) for a, b in stages)
    pp = len(stages)
    return Candidate(dp=dp, pp=pp, microbatches=m, stages=tuple(stages),
                     step_time=slot * (m + pp - 1) + reduce, slot_time=slot, allreduce=reduce)


def plan_grid(costs: LayerCosts, dp: int, pp: int, m: int, global_batch: int,
              cfg: PlannerConfig) -> Candidate:
    """The best boundaries for one grid shape, or the reason it cannot run."""
    if pp > len(costs):
        return Candidate(dp, pp, m, reason=f"pp = {pp} > {len(costs)} children")
    if global_batch % (dp * m):
        return Candidate(dp, pp, m, reason=f"global_batch {global_batch} not divisible by "
                                           f"dp x microbatches = {dp} x {m}")
    micro = global_batch / (dp * m)
    stages = partition(len(costs), pp, lambda a, b, s: slot_cost(costs, a, b, micro, cfg))
    return predict(costs, dp, m, stages, global_batch, cfg)


def candidates(costs: LayerCosts, world: int, global_batch: int, m: int,
               cfg: PlannerConfig) -> list[Candidate]:
    """Every grid that uses the whole world within the pp limits, fastest first."""
    top = min(world, cfg.pp_max or world)
    found = [plan_grid(costs, world // pp, pp, m, global_batch, cfg)
             for pp in range(cfg.pp_min, top + 1) if world % pp == 0]
    return sorted(found, key=lambda c: (not c.feasible, c.step_time, c.pp))


def choose(costs: LayerCosts, world: int, global_batch: int, m: int, cfg: PlannerConfig) -> Candidate:
    found = candidates(costs, world, global_batch, m, cfg)
    if not found or not found[0].feasible:
        why = "; ".join(f"dp={c.dp} pp={c.pp}: {c.reason}" for c in found) or "no pp divides it"
        raise ConfigError(f"no grid fits world size {world} with planner.pp_min = {cfg.pp_min}, "
                          f"planner.pp_max = {cfg.pp_max}: {why}")
    return found[0]


# -- measurement ---------------------------------------------------------------------------
def measure_layer_costs(model: nn.Sequential, inputs: torch.Tensor,
                        loss_fn: Callable[[torch.Tensor], torch.Tensor], repeats: int = 3) -> LayerCosts:
    """Median forward+backward seconds of each child on ``inputs`` (after one warm-up);
    the last child's time includes ``loss_fn`` of its output."""
    x, seconds, out_bytes = inputs, [], []
    for index, child in enumerate(model):
        last = index == len(model) - 1
        times = []
        for _ in range(repeats + 1):
            xin = x.detach().requires_grad_(x.is_floating_point())
            started = time.perf_counter()
            out = child(xin)
            torch.autograd.backward(loss_fn(out) if last else out, None if last else torch.ones_like(out))
            times.append(time.perf_counter() - started)
        seconds.append(statistics.median(times[1:]))
        out_bytes.append(out.numel() * out.element_size())
        x = out.detach()
    model.zero_grad(set_to_none=True)
    params = tuple(sum(p.numel() * p.element_size() for p in c.parameters()) for c in model)
    return LayerCosts(seconds=tuple(seconds), param_bytes=params, out_bytes=tuple(out_bytes),
                      batch=len(inputs), names=tuple(type(c).__name__ for c in model))


def measure_job(job, train, microbatches: int, repeats: int = 3) -> LayerCosts:
    """Layer costs of ``job``'s model on one dp = 1 microbatch of its training data."""
    torch.manual_seed(train.seed)
    model = job.build_model()
    size = max(1, train.global_batch // microbatches)
    batch = tuple(t[:size] for t in job.train_data())
    return measure_layer_costs(model, job.pipeline_input(batch),
                               lambda out: job.pipeline_loss(out, batch), repeats)


# -- regatta plan --------------------------------------------------------------------------
def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="choose the dp x pp grid and stage boundaries for a "
                                           "world size from measured layer costs")
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", help="a job under jobs/ (e.g. charlm), a module or a script path")
    p.add_argument("--np", type=int, required=True, help="world size (ranks) to plan for")
    p.add_argument("--pp-min", type=int, default=None, help="fewest stages (default: [planner])")
    p.add_argument("--pp-max", type=int, default=None, help="most stages (default: [planner])")
    p.add_argument("--microbatches", type=int, default=None, help="default: [pipeline]")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per layer (median)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(job_args=[])   # what follows `--` goes to the job (config, --set ...)


def main(args: argparse.Namespace) -> int:
    """Measure the job's layers, rank every grid for ``--np`` ranks and print them."""
    if args.np < 1:
        raise ConfigError(f"--np must be >= 1, got {args.np}")
    from elastic.launch.target import Target, TargetError
    target = Target.parse(args.job)
    pipeline_job = target.load().get("pipeline_job")
    if pipeline_job is None:
        raise TargetError(f"{target.value} defines no pipeline_job(argv) -> (job, train, pipeline, "
                          f"planner configs), which regatta plan needs (see jobs/charlm.py)")
    job, train, pipe, cfg = pipeline_job(list(args.job_args))
    overrides = {k: v for k, v in (("pp_min", args.pp_min), ("pp_max", args.pp_max)) if v is not None}
    cfg = PlannerConfig(**{**asdict(cfg), **overrides})
    m = args.microbatches or pipe.microbatches
    torch.set_num_threads(1)   # one rank's share of a core, as in training on a shared box
    costs = measure_job(job, train, m, args.repeats)
    found = candidates(costs, args.np, train.global_batch, m, cfg)
    if args.json:
        print(json.dumps({"costs": asdict(costs), "candidates": [
            {**asdict(c), "step_time": c.step_time if c.feasible else None} for c in found]}, indent=1))
    else:
        print(report(costs, found, args.np, train.global_batch))
    return 0 if found and found[0].feasible else 2


def report(costs: LayerCosts, found: list[Candidate], world: int, global_batch: int) -> str:
    lines = [f"layer costs (forward+backward on {costs.batch} samples, one thread):",
             "  child  module                 ms   params MB   output KB"]
    for i, (name, s, p, o) in enumerate(zip(costs.names, costs.seconds, costs.param_bytes,
                                            costs.out_bytes)):
        lines.append(f"  {i:5d}  {name:<18} {s * 1e3:6.2f}   {p / 2**20:9.3f}   {o / 2**10:9.1f}")
    lines += ["", f"grids for {world} ranks, global batch {global_batch} (fastest first):",
              "  dp  pp   m   step ms   slot ms   allreduce ms   stage starts"]
    for rank, c in enumerate(found):
        if not c.feasible:
            lines.append(f"  {c.dp:2d}  {c.pp:2d}  {c.microbatches:2d}   infeasible: {c.reason}")
            continue
        mark = "  <- chosen" if rank == 0 else ""
        lines.append(f"  {c.dp:2d}  {c.pp:2d}  {c.microbatches:2d}  {c.step_time * 1e3:8.2f}  "
                     f"{c.slot_time * 1e3:8.3f}  {c.allreduce * 1e3:13.3f}   "
                     f"{[a for a, _ in c.stages]}{mark}")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m elastic.pipeline.planner", description=__doc__)
    add_arguments(parser)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    namespace = parser.parse_args(argv[:cut])
    namespace.job_args = argv[cut + 1:]
    try:
        sys.exit(main(namespace))
    except ConfigError as err:
        print(f"regatta plan: error: {err}", file=sys.stderr)
        sys.exit(2)
