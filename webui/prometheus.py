"""``GET /metrics``: the store's live numbers in Prometheus' text exposition format, for
those who already run Prometheus and Grafana. Runs that are running, or ended within the
last hour, are exported; everything comes from the kept summaries (monitor.rollup) and the
recovery tables, never from a scan of the step rows.

    regatta_runs{status}                         runs in the store by status
    regatta_run_info{run_id,job,status,name}     1 per exported run
    regatta_world_size{run_id}                   ranks at the newest step
    regatta_last_step{run_id}
    regatta_samples_per_second{run_id,host}      the host's processes' newest steps
    regatta_step_time_seconds{run_id,host,slot}  each process's newest step
    regatta_failures_total{run_id}               failures seen (counter)
    regatta_recovery_seconds_sum{run_id} / _count  failure -> first step done again
"""
from __future__ import annotations

import time
from collections import defaultdict

from flask import Response, current_app
from sqlalchemy import func, select

from monitor.models import RunProcess
from webui.api import get_store
from webui.pages import pages

RECENT_S = 3600.0
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _label(value) -> str:
    text = "" if value is None else str(value)
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _line(name: str, labels: dict, value) -> str:
    inner = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
    return f"{name}{{{inner}}} {float(value):.9g}" if inner else f"{name} {float(value):.9g}"


class _Exposition:
    def __init__(self):
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str, samples) -> None:
        self.lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        self.lines += [_line(n if n else name, labels, v) for n, labels, v in samples]

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def exposition(store, lost_after: float, now: float | None = None) -> str:
    now = time.time() if now is None else now
    out = _Exposition()
    counts = defaultdict(int)
    for status in ("running", "lost", "finished", "failed", "stopped"):
        counts[status] = store.runs_page(status=status, limit=1, lost_after=lost_after)["total"]
    out.family("regatta_runs", "gauge", "Runs in the store by status.",
               [(None, {"status": s}, n) for s, n in counts.items()])
    recent = [r for r in store.runs(limit=5000, lost_after=lost_after)
              if r["status"] == "running" or (r["finished_at"] or r["last_seen_at"] or 0)
              > now - RECENT_S]
    out.family("regatta_run_info", "gauge", "Runs exported here (running or recent).",
               [(None, {"run_id": r["id"], "job": r["job"], "status": r["status"],
                        "name": r["name"] or ""}, 1) for r in recent])
    out.family("regatta_world_size", "gauge", "Ranks at the newest step.",
               [(None, {"run_id": r["id"]}, r["world_size"]) for r in recent
                if r["world_size"] is not None])
    out.family("regatta_last_step", "gauge", "Newest step recorded.",
               [(None, {"run_id": r["id"]}, r["last_step"]) for r in recent
                if r["last_step"] is not None])
    _processes(store, out, [r["id"] for r in recent])
    failures, recovery = [], []
    for r in recent:
        rows = [x for x in store.recoveries(r["id"]) if x["kind"] == "failure"]
        failures.append((None, {"run_id": r["id"]}, len(rows)))
        done = [x["first_step_done_s"] for x in rows if x["first_step_done_s"] is not None]
        recovery += [("regatta_recovery_seconds_sum", {"run_id": r["id"]}, sum(done)),
                     ("regatta_recovery_seconds_count", {"run_id": r["id"]}, len(done))]
    out.family("regatta_failures_total", "counter", "Failures seen.", failures)
    out.family("regatta_recovery_seconds", "summary",
               "Seconds from a failure to the first step done in the new world.", recovery)
    return out.text()


def _processes(store, out: _Exposition, run_ids: list[str]) -> None:
    """Per process its newest step; per host the sum of its live processes' throughput.
    A process counts as live if its newest step is within a minute of the run's."""
    p = RunProcess
    rows = store.all(select(p.run_id, p.host, p.slot, p.last_step_time, p.last_samples,
                            p.last_wall_time).where(p.run_id.in_(run_ids))) if run_ids else []
    newest = dict(store.all(select(p.run_id, func.max(p.last_wall_time))
                            .where(p.run_id.in_(run_ids)).group_by(p.run_id))) if run_ids else {}
    per_host: dict = defaultdict(float)
    step_times = []
    for run_id, host, slot, step_time, samples, seen in rows:
        if seen < newest[run_id] - 60:
            continue
        step_times.append((None, {"run_id": run_id, "host": host, "slot": slot}, step_time))
        if step_time > 0:
            per_host[(run_id, host)] += samples / step_time
    out.family("regatta_samples_per_second", "gauge",
               "Samples per second of a host's processes at their newest step.",
               [(None, {"run_id": r, "host": h}, v) for (r, h), v in sorted(per_host.items())])
    out.family("regatta_step_time_seconds", "gauge", "Step time of each process's newest step.",
               step_times)


@pages.get("/metrics")
def metrics():
    cfg = current_app.config["REGATTA"]
    return Response(exposition(get_store(), cfg.lost_after_s), content_type=CONTENT_TYPE)
