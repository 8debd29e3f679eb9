"""What a launcher starts in each worker: a job under jobs/, any module, or a script file.

    regatta local digits ...                 jobs.digits
    regatta local mypkg.train ...            the module mypkg.train
    regatta local path/to/train.py ...       the script at that path

A name with no dot or slash is a job under jobs/; one ending in ``.py`` or holding a slash
is a file; anything else is a module, as ``python -m`` takes it.
"""
from __future__ import annotations

import importlib
import importlib.util
import re
import runpy
from dataclasses import dataclass
from pathlib import Path


# A Horovod script (horovod.torch, or regatta.horovod in its place, imported at its top
# level) parses its own command line: Regatta's flags would be unknown to it, so they travel
# in REGATTA_ARGS instead. A Regatta job that imports horovod.torch inside a function (a
# bench's stock arm) takes Regatta's flags on its command line as any job does.
OWN_COMMAND_LINE = re.compile(r"^(import\s+(horovod\.torch|regatta\.horovod)\b"
                              r"|from\s+(horovod\.torch|regatta\.horovod)(\.\w+)*\s+import\b"
                              r"|from\s+(horovod|regatta)\s+import\s+.*\b(torch|horovod)\b)", re.M)


class TargetError(ValueError):
    """The thing to launch does not exist or is not launchable; the message names it."""


@dataclass(frozen=True)
class Target:
    kind: str      # module | file
    value: str     # a module name, or an absolute path

    @classmethod
    def parse(cls, text: str) -> "Target":
        if not text:
            raise TargetError("nothing to launch: give a job name, a module or a script path")
        if text.endswith(".py") or "/" in text:
            path = Path(text).resolve()
            if not path.is_file():
                raise TargetError(f"script {text} does not exist")
            return cls("file", str(path))
        return cls("module", text if "." in text else f"jobs.{text}")

    @classmethod
    def from_python_args(cls, args: list[str]) -> "Target":
        """The inverse of ``python_args``: ``["-m", MODULE]`` or ``[PATH]``."""
        return cls("module", args[1]) if args[0] == "-m" else cls("file", args[0])

    @property
    def name(self) -> str:
        """A short name for logs and progress bars."""
        return Path(self.value).stem if self.kind == "file" else self.value.rsplit(".", 1)[-1]

    @property
    def keeps_command_line(self) -> bool:
        """Whether it is a Horovod script (see OWN_COMMAND_LINE)."""
        if self.kind == "file":
            path = self.value
        else:
            spec = importlib.util.find_spec(self.value)
            path = spec.origin if spec is not None and spec.origin not in (None, "built-in") else None
        try:
            return path is not None and bool(OWN_COMMAND_LINE.search(Path(path).read_text()))
        except (OSError, UnicodeDecodeError):
            return False

    def python_args(self) -> list[str]:
        """What follows ``python`` to run it."""
        return ["-m", self.value] if self.kind == "module" else [self.value]

    def load(self) -> dict:
        """Its namespace, without running its ``__main__`` block (for ``regatta plan``)."""
        if self.kind == "module":
            try:
                return vars(importlib.import_module(self.value))
            except ModuleNotFoundError as err:
                raise TargetError(f"cannot import {self.value}: {err}") from None
        return runpy.run_path(self.value, run_name="__regatta_load__")

    def run(self) -> None:
        """Run it as ``__main__`` in this process (a warm agent's forked worker)."""
        if self.kind == "module":
            runpy.run_module(self.value, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(self.value, run_name="__main__")
