"""What a rank reports to the metrics store: one step row per step, for every engine,
the membership changes seen at each (re)entry, stragglers, and host samples.

Nothing here adds a collective to the step: the agreement (control.py) already gives
every rank every rank's work time.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field, fields as dataclass_fields

import psutil

from .stragglers import StragglerDetector

# Step-row fields the store has columns for beyond the core ones (monitor.models).
OPTIONAL_COLUMNS = ("replica", "bubble", "overlap")


@dataclass
class StepRow:
    """One rank's optimizer step, whatever the engine; pipeline fields are optional.
    ``detail`` holds engine-specific measurements that callbacks see but the store
    does not keep."""
    step_time: float
    data_time: float = 0.0
    compute_time: float = 0.0
    comm_time: float = 0.0
    wait_time: float = 0.0
    samples: int = 0
    bytes_sent: int = 0
    loss: float | None = None
    lr: float | None = None
    stage: int = 0
    replica: int | None = None
    bubble: float | None = None
    overlap: float | None = None
    detail: dict = field(default_factory=dict)

    def record(self, run_id: str, step: int, world) -> dict:
        """The whole record: identity, measurements and detail (what callbacks get)."""
        # its fields are numbers: a shallow copy (asdict's deep one took 0.07 ms a step)
        fields = {name: getattr(self, name) for name in _MEASURED}
        return {"run_id": run_id, "step": step, "wall_time": time.time(), "rank": world.rank,
                "world_size": world.size, "host": world.host, "slot": world.slot,
                **fields, **self.detail}


_MEASURED = tuple(f.name for f in dataclass_fields(StepRow) if f.name != "detail")


def store_row(record: dict, stored_optional: tuple = OPTIONAL_COLUMNS) -> dict:
    """The store's ``step`` row of a record."""
    core = ("run_id", "step", "wall_time", "rank", "world_size", "host", "slot", "stage",
            "step_time", "data_time", "compute_time", "comm_time", "wait_time", "samples",
            "bytes_sent", "loss", "lr")
    row = {"type": "step", **{k: record[k] for k in core}}
    row.update({k: record[k] for k in stored_optional if record.get(k) is not None})
    return row


FIRST_SAMPLE_S = 0.2   # soon after start: a worker killed in its first second still shows


class HostSampler:
    """About once a second, off the training thread: the host's CPU %, this worker's
    memory (its slot says which worker of the host), the GPU's when there is one. The
    first comes FIRST_SAMPLE_S after start (CPU % needs an interval to measure over)."""

    def __init__(self, sink, run_id: str, host: str, slot: int, interval: float = 1.0):
        self.sink, self.run_id, self.host, self.slot = sink, run_id, host, slot
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="regatta-host-sampler", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        process = psutil.Process()
        psutil.cpu_percent(None)
        wait = min(self.interval, FIRST_SAMPLE_S)
        while not self._stop.wait(wait):
            row = {"type": "host", "run_id": self.run_id, "host": self.host, "slot": self.slot,
                   "wall_time": time.time(), "cpu_percent": psutil.cpu_percent(None),
                   "rss_bytes": process.memory_info().rss}
            row.update(gpu_sample())
            self.sink.emit(row)
            wait = self.interval

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


def process_started() -> float:
    """When this process was forked, to the clock tick. (psutil's ``create_time`` counts
    from a boot time rounded to the second: it put a worker's start up to 0.4 s early.)"""
    with open("/proc/self/stat") as stat:
        ticks = int(stat.read().rsplit(")", 1)[1].split()[19])    # field 22, starttime
    booted = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
    return booted + ticks / os.sysconf("SC_CLK_TCK")


def memcpy_bandwidth(nbytes: int = 64 << 20, repeats: int = 3) -> float:
    """Bytes per second of a plain memory copy here: the ceiling for the bus bandwidth
    the dashboard shows next to the allreduce's measured one."""
    import torch
    source = torch.ones(nbytes // 4)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - started)
    return nbytes / best


def gpu_sample() -> dict:
    try:
        import torch
        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            # gpu_mem is an integer column: a float makes emit() refuse the row
            return {"gpu_mem": int(total - free), "gpu_util": float(torch.cuda.utilization())}
    except Exception:   # no driver, no pynvml: a CPU host simply has no GPU columns
        pass
    return {}


class StepReporter:
    """Step rows to the sink and callbacks, stragglers on rank 0, membership events."""

    def __init__(self, sink, run_id: str, events, callbacks: list | None = None):
        self.sink, self.run_id, self.events = sink, run_id, events
        self.callbacks = list(callbacks or [])
        self.straggler = StragglerDetector()
        self.hosts: list[str] = []

    def on_enter(self, world, collectives, state) -> None:
        """Once per world: who is where (one small allgather, off the step path), and
        on rank 0 which hosts this membership change lost or gained."""
        before = self.hosts
        self.hosts = collectives.allgather_object(world.host, "regatta.hosts")
        self.straggler.reset()
        if before and world.is_root:
            self._membership(before, state)
        state.restored_from = state.interrupted_at = None

    def _membership(self, before: list[str], state) -> None:
        noticed, failed = state.interrupted_at, state.restored_from is not None
        step = state.restored_from if failed else state.step
        for host in sorted(set(before) - set(self.hosts)):
            kind = "failure" if failed else "host_removed"
            self.events.record(kind, step, wall_time=noticed, target=host,
                               size_before=len(before), size_after=len(self.hosts))
            if failed:   # Horovod's driver blacklists a failed slot's host
                self.events.record("blacklist", step, wall_time=noticed, target=host)
        for host in sorted(set(self.hosts) - set(before)):
            self.events.record("host_added", state.step, wall_time=noticed, target=host,
                               size_before=len(before), size_after=len(self.hosts))

    def on_step(self, world, step: int, row: StepRow, agreed, groups=None) -> dict:
        record = row.record(self.run_id, step, world)
        self.sink.emit(store_row(record))
        for callback in self.callbacks:
            callback(record)
        if world.is_root and len(agreed.work) == world.size:
            for rank in self.straggler.observe(list(agreed.work), groups):
                self.events.record("straggler", step, straggler_rank=rank,
                                   straggler_host=self.hosts[rank] if rank < len(self.hosts) else None,
                                   ratio=self.straggler.ratio(rank))
        return record
