"""The ``[pipeline]`` config section and the plan it makes on a given world.

``PipelineConfig`` checks what it can on its own (``__post_init__``); ``make_plan`` checks
it against the world size and the model's number of children, because those are known
only at launch. Every error is a :class:`ConfigError` that names the offending values.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from elastic.config import ConfigError

SCHEDULES = ("gpipe", "1f1b")
TRANSPORTS = ("auto", "mpi", "gloo")
ENGINES = ("auto", "pipeline")


@dataclass
class PipelineConfig:
    pp: int = 1                  # pipeline stages per replica (1: plain data parallel)
    dp: int = 0                  # replicas; 0 = world size / pp
    schedule: str = "1f1b"       # gpipe | 1f1b
    microbatches: int = 4        # per replica per optimizer step
    boundaries: list = field(default_factory=list)  # child index where each stage starts; [] = balanced
    transport: str = "auto"      # auto (mpi under mpirun, gloo under horovodrun) | mpi | gloo
    engine: str = "auto"         # auto: pipeline trainer when pp > 1, else elastic data parallel;
                                 # pipeline: always (the supervisor's re-plan onto fewer slots
                                 # than stages resumes a pipeline checkpoint with pp = 1)

    def __post_init__(self) -> None:
        if isinstance(self.boundaries, str):   # --boundaries 0,3 or --set pipeline.boundaries=0,3
            text = self.boundaries.strip().strip("[]")
            try:
                self.boundaries = [int(v) for v in text.split(",") if v.strip()]
            except ValueError:
                raise ConfigError(f"pipeline.boundaries must be integers like 0,3; got {text!r}") from None
        if not isinstance(self.boundaries, list) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in self.boundaries):
            raise ConfigError(f"pipeline.boundaries must be a list of integers, got {self.boundaries!r}")
        if self.pp < 1:
            raise ConfigError(f"pipeline.pp must be >= 1, got {self.pp}")
        if self.dp < 0:
            raise ConfigError(f"pipeline.dp must be >= 0 (0 = world size / pp), got {self.dp}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"pipeline.schedule must be one of {', '.join(SCHEDULES)}, "
                              f"got {self.schedule!r}")
        if self.microbatches < 1:
            raise ConfigError(f"pipeline.microbatches must be >= 1, got {self.microbatches}")
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"pipeline.transport must be one of {', '.join(TRANSPORTS)}, "
                              f"got {self.transport!r}")
        if self.engine not in ENGINES:
            raise ConfigError(f"pipeline.engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.boundaries and len(self.boundaries) != self.pp:
            raise ConfigError(f"pipeline.boundaries {self.boundaries} lists {len(self.boundaries)} "
                              f"stage starts but pipeline.pp is {self.pp}")


    @property
    def pipelined(self) -> bool:
        return self.pp > 1 or self.engine == "pipeline"


@dataclass(frozen=True)
class Plan:
    """What every rank agrees on: the grid shape and each stage's children [start, end)."""
    pp: int
    dp: int
    schedule: str
    microbatches: int
    stages: tuple          # ((start, end), ...) one per stage, contiguous, covering all children
    microbatch_size: int   # samples per microbatch (every microbatch has the same shape)

    @property
    def size(self) -> int:
        return self.pp * self.dp


def balanced_starts(children: int, pp: int) -> list[int]:
    """Contiguous groups whose sizes differ by at most one; the earlier stages get the
    extra child (stage 0 also embeds, the last stage also computes the loss)."""
    base, extra = divmod(children, pp)
    starts, at = [], 0
    for stage in range(pp):
        starts.append(at)
        at += base + (1 if stage < extra else 0)
    return starts


def stage_ranges(children: int, pp: int, boundaries: list[int]) -> tuple:
    if pp > children:
        raise ConfigError(f"pipeline.pp = {pp} stages but the model has only {children} children "
                          f"(layers) to split")
    starts = list(boundaries) or balanced_starts(children, pp)
    if starts[0] != 0:
        raise ConfigError(f"pipeline.boundaries {starts} must start at 0 (stage 0 begins with child 0)")
    ends = starts[1:] + [children]
    for stage, (start, end) in enumerate(zip(starts, ends)):
        if not start < end:
            raise ConfigError(f"pipeline.boundaries {starts} give stage {stage} no layers "
                              f"(children {start}..{end - 1}); starts must strictly increase "
                              f"and stay below the model's {children} children")
    return tuple(zip(starts, ends))


def make_plan(cfg: PipelineConfig, world_size: int, children: int, global_batch: int) -> Plan:
    """Check ``cfg`` against this world and model; return the plan or raise ConfigError."""
    stages = stage_ranges(children, cfg.pp, cfg.boundaries)
    if cfg.pp > world_size:
        raise ConfigError(f"pipeline.pp = {cfg.pp} stages but the world has only {world_size} "
                          f"ranks (each stage needs its own rank)")
    if world_size % cfg.pp:
        raise ConfigError(f"world size {world_size} is not divisible by pipeline.pp = {cfg.pp}")
    dp = cfg.dp or world_size // cfg.pp
    if dp * cfg.pp != world_size:
        raise ConfigError(f"pipeline.dp = {cfg.dp} x pipeline.pp = {cfg.pp} = {dp * cfg.pp} "
                          f"ranks, but the world has {world_size}")
    # Equal microbatches keep every activation the same shape, so peers agree on buffer
    # shapes once instead of sending a header with every tensor.
    per_step = dp * cfg.microbatches
    if global_batch % per_step:
        raise ConfigError(f"train.global_batch = {global_batch} must be divisible by pipeline.dp x "
                          f"pipeline.microbatches = {dp} x {cfg.microbatches} = {per_step}")
    return Plan(pp=cfg.pp, dp=dp, schedule=cfg.schedule, microbatches=cfg.microbatches,
                stages=stages, microbatch_size=global_batch // per_step)
