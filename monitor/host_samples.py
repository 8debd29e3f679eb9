"""Host samples of one run over wall time, per host: CPU %, memory, GPU (see
monitor.models.HostSample). Takes the Store first (a Store read method, see
monitor.queries) and returns JSON-ready dicts.

Every worker process samples about once a second. A host's value at a time is built from
its processes' samples: CPU % (and GPU utilisation) is the mean, since each process
reports its whole host's figure; memory (RSS, and GPU memory) is the sum over the host's
processes, each told apart by its slot (samples stored without one count as one process).

Downsampled in SQL like the step series: wall time is cut into buckets of equal width
(at least ``MIN_BUCKET_S``, so each sampling process has a sample in every full bucket)
and each process contributes its mean over the bucket. A process with no sample in a
bucket right after one where it had one (a late sample, the newest partial bucket)
counts with its previous value, so a host's memory does not dip for a missing sample.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Optional

from sqlalchemy import BigInteger, cast, func, select

from monitor.models import HostSample
from monitor.series import MAX_POINTS, avg

MIN_BUCKET_S = 2.0          # two sampling periods (reporting.HostSampler samples every second)
HOST_METRICS = ("cpu_percent", "rss_bytes", "gpu_util", "gpu_mem")
SUMMED = ("rss_bytes", "gpu_mem")    # over a host's processes; the others are averaged


def host_samples(store, run_id: str, since: Optional[float] = None,
                 max_points: int = MAX_POINTS) -> dict:
    """{"bucket_s", "cursor", "hosts": [{"host", "time", "processes", "cpu_percent",
    "rss_bytes", "gpu_util", "gpu_mem"}]}: one point per bucket in which the host has
    samples, at the bucket's first sample time; GPU lists hold None where no GPU was
    sampled. ``since`` is a wall time: only samples after it; ``cursor`` is the newest
    sample time the answer covers (poll with since=cursor)."""
    h = HostSample
    where = [h.run_id == run_id] + ([h.wall_time > since] if since is not None else [])
    lo, hi = store.first(select(func.min(h.wall_time), func.max(h.wall_time)).where(*where))
    if lo is None:
        return {"bucket_s": None, "cursor": since, "hosts": []}
    # Whole milliseconds divide the same way on every database (no float floor); the
    # newest sample falls in bucket span // width < max_points.
    width_ms = max(int(MIN_BUCKET_S * 1000), int((hi - lo) * 1000) // max(1, max_points) + 1)
    # Columns computed once in a subquery: PostgreSQL would not match an expression with
    # bound constants in GROUP BY to the same one in SELECT.
    src = select(h.host, func.coalesce(h.slot, -1).label("slot"), h.wall_time,
                 (cast((h.wall_time - lo) * 1000.0, BigInteger) // width_ms).label("b"),
                 *[getattr(h, m) for m in HOST_METRICS]).where(*where).subquery()
    stmt = (select(src.c.host, src.c.slot, src.c.b, func.min(src.c.wall_time),
                   *[avg(src.c[m]) for m in HOST_METRICS])
            .group_by(src.c.host, src.c.slot, src.c.b).order_by(src.c.host, src.c.b))
    per_host: dict = defaultdict(lambda: defaultdict(dict))   # host -> bucket -> slot -> row
    for host, slot, b, t, *values in store.all(stmt):
        per_host[host][b][slot] = (t, values)
    return {"bucket_s": width_ms / 1000, "cursor": hi,
            "hosts": [_host_series(host, buckets) for host, buckets in sorted(per_host.items())]}


def _host_series(host: str, buckets: dict) -> dict:
    out = {"host": host, "time": [], "processes": [], **{m: [] for m in HOST_METRICS}}
    last: dict = {}     # slot -> (its newest bucket, its values there)
    for b in sorted(buckets):
        seen = buckets[b]
        rows = [values for _, values in seen.values()]
        rows += [values for slot, (at, values) in last.items() if slot not in seen and at == b - 1]
        out["time"].append(min(t for t, _ in seen.values()))
        out["processes"].append(len(rows))
        for i, metric in enumerate(HOST_METRICS):
            present = [row[i] for row in rows if row[i] is not None]
            total = sum(present) if present else None
            out[metric].append(total if total is None or metric in SUMMED else total / len(present))
        last.update({slot: (b, values) for slot, (_, values) in seen.items()})
    return out
