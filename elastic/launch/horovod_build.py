"""Whether the installed Horovod was built with Gloo, remembered per installed build.

horovodrun asks before every elastic launch (``horovod.common.util.gloo_built``), and
answers by importing its torch extension, all of torch, in a forked process: 1.5 s of CPU
on a quiet machine here, 4.9 s measured while the warm agents import torch beside it, on
every ``regatta local``, for a fact that changes only when Horovod is reinstalled. The
answer is kept in a small JSON file beside the Python environment, keyed by Horovod's
version and its extension's path, size and modification time; anything else (no
record, a foreign or corrupt one, another build, a folder we may not write) asks Horovod.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable

RECORD = "regatta-horovod-build.json"


def build_key() -> list[str]:
    """What identifies the installed build: its version and its torch extension files."""
    import horovod
    extensions = sorted(Path(horovod.__file__).parent.glob("torch/mpi_lib*.so"))
    return [horovod.__version__] + [f"{p}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in extensions]


def remembered(gloo_built: Callable[..., bool | None], folder: Path | None = None) -> Callable[..., bool | None]:
    """``gloo_built`` that asks Horovod only when ``folder`` holds no answer for this build."""
    record = Path(folder or sys.prefix) / RECORD

    def check(verbose: bool = False) -> bool | None:
        key = build_key()
        try:
            saved = json.loads(record.read_text())
            if isinstance(saved, dict) and saved.get("key") == key and isinstance(saved.get("gloo"), bool):
                return saved["gloo"]
        except (OSError, ValueError):
            pass
        built = gloo_built(verbose=verbose)
        if isinstance(built, bool) and len(key) > 1:     # an answer about a build that exists
            _write(record, {"key": key, "gloo": built})
        return built
    return check


def _write(record: Path, content: dict) -> None:
    """Atomically, readable by all (an unprivileged launch reads it), or not at all: a
    folder we may not write leaves Horovod asked every time."""
    try:
        handle, temporary = tempfile.mkstemp(dir=record.parent, prefix=record.name)
    except OSError:
        return
    try:
        os.fchmod(handle, 0o644)
        with os.fdopen(handle, "w") as out:
            json.dump(content, out)
        os.replace(temporary, record)
    except OSError:
        Path(temporary).unlink(missing_ok=True)
