"""The one read module: everything the dashboard, the API and tools ask a store for.

Mixed into Store, so ``store.series(...)``, ``store.runs()``, ``store.recoveries(run)``.
The work is done in monitor.series (step-metric series, imbalance, timeline, pipeline),
monitor.host_samples (CPU, memory and GPU per host over wall time), monitor.runs (the
runs list and its kept summary, events, user metrics, run editing, exports) and
monitor.recovery (what each failure cost, a pure function over events).
Every helper returns plain dicts and lists (JSON-ready; non-finite floats are the
caller's to drop, see webui's JSON provider).
"""
from __future__ import annotations

from typing import Iterator, Optional

from sqlalchemy.orm import Session

from monitor import host_samples as _hosts
from monitor import runs as _runs
from monitor import series as _series
from monitor.series import BY, MAX_POINTS, SERIES_METRICS

__all__ = ["Queries", "BY", "MAX_POINTS", "SERIES_METRICS"]


class Queries:
    """Mixed into Store; needs ``self.engine``."""

    # -- plumbing ------------------------------------------------------------------
    def all(self, stmt) -> list:
        """Every row of a Core statement, as tuples."""
        with self.engine.connect() as conn:
            return [tuple(row) for row in conn.execute(stmt)]

    def first(self, stmt) -> tuple:
        rows = self.all(stmt.limit(1))
        return rows[0] if rows else (None,) * len(stmt.selected_columns)

    def all_orm(self, stmt) -> list:
        """Every row of an ORM statement, as tuples of mapped objects."""
        with Session(self.engine) as session:
            return [tuple(row) for row in session.execute(stmt)]

    # -- runs ----------------------------------------------------------------------
    def runs(self, **filters) -> list[dict]:
        """Every run (or those matching ``filters``, see monitor.runs.runs), newest first."""
        return _runs.runs(self, **filters)["runs"]

    def runs_page(self, **filters) -> dict:
        """{"runs": [...], "total": n}: one page of the runs list."""
        return _runs.runs(self, **filters)

    def run(self, run_id: str, **kw) -> Optional[dict]:
        """One run with its summary, processes and hosts, or None if it is unknown."""
        return _runs.run(self, run_id, **kw)

    def count(self, kind: str, run_id: Optional[str] = None) -> int:
        """Number of stored rows of one type (``run``, ``step``, ``event``, ``host``, ``metric``)."""
        return _runs.count(self, kind, run_id)

    def edit_run(self, run_id: str, changes: dict) -> Optional[dict]:
        return _runs.edit_run(self, run_id, changes)

    def delete_run(self, run_id: str) -> bool:
        return _runs.delete_run(self, run_id)

    # -- events and what failures cost --------------------------------------------
    def events(self, run_id: str, kinds: Optional[list[str]] = None,
               since_id: Optional[int] = None) -> list[dict]:
        """The run's events in time order, ``detail`` decoded."""
        return _runs.events(self, run_id, kinds, since_id)

    def recoveries(self, run_id: str) -> list[dict]:
        """The run's recovery table (monitor.recovery.recoveries over its events)."""
        return _runs.run_recoveries(self, run_id)

    # -- series --------------------------------------------------------------------
    def series(self, run_id: str, metric: str, by: str = "rank", **kw) -> dict:
        """Per rank, process, host or the whole run; see monitor.series.series."""
        return _series.series(self, run_id, metric, by, **kw)

    def step_series(self, run_id: str, metric: str, by: str = "rank",
                    since_step: Optional[int] = None, max_points: int = MAX_POINTS) -> dict:
        """One series per rank (or per host) of a step metric, without wall times."""
        return _series.step_series(self, run_id, metric, by, since_step, max_points)

    def throughput(self, run_id: str, **kw) -> dict:
        """Samples per second per host and step: sum over the host's ranks."""
        return self.step_series(run_id, "samples_per_s", by="host", **kw)

    def comm_fraction(self, run_id: str, by: str = "rank", **kw) -> dict:
        return self.step_series(run_id, "comm_fraction", by=by, **kw)

    def bus_bandwidth(self, run_id: str, by: str = "rank", **kw) -> dict:
        """Effective bus bandwidth bytes*2(p-1)/p/comm_time in bytes/s, per rank and step."""
        return self.step_series(run_id, "bus_bandwidth", by=by, **kw)

    def imbalance(self, run_id: str, since_step: Optional[int] = None,
                  max_points: int = MAX_POINTS) -> dict:
        """Per step, max/median across ranks of step_time and compute_time."""
        return _series.imbalance(self, run_id, since_step, max_points)

    def timeline(self, run_id: str, since: Optional[int] = None,
                 max_points: int = MAX_POINTS) -> dict:
        return _series.timeline(self, run_id, since, max_points)

    def pipeline(self, run_id: str, max_points: int = MAX_POINTS) -> Optional[dict]:
        return _series.pipeline(self, run_id, max_points)

    def host_samples(self, run_id: str, since: Optional[float] = None,
                     max_points: int = MAX_POINTS) -> dict:
        """CPU %, memory and GPU per host over wall time; see monitor.host_samples."""
        return _hosts.host_samples(self, run_id, since, max_points)

    # -- user-logged metrics -------------------------------------------------------
    def metric_names(self, run_id: str) -> list[dict]:
        return _runs.metric_names(self, run_id)

    def metric_points(self, run_id: str, name: str, since_id: Optional[int] = None,
                      max_points: int = 2000) -> dict:
        return _runs.metric_points(self, run_id, name, since_id, max_points)

    # -- exports -------------------------------------------------------------------
    def export_rows(self, kind: str, run_id: Optional[str] = None
                    ) -> tuple[list[str], Iterator[tuple]]:
        return _runs.export_rows(self, kind, run_id)
