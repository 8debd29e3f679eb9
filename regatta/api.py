"""The functions a training script calls (re-exported by ``regatta``)."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from elastic import command_line
from elastic.config import TrainConfig
from elastic.runtime.world import World
from elastic.training import Training


def config(sections: dict[str, type] | None = None, argv: list[str] | None = None,
           toml: str | None = None, flags: dict | None = None, defaults: dict | None = None) -> dict:
    """This program's configs from its command line: ``{"train": TrainConfig, **sections}``.
    ``sections`` maps a TOML table name to your own config dataclass; ``toml`` is the
    default config file; ``defaults`` your program's own defaults, e.g.
    ``{"train": {"accumulate": 2}}``. See elastic/command_line.py for the flags."""
    return command_line.parse(_program(), sections, argv, toml, flags, defaults)


def _program() -> str:
    return Path(sys.argv[0]).name or "train"


def fit(*, model, data, loss, optimizer=None, scheduler=None, scaler=None, evaluate=None,
        track: dict | None = None, loader: dict | None = None, config: dict | TrainConfig | None = None,
        name: str | None = None, callbacks: list | None = None) -> dict:
    """Train ``model`` on ``data`` elastically, on whatever world the launcher made.

    model      an nn.Module (or a function that builds one)
    data       a map-style torch Dataset (read through a DataLoader driven by the elastic
               sampler), or a tuple of tensors indexed along dim 0
    loss       loss(model, batch) -> mean loss, or (summed loss, number of terms)
    optimizer  an Optimizer over model.parameters(), a factory params -> Optimizer, or
               None for ``train.optimizer``; scheduler: an LR scheduler or a factory
               optimizer -> scheduler; scaler: a GradScaler (one is made for fp16)
    evaluate   evaluate(model) -> {"metric": value}, run on rank 0 every
               ``train.eval_every`` steps (logged) and at the end (in the result)
    track      more objects with state_dict/load_state_dict to commit and restore
    loader     DataLoader keyword arguments (collate_fn, prefetch_factor, ...)
    config     ``regatta.config()``'s dict, or a TrainConfig; None parses the command line

    Returns rank 0's result (final step, parameter hash, metrics); other ranks' own.
    """
    configs = _configs(config)
    training = Training(name=name or Path(sys.argv[0]).stem or "train", model=model, data=data,
                        loss=loss, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                        evaluate=evaluate, track=dict(track or {}), loader=dict(loader or {}))
    from elastic.train import train as run_training  # the runtime (Horovod) only when training starts
    return run_training(training, configs, callbacks)


def train(job, config: dict | TrainConfig | None = None, callbacks: list | None = None) -> dict:
    """Train a ``Job`` (build_model, train_data, loss_sum, evaluate; see jobs/digits.py),
    pipelined when ``config["pipeline"]`` asks for it."""
    from elastic.train import train as run_training
    return run_training(job, _configs(config), callbacks)


def _configs(given) -> dict:
    if given is None:
        return command_line.parse(_program())
    return {"train": given} if isinstance(given, TrainConfig) else dict(given)


def log(values: dict, step: int | None = None) -> None:
    """Store custom scalars (``{"val/accuracy": 0.93}``) for the run page's charts, from
    any rank, during ``fit``/``train``; ``step`` defaults to the current step."""
    from elastic.runtime import worker
    runtime = worker.current()
    runtime.log(values, runtime.step if step is None else step)


@dataclass(frozen=True)
class Context:
    run_id: str
    step: int       # optimizer steps done (the one in progress is step + 1)
    world: World    # this generation's topology (rank, size, host, slot); changes on a reset


def context() -> Context:
    """Where training stands, for user code running inside ``fit``/``train``."""
    from elastic.runtime import worker
    runtime = worker.current()
    return Context(run_id=runtime.run_id, step=runtime.step, world=runtime.world)
