"""Every training script's command line: an optional TOML config plus flag overrides.

    python train.py --steps 400 --lr 0.01 --set model.layers=4 --config my.toml

``--config`` names a TOML file with one table per section; the ``[train]`` keys have
their own flags (launchers such as ``regatta local`` pass ``--run-dir``, ``--steps``,
``--commit-every`` and ``--no-progress``); ``--set section.key=value`` reaches anything.
Unknown keys and bad values stop the program with status 2 and a message naming them.
"""
from __future__ import annotations

import argparse
import sys

from .config import ConfigError, TrainConfig, load, parse_overrides

# Flags that override [train] keys directly; anything else goes through --set.
TRAIN_FLAGS = {"steps": int, "global_batch": int, "lr": float, "commit_every": str,
               "checkpoint_every": int, "checkpoint_dir": str, "run_dir": str, "db": str,
               "ingest": str, "seed": int, "eval_every": int, "resume": str, "device": str,
               "accumulate": int}


def parse(prog: str, sections: dict[str, type] | None = None, argv: list[str] | None = None,
          toml: str | None = None, flags: dict[str, tuple[str, type]] | None = None,
          defaults: dict[str, dict] | None = None) -> dict:
    """One config dataclass per section (``train`` is always there), or exit with status 2
    naming the problem. ``toml``: the default config file; ``flags`` adds shortcuts, e.g.
    ``{"pp": ("pipeline.pp", int)}`` for ``--pp 2``; ``defaults``: the program's own
    defaults (``{"train": {"accumulate": 2}}``), below the file and the flags."""
    sections, flags = dict(sections or {}), flags or {}
    parser = argparse.ArgumentParser(prog=prog, description=f"Train {prog}.")
    parser.add_argument("--config", default=toml, help="TOML file (default: %(default)s)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override any config value, e.g. --set model.layers=4")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    for name, kind in TRAIN_FLAGS.items():
        parser.add_argument("--" + name.replace("_", "-"), dest=name, default=None,
                            metavar=kind.__name__.upper(), help=f"train.{name}")
    for name, (target, kind) in flags.items():
        parser.add_argument("--" + name.replace("_", "-"), dest="flag_" + name, default=None,
                            metavar=kind.__name__.upper(), help=target)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        overrides = parse_overrides(args.set)
        train = overrides.setdefault("train", {})
        train.update({k: getattr(args, k) for k in TRAIN_FLAGS if getattr(args, k) is not None})
        if args.no_progress:
            train["progress"] = "false"
        for name, (target, _) in flags.items():
            value = getattr(args, "flag_" + name)
            if value is not None:
                section, _, key = target.partition(".")
                overrides.setdefault(section, {})[key] = value
        return load(args.config, {"train": TrainConfig, **sections}, overrides, defaults)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        raise SystemExit(2)
