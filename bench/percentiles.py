"""Nearest-rank percentiles for the benches' distributions (p50, p95, max)."""
from __future__ import annotations


def percentile(values: list[float], q: float) -> float:
    """The value at quantile ``q`` (0..1) of ``values``, nearest rank: one of the values."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]
