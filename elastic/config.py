"""Typed, validated configuration loaded from TOML with command-line overrides.

A job's TOML file has one table per dataclass section, e.g. ``[train]`` and ``[model]``.
Unknown keys and bad values raise :class:`ConfigError` naming the file, the key and the
value, so a typo never silently falls back to a default.
"""
from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass
from pathlib import Path


class ConfigError(ValueError):
    """A configuration value or key is wrong; the message names it."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


OPTIMIZERS = ("adam", "adamw", "sgd")
GRADIENT_SUMS = ("auto", "horovod", "gloo")   # who sums the buckets (dataparallel/gloo_sums.py)
RECOVER_FROM = ("live", "commit")     # where survivors take the state from (dataparallel/live.py)
STATE_TRANSFER = ("auto", "point_to_point", "broadcast")   # how a sync moves state (dataparallel/state.py)


@dataclass
class TrainConfig:
    steps: int = 200
    global_batch: int = 64          # samples per optimizer step, split across ranks
    lr: float = 1e-3
    optimizer: str = "adam"         # adam | adamw | sgd, when the job brings no optimizer
    accumulate: int = 1             # microsteps per optimizer step (gradient accumulation)
    clip_grad_norm: float = 0.0     # clip the global gradient norm to this (0: no clipping)
    autocast: str = ""              # "" | bf16 | fp16 (fp16 with a GradScaler, for CUDA)
    device: str = ""                # cpu | cuda (this rank's GPU) | cuda:N | auto; "" = cpu
    loader_workers: int = 2         # DataLoader worker processes for a Dataset (0: in-process)
    commit_every: int | str = 10    # steps between in-memory commits, or "auto" (Young/Daly)
    checkpoint_every: int = 5       # commits between durable checkpoints (0: never)
    recover_from: str = "live"      # live: survivors go on from their own state after a
                                    # failure; commit: every failure rolls back to the last commit
    state_transfer: str = "auto"    # auto | point_to_point | broadcast: how a sync moves CPU
                                    # state under Horovod on Gloo (auto: point to point from 64 MiB)
    checkpoint_dir: str = ""        # "" -> <run_dir>/checkpoint
    eval_every: int = 0             # steps between evaluations on rank 0, logged (0: only at end)
    seed: int = 0
    run_dir: str = "runs/latest"
    db: str = "runs/regatta.db"     # SQLite metrics store shared by every run here
    ingest: str = ""                # dashboard URL; when set, metrics are POSTed there
    progress: bool = True           # tqdm bar on rank 0
    stall_after: float = 5.0        # seconds without progress before a rank is a stall event
    resume: str = ""                # continue this run id from the checkpoint folder ("auto":
                                    # the run whose checkpoint is there); "" = a new run
    # Data-parallel gradient reduction (elastic/dataparallel/reduce.py)
    bucket_mb: float = 25.0         # gradients sent together, as Horovod's fusion threshold
                                    # (0: one collective per parameter)
    compression: str = "none"       # none | fp16: gradients on the wire as float16
    gradient_sums: str = "auto"     # auto | horovod | gloo: the buckets' sums over Horovod or
                                    # a torch.distributed Gloo group (dataparallel/gloo_sums.py)
    horovod_cycle_ms: float = 0.0   # Horovod's cycle (0: 5 training on the CPU, Horovod's 1
                                    # on a GPU; see runtime/collectives.py horovod_cycle_ms)

    def __post_init__(self) -> None:
        _require(self.steps > 0, f"train.steps must be > 0, got {self.steps}")
        _require(self.global_batch > 0, f"train.global_batch must be > 0, got {self.global_batch}")
        _require(self.lr > 0, f"train.lr must be > 0, got {self.lr}")
        _require(self.optimizer in OPTIMIZERS,
                 f"train.optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        _require(self.accumulate >= 1, f"train.accumulate must be >= 1, got {self.accumulate}")
        _require(self.clip_grad_norm >= 0, f"train.clip_grad_norm must be >= 0, got {self.clip_grad_norm}")
        _require(self.autocast in ("", "bf16", "fp16"),
                 f"train.autocast must be '', 'bf16' or 'fp16', got {self.autocast!r}")
        _require(self.loader_workers >= 0, f"train.loader_workers must be >= 0, got {self.loader_workers}")
        _require(self.commit_every == "auto" or (isinstance(self.commit_every, int)
                                                  and self.commit_every > 0),
                 f"train.commit_every must be a positive integer or 'auto', got {self.commit_every!r}")
        _require(self.recover_from in RECOVER_FROM,
                 f"train.recover_from must be one of {', '.join(RECOVER_FROM)}, got {self.recover_from!r}")
        _require(self.state_transfer in STATE_TRANSFER,
                 f"train.state_transfer must be one of {', '.join(STATE_TRANSFER)}, got {self.state_transfer!r}")
        _require(self.checkpoint_every >= 0,
                 f"train.checkpoint_every must be >= 0, got {self.checkpoint_every}")
        _require(self.eval_every >= 0, f"train.eval_every must be >= 0, got {self.eval_every}")
        _require(self.stall_after > 0, f"train.stall_after must be > 0, got {self.stall_after}")
        _require(self.bucket_mb >= 0, f"train.bucket_mb must be >= 0, got {self.bucket_mb}")
        _require(self.horovod_cycle_ms >= 0, f"train.horovod_cycle_ms must be >= 0, got {self.horovod_cycle_ms}")
        _require(self.gradient_sums in GRADIENT_SUMS,
                 f"train.gradient_sums must be one of {', '.join(GRADIENT_SUMS)}, got {self.gradient_sums!r}")
        _require(self.compression in ("none", "fp16"),
                 f"train.compression must be 'none' or 'fp16' (Horovod 0.28.1 has no bfloat16 "
                 f"allreduce), got {self.compression!r}")

    @property
    def fixed_commit_every(self) -> int | None:
        """The commit interval, or None when it is chosen at run time ("auto")."""
        return None if self.commit_every == "auto" else int(self.commit_every)

    @property
    def checkpoint_path(self) -> Path:
        base = Path(self.checkpoint_dir) if self.checkpoint_dir else Path(self.run_dir) / "checkpoint"
        return base / "state.pt"


def _coerce(value: typing.Any, kind: typing.Any, where: str) -> typing.Any:
    """Convert a TOML or command-line value to the field's type, or say why not."""
    if kind == (int | str):   # a count or a keyword such as "auto"
        text = str(value).strip()
        return int(text) if text.lstrip("-").isdigit() else value
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if kind in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        try:
            number = kind(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} must be {'an integer' if kind is int else 'a number'}, "
                              f"got {value!r}") from None
        if kind is int and isinstance(value, float) and value != number:
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return number
    if kind is str:
        if not isinstance(value, (str, int, float)):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return str(value)
    return value


def build(cls: type, values: dict, section: str, source: str = "config"):
    """Instantiate dataclass ``cls`` from ``values``, rejecting unknown keys by name."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{source}: [{section}] unknown key {unknown[0]!r}; "
                          f"known keys: {', '.join(sorted(known))}")
    try:
        kwargs = {k: _coerce(v, hints[k], f"{section}.{k}") for k, v in values.items()}
        return cls(**kwargs)
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None


def parse_overrides(pairs: list[str]) -> dict[str, dict[str, str]]:
    """``["train.lr=0.01", "model.layers=4"]`` -> ``{"train": {"lr": "0.01"}, ...}``."""
    tables: dict[str, dict[str, str]] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        section, dot, name = key.partition(".")
        if not sep or not dot or not section or not name:
            raise ConfigError(f"override {pair!r} must look like section.key=value")
        tables.setdefault(section, {})[name] = value
    return tables


def load(path: str | Path | None, sections: dict[str, type],
         overrides: dict[str, dict] | None = None, defaults: dict[str, dict] | None = None) -> dict:
    """Load TOML ``path`` (None: no file) into one dataclass per section; ``overrides``
    win over the file, which wins over ``defaults``, which win over the dataclasses'."""
    path = Path(path) if path is not None else Path("(command line)")
    try:
        raw = tomllib.loads(path.read_text()) if path.name != "(command line)" else {}
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None
    overrides, defaults = overrides or {}, defaults or {}
    unknown = sorted((set(raw) | set(overrides) | set(defaults)) - set(sections))
    if unknown:
        raise ConfigError(f"{path}: unknown table [{unknown[0]}]; known: {', '.join(sections)}")
    result = {}
    for name, cls in sections.items():
        table = raw.get(name, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: [{name}] must be a table")
        table = {**defaults.get(name, {}), **table, **overrides.get(name, {})}
        result[name] = build(cls, table, name, path.name)
    return result


__all__ = ["ConfigError", "TrainConfig", "OPTIMIZERS", "build", "load", "parse_overrides"]
