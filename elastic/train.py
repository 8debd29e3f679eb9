"""The one entry every job and user script trains through: pick the engine the config
asks for and run it inside the worker runtime.

    from elastic.train import train
    train(job, {"train": TrainConfig(...), "pipeline": PipelineConfig(pp=2), ...})

A ``[pipeline]`` section with ``pp > 1`` (or ``engine = "pipeline"``) selects the pipeline
engine; anything else is data parallel. The same call serves one process, ``mpirun`` and
``horovodrun`` (elastic); see elastic/runtime/worker.py.
"""
from __future__ import annotations

from dataclasses import asdict, is_dataclass

from elastic.dataparallel.engine import DataParallelEngine
from elastic.runtime import worker
from elastic.runtime.env import Env
from elastic.training import Training, from_job


def choose_engine(job, configs: dict, env: Env):
    pipe = configs.get("pipeline")
    if pipe is not None and pipe.pipelined:
        from elastic.pipeline.engine import PipelineEngine   # imports mpi4py, torch.distributed
        return PipelineEngine(job, configs["train"], pipe, configs.get("planner"), env)
    return DataParallelEngine(job if isinstance(job, Training) else from_job(job), configs["train"])


def train(job, configs: dict, callbacks: list | None = None, env: Env | None = None) -> dict:
    """Train ``job`` to ``configs["train"].steps``. ``configs``: one config object per
    section (``train`` required), all stored with the run; ``callbacks``: functions of
    each step's record (identity, timings, loss; see runtime/reporting.py)."""
    env = env or Env.read()
    stored = {name: asdict(cfg) if is_dataclass(cfg) else cfg for name, cfg in configs.items()}
    return worker.train(choose_engine(job, configs, env), configs["train"], job.name, stored,
                        env, callbacks)
