"""A rank's hand-off: its part of the last commit, left where the worker that replaces it
in place finds it (restart.py says where, and how the agent and the replacement read the
description beside it; recovery.py says when it goes out and is withdrawn).
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

from . import restart


class Handoff:
    """This rank's commit, left for the worker that may replace it while the world
    re-forms. The description (its slot) goes first and at once: it is what tells the
    agent that an abort now is Gloo's, not a death; it says ``placed`` from the moment the
    driver has given this slot its place (before that, only a removal aborts a worker).
    The commit is written beside it in the background, overlapping the rendezvous; a
    replacement that finds no commit (an abort before it was written) joins stateless,
    and the sync takes the bytes from the others."""

    def __init__(self, path: Path, state, predecessor: Path | None = None,
                 placed: bool = False, step: int | None = None) -> None:
        self.path, self.step = path, step   # the step of the commit it hands over
        self._lock = threading.Lock()   # a description never outlives the withdrawal
        self._withdrawn = False
        self.describe(restart.current_slot(), placed)
        if predecessor is not None:
            for mine, theirs in zip(restart.handoff_files(path), restart.handoff_files(predecessor)):
                if theirs.exists() and mine.suffix != ".json":
                    os.replace(theirs, mine)
                theirs.unlink(missing_ok=True)
        self._writer = threading.Thread(target=self._write, args=(state,),
                                        name="regatta-handoff", daemon=True)
        self._writer.start()

    def describe(self, slot: int, placed: bool = False) -> None:
        with self._lock:
            if not self._withdrawn:
                restart.describe_handoff(self.path, slot, placed, self.step)

    def _write(self, state) -> None:
        if state is not None:
            state.write_handoff(self.path)

    def written(self) -> bool:
        """Waits for the commit's write; whether there is one."""
        self._writer.join()
        return self.path.exists()

    def withdraw(self) -> None:
        with self._lock:
            self._withdrawn = True
        self._writer.join()
        for leftover in restart.handoff_files(self.path):
            leftover.unlink(missing_ok=True)
