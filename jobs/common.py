"""Command line shared by every job: a TOML config plus flag overrides."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from elastic.config import ConfigError, TrainConfig, load, parse_overrides

# Flags that override [train] keys directly; anything else goes through --set.
TRAIN_FLAGS = {"steps": int, "global_batch": int, "lr": float, "commit_every": int,
               "checkpoint_every": int, "checkpoint_dir": str, "run_dir": str, "db": str,
               "ingest": str, "seed": int, "eval_every": int}


def parse(job_name: str, model_cls: type, argv: list[str] | None = None):
    """Returns (train config, model config) or exits with a message naming the problem."""
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
    args = parser.parse_args(argv)
    try:
        overrides = parse_overrides(args.set)
        train = overrides.setdefault("train", {})
        train.update({k: getattr(args, k) for k in TRAIN_FLAGS if getattr(args, k) is not None})
        if args.no_progress:
            train["progress"] = "false"
        sections = load(args.config, {"train": TrainConfig, "model": model_cls}, overrides)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        raise SystemExit(2)
    return sections["train"], sections["model"]
