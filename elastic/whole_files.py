"""Files other processes read at any instant, written whole or not at all."""
from __future__ import annotations

import os
from pathlib import Path


def replace_text(path: Path | str, text: str) -> None:
    """Write ``path`` whole or not at all: a draft beside it, renamed over it. A reader (or
    a process started after this one was killed) finds the old text or the new, never a
    truncated file. One writer per path: the draft's name is fixed, so a killed writer's
    draft is overwritten by the next, not left behind."""
    path = Path(path)
    draft = path.with_name(f"{path.name}.draft")
    draft.write_text(text)
    os.replace(draft, path)
