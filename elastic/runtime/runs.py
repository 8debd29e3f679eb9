"""Which run a worker belongs to, and the store's row that describes it.

Every launch is a new run: all its processes derive the same id from what the launcher
gave them (``Env.launch_key``), or take ``REGATTA_RUN_ID`` when a launcher chose one
(``regatta local``, ``regatta supervise`` across relaunches). ``train.resume`` continues
the run whose checkpoint is in the checkpoint folder instead, under that run's id.
"""
from __future__ import annotations

import hashlib
import itertools
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path

from ..whole_files import replace_text

from .env import Env


RUN_ID_FILE = "run_id"   # beside every checkpoint: which run it belongs to (resume auto)


def resumed_run_id(cfg) -> str:
    """The run id ``train.resume`` continues, or "" for a new run."""
    if cfg.resume != "auto":
        return cfg.resume
    marker = cfg.checkpoint_path.parent / RUN_ID_FILE
    try:
        run_id = marker.read_text().strip()
    except FileNotFoundError:
        raise FileNotFoundError(f"train.resume = 'auto', but {marker} does not exist on this host "
                                f"(no checkpoint was written there): pass the run id to continue "
                                f"(the dashboard and the first log line show it)") from None
    if not run_id:
        raise ValueError(f"train.resume = 'auto', but {marker} is empty: pass the run id to "
                         f"continue (the dashboard and the first log line show it)")
    return run_id


def mark_checkpoint_folder(folder: Path, run_id: str) -> None:
    """Say which run the checkpoint folder belongs to (``train.resume = auto``). Written
    whole or not at all: a job killed while writing it must still resume."""
    marker = folder / RUN_ID_FILE
    try:
        if marker.read_text() == run_id:
            return
    except FileNotFoundError:
        pass
    replace_text(marker, run_id)


def run_name(target: str) -> str:
    """The part of a run id that names what ran: a job or module name as it is, a script
    path by its stem (``examples/files_cnn.py`` -> ``files_cnn``). Letters, digits, ``_``,
    ``.`` and ``-`` only, so a run id is one URL path segment as it stands."""
    name = Path(target).stem if target.endswith(".py") or "/" in target else target
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip(".-") or "run"


_trainings = itertools.count()   # runs started by this process (every rank starts the same ones)


def new_run_id(job: str, env: Env) -> str:
    if env.run_id:
        return env.run_id
    key = env.launch_key or secrets.token_hex(8)   # a single process needs agree with nobody
    nth = next(_trainings)
    return f"{run_name(job)}-{hashlib.sha1(key.encode()).hexdigest()[:10]}" + (f"-{nth}" if nth else "")


def run_row(run_id: str, job: str, status: str, **fields) -> dict:
    """The store's row for a run. Later rows with the same id update only its status,
    finish time and error, so ``started_at`` matters only in the first one."""
    return {"type": "run", "id": run_id, "job": job, "status": status,
            "started_at": fields.pop("started_at", time.time()), **fields}


def code_revision(path: str | None = None) -> str | None:
    """The git commit of the code being run (``+dirty`` with uncommitted changes), or None
    outside a git checkout."""
    folder = Path(path or sys.argv[0] or ".").resolve()
    folder = folder if folder.is_dir() else folder.parent
    try:
        head = subprocess.run(["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=5)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(folder), "status", "--porcelain", "-uno"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "")


def open_sink(cfg, env: Env):
    """The metrics sink for this worker: HTTP ingest, else the store at ``train.db``."""
    # imported here: launchers name runs with this module and must not pay for SQLAlchemy
    from monitor.sink import make_sink
    db = cfg.db or str(Path(cfg.run_dir) / "metrics.db")   # db = "" still means this run only
    if not cfg.ingest and "://" not in db:
        Path(db).parent.mkdir(parents=True, exist_ok=True)
    return make_sink(db=None if cfg.ingest else db, ingest=cfg.ingest or None,
                     token=env.ingest_token)


def launcher_name(env: Env) -> str:
    return {"single": "local"}.get(env.launcher, env.launcher)


__all__ = ["new_run_id", "run_name", "run_row", "code_revision", "open_sink", "launcher_name"]
