"""What a training rank reports to the metrics store, and straggler detection.

Nothing here adds a collective to the step: every rank already receives every rank's
arrival time at the gradient allreduce (it rides in the same fused buffer), so each rank
knows its own wait time and rank 0 can spot a straggler locally.
"""
from __future__ import annotations

import hashlib
import os
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from monitor.sink import make_sink


def run_id_for(job: str, run_dir: str) -> str:
    """Every rank, and a whole-job restart, must agree on the run id without talking."""
    explicit = os.environ.get("REGATTA_RUN_ID")
    if explicit:
        return explicit
    digest = hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:8]
    return f"{job}-{digest}"


def run_row(run_id: str, job: str, status: str, **fields) -> dict:
    """The store's row for a run. Later rows with the same id update only its status and
    finish time, so ``started_at`` matters only in the first one."""
    return {"type": "run", "id": run_id, "job": job, "status": status,
            "started_at": fields.pop("started_at", time.time()), **fields}


def open_sink(cfg):
    db = cfg.db or str(Path(cfg.run_dir) / "metrics.db")   # db = "" still means this run only
    if not cfg.ingest:
        Path(db).parent.mkdir(parents=True, exist_ok=True)
    return make_sink(db=None if cfg.ingest else db, ingest=cfg.ingest or None,
                     token=os.environ.get("REGATTA_INGEST_TOKEN"))


@dataclass
class StragglerDetector:
    """Flags a rank whose time to reach the allreduce (data + compute) has been above
    ``factor`` x the median of the other ranks' over the last ``window`` steps (the
    median of its ratios, so one noisy step neither flags nor clears it); flags it once
    until it recovers."""
    factor: float = 1.3
    window: int = 8
    history: dict = field(default_factory=dict)
    flagged: set = field(default_factory=set)

    def observe(self, compute_times: list[float]) -> list[int]:
        if len(compute_times) < 2:
            return []
        new = []
        for rank, value in enumerate(compute_times):
            others = statistics.median(compute_times[:rank] + compute_times[rank + 1:])
            if others <= 0:
                continue
            ratios = self.history.setdefault(rank, deque(maxlen=self.window))
            ratios.append(value / others)
            if len(ratios) < self.window:
                continue
            typical = statistics.median(ratios)
            if typical > self.factor and rank not in self.flagged:
                self.flagged.add(rank)
                new.append(rank)
            elif typical <= 1 + (self.factor - 1) / 2:
                # Cleared only well below the threshold: a rank hovering at it is one
                # straggler, not an event every few steps.
                self.flagged.discard(rank)
        return new

    def ratio(self, rank: int) -> float:
        return statistics.median(self.history[rank])

    def reset(self) -> None:
        self.history.clear()
        self.flagged.clear()


class HostSampler:
    """About once a second, off the training thread: this worker's CPU and memory."""

    def __init__(self, sink, run_id: str, host: str, interval: float = 1.0):
        self.sink, self.run_id, self.host, self.interval = sink, run_id, host, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="regatta-host-sampler", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        process = psutil.Process()
        psutil.cpu_percent(None)
        while not self._stop.wait(self.interval):
            row = {"type": "host", "run_id": self.run_id, "host": self.host,
                   "wall_time": time.time(), "cpu_percent": psutil.cpu_percent(None),
                   "rss_bytes": process.memory_info().rss}
            row.update(gpu_sample())
            self.sink.emit(row)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


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
            return {"gpu_mem": float(total - free), "gpu_util": float(torch.cuda.utilization())}
    except Exception:   # no driver, no pynvml: a CPU host simply has no GPU columns
        pass
    return {}


class StepReporter:
    """The training loop's metrics hooks: a step row per rank per step, stragglers on
    rank 0, and the host sampler."""

    def __init__(self, sink, run_id: str, host: str, straggler: StragglerDetector | None = None):
        self.sink, self.run_id = sink, run_id
        self.straggler = straggler or StragglerDetector()
        self.hosts: list[str] = []
        self.sampler = HostSampler(sink, run_id, host)

    def on_enter(self, session, state, hvd) -> None:
        """Once per world: who is where (one small allgather, off the step path), and
        on rank 0 which hosts this membership change lost or gained."""
        before = self.hosts
        self.hosts = hvd.allgather_object(session.world.host, name="regatta.hosts") \
            if session.world.size > 1 else [session.world.host]
        self.straggler.reset()
        if before and session.world.is_root:
            noticed = state.interrupted_at
            for host in sorted(set(before) - set(self.hosts)):
                kind = "failure" if state.restored_from is not None else "host_removed"
                step = state.step if state.restored_from is None else state.restored_from
                session.events.record(kind, step, wall_time=noticed, target=host,
                                      size_before=len(before), size_after=len(self.hosts))
                if kind == "failure":   # Horovod's driver blacklists a failed slot's host
                    session.events.record("blacklist", step, wall_time=noticed, target=host)
            for host in sorted(set(self.hosts) - set(before)):
                session.events.record("host_added", state.step, wall_time=noticed, target=host,
                                      size_before=len(before), size_after=len(self.hosts))
        state.restored_from = state.interrupted_at = None

    def on_step(self, session, state, stats) -> None:
        world = session.world
        lr = state.optimizer.param_groups[0]["lr"]
        self.sink.emit({"type": "step", "run_id": self.run_id, "step": state.step,
                        "wall_time": time.time(), "rank": world.rank, "world_size": world.size,
                        "host": world.host, "slot": world.slot, "step_time": stats.step_time,
                        "data_time": stats.data_time, "compute_time": stats.compute_time,
                        "comm_time": stats.comm_time, "wait_time": stats.wait_time,
                        "samples": stats.samples, "bytes_sent": stats.bytes_sent,
                        "loss": stats.loss, "lr": lr})
        if world.is_root:
            for rank in self.straggler.observe(stats.arrivals):
                session.events.record("straggler", state.step, straggler_rank=rank,
                                      straggler_host=self.hosts[rank] if rank < len(self.hosts) else None,
                                      ratio=self.straggler.ratio(rank))

    def close(self) -> None:
        self.sampler.stop()


class PipelineReporter:
    """The pipeline trainer's ``on_metrics`` hook: each rank's step as a store row, plus
    the run row (from the rank that holds the loss). Per-stage busy time, receive wait
    and bubble land in compute_time, wait_time and the stage column."""

    def __init__(self, cfg, job_name: str):
        from elastic.pipeline.metrics import StepMetrics
        self._metrics_cls = StepMetrics
        self.sink, self.run_id, self.job, self.cfg = open_sink(cfg), run_id_for(job_name, cfg.run_dir), job_name, cfg
        self._announced = False

    def __call__(self, metrics: dict) -> None:
        fields = {k: v for k, v in metrics.items() if k != "type"}
        row = self._metrics_cls(**fields).as_step_row(self.run_id)
        if not self._announced and fields["rank"] == 0:
            self.sink.emit(run_row(self.run_id, self.job, "running", launcher="mpirun",
                                   config={"steps": self.cfg.steps, "pipeline": True}))
            self._announced = True
        self.sink.emit(row)

    def close(self, finished: bool) -> None:
        if self._announced and finished:
            self.sink.emit(run_row(self.run_id, self.job, "finished", finished_at=time.time()))
        self.sink.close()
