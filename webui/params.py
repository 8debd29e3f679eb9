"""Query-string checking for the read API: every bad value is a 400 that names it.

    args = Params(request.args, allowed=("metric", "by"))   # unknown names -> BadParam
    metric = args.choice("metric", SERIES_METRICS, default="step_time")
"""
from __future__ import annotations

import math
import re
from typing import Iterable, Optional

_KIND = re.compile(r"^[a-z][a-z0-9_]{0,39}$")
INT64 = (-(1 << 63), (1 << 63) - 1)


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
                raise BadParam(name[:60], f"unknown parameter; expected one of {list(allowed)}")
            if len(args.getlist(name)) > 1:
                raise BadParam(name, "given more than once")

    def integer(self, name: str, default: Optional[int] = None, lo: Optional[int] = None,
                hi: Optional[int] = None) -> Optional[int]:
        raw = self.args.get(name)
        if raw is None or raw == "":
            return default
        if len(raw) > 24:
            raise BadParam(name, f"must be an integer, got {raw[:30]!r}...")
        try:
            value = int(raw)
        except ValueError:
            raise BadParam(name, f"must be an integer, got {raw!r}") from None
        lo = INT64[0] if lo is None else lo
        hi = INT64[1] if hi is None else hi
        if not lo <= value <= hi:
            raise BadParam(name, f"must be between {lo} and {hi}, got {value}")
        return value

    def number(self, name: str, lo: float, hi: float) -> Optional[float]:
        """A finite number between lo and hi (a wall time, say), or None when absent."""
        raw = self.args.get(name)
        if raw is None or raw == "":
            return None
        try:
            value = float(raw) if len(raw) <= 40 else None
        except ValueError:
            value = None
        if value is None or not math.isfinite(value):
            raise BadParam(name, f"must be a number, got {raw[:30]!r}")
        if not lo <= value <= hi:
            raise BadParam(name, f"must be between {lo:g} and {hi:g}, got {value:g}")
        return value

    def text(self, name: str, max_len: int) -> str:
        """A free-text parameter ("" when absent): at most max_len characters, no
        control characters."""
        raw = self.args.get(name) or ""
        if len(raw) > max_len or any(ord(c) < 32 or ord(c) == 127 for c in raw):
            raise BadParam(name, f"must be at most {max_len} characters without control "
                                 "characters")
        return raw

    def choice(self, name: str, choices: Iterable[str], default: str) -> str:
        raw = self.args.get(name, default)
        choices = tuple(choices)
        if raw not in choices:
            raise BadParam(name, f"must be one of {list(choices)}, got {raw[:60]!r}")
        return raw

    def kinds(self, name: str) -> Optional[list[str]]:
        """A comma-separated list of event kinds (lower-case words), or None."""
        raw = self.args.get(name)
        if not raw:
            return None
        kinds = [k.strip() for k in raw.split(",") if k.strip()]
        bad = [k for k in kinds if not _KIND.match(k)]
        if bad:
            raise BadParam(name, f"event kinds are lower-case words, got {bad[0][:60]!r}")
        return kinds

    def run_ids(self, name: str) -> list[str]:
        """A comma-separated list of at least one run id."""
        ids = [r.strip() for r in (self.args.get(name) or "").split(",") if r.strip()]
        if not ids:
            raise BadParam(name, "give one or more run ids separated by commas")
        return ids
