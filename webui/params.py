"""Query-string checking for the read API: every bad value is a 400 that names it.

    args = Params(request.args, allowed=("metric", "by"))   # unknown names -> BadParam
    metric = args.choice("metric", SERIES_METRICS, default="step_time")
"""
from __future__ import annotations

import re
from typing import Iterable, Optional

_KIND = re.compile(r"^[a-z_]{1,40}$")


class BadParam(ValueError):
    """A query parameter the API refuses; ``name`` is the parameter."""

    def __init__(self, name: str, message: str):
        super().__init__(f"parameter '{name}': {message}")
        self.name = name


class Params:
    """Typed access to request.args that refuses unknown and repeated parameters."""

    def __init__(self, args, allowed: Iterable[str]):
        self.args = args
        allowed = tuple(allowed)
        for name in args:
            if name not in allowed:
                raise BadParam(name, f"unknown parameter; expected one of {list(allowed)}")
            if len(args.getlist(name)) > 1:
                raise BadParam(name, "given more than once")

    def integer(self, name: str, default: Optional[int] = None, lo: Optional[int] = None,
                hi: Optional[int] = None) -> Optional[int]:
        raw = self.args.get(name)
        if raw is None or raw == "":
            return default
        try:
            value = int(raw)
        except ValueError:
            raise BadParam(name, f"must be an integer, got {raw!r}") from None
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise BadParam(name, f"must be between {lo} and {hi}, got {value}")
        return value

    def choice(self, name: str, choices: Iterable[str], default: str) -> str:
        raw = self.args.get(name, default)
        choices = tuple(choices)
        if raw not in choices:
            raise BadParam(name, f"must be one of {list(choices)}, got {raw!r}")
        return raw

    def kinds(self, name: str) -> Optional[list[str]]:
        """A comma-separated list of event kinds (lower-case words), or None."""
        raw = self.args.get(name)
        if not raw:
            return None
        kinds = [k.strip() for k in raw.split(",") if k.strip()]
        bad = [k for k in kinds if not _KIND.match(k)]
        if bad:
            raise BadParam(name, f"event kinds are lower-case words, got {bad[0]!r}")
        return kinds

    def run_ids(self, name: str) -> list[str]:
        """A comma-separated list of at least one run id."""
        ids = [r.strip() for r in (self.args.get(name) or "").split(",") if r.strip()]
        if not ids:
            raise BadParam(name, "give one or more run ids separated by commas")
        return ids
