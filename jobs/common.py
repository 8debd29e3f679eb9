"""Command line shared by every job: a TOML config plus flag overrides."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from elastic.config import ConfigError, TrainConfig, load, parse_overrides

# Flags that override [train] keys directly; anything else goes through --set.
TRAIN_FLAGS = {"steps": int, "global_batch": int, "lr": float, "commit_every": str,
               "checkpoint_every": int, "checkpoint_dir": str, "run_dir": str, "db": str,
               "ingest": str, "seed": int, "eval_every": int}


def parse(job_name: str, sections: dict[str, type], argv: list[str] | None = None,
          flags: dict[str, tuple[str, type]] | None = None) -> dict:
    """Parse the command line into one config dataclass per section (``train`` is always
    there), or exit with status 2 and a message naming the problem. ``flags`` adds
    shortcuts, e.g. ``{"pp": ("pipeline.pp", int)}`` for ``--pp 2``."""
    flags = flags or {}
    default = Path(__file__).with_name(f"{job_name}.toml")
    parser = argparse.ArgumentParser(prog=f"python -m jobs.{job_name}",
                                     description=f"Train the {job_name} job.")
    parser.add_argument("--config", default=str(default), help="TOML file (default: %(default)s)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override any config value, e.g. --set model.layers=4")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    for name, kind in TRAIN_FLAGS.items():
        parser.add_argument("--" + name.replace("_", "-"), dest=name, default=None,
                            metavar=kind.__name__.upper(), help=f"train.{name}")
    for name, (target, kind) in flags.items():
        parser.add_argument("--" + name.replace("_", "-"), dest="extra_" + name, default=None,
                            metavar=kind.__name__.upper(), help=target)
    args = parser.parse_args(argv)
    try:
        overrides = parse_overrides(args.set)
        train = overrides.setdefault("train", {})
        train.update({k: getattr(args, k) for k in TRAIN_FLAGS if getattr(args, k) is not None})
        if args.no_progress:
            train["progress"] = "false"
        for name, (target, _) in flags.items():
            value = getattr(args, "extra_" + name)
            if value is not None:
                section, _, key = target.partition(".")
                overrides.setdefault(section, {})[key] = value
        return load(args.config, {"train": TrainConfig, **sections}, overrides)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        raise SystemExit(2)
