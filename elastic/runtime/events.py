"""Events a worker records (commit, restore, reset, failure, checkpoint, ...).

Each worker appends JSON lines to ``<run_dir>/events/<host>-<slot>.jsonl`` (the launcher's
report is built from these) and, when a metrics sink is attached, emits the same event
as a store row. Lines are flushed at once: a SIGKILL loses nothing already recorded.
The sink sends its rows in batches, about once a second. Only the events that happen
all the time (monitor.event_kinds' minor ones: commits, checkpoints, stragglers) wait
for one; every other kind is rare and is sent at once, because it is mostly about a
failure, and a recovering process may end before the next batch (Gloo aborts it, or it
exits to be replaced) and its queue would go with it.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from monitor.event_kinds import KINDS, MINOR


class EventLog:
    def __init__(self, run_dir: str | Path, host: str, slot: int, sink=None, run_id: str = ""):
        folder = Path(run_dir) / "events"
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"{host}-{slot}.jsonl"
        self._file = open(self.path, "a", buffering=1)
        self.host, self.slot, self.sink, self.run_id = host, slot, sink, run_id
        self.rank: int | None = None
        self._lock = threading.Lock()   # the lifeline watchdog records from its own thread

    def record(self, kind: str, step: int | None = None, wall_time: float | None = None,
               **detail) -> dict:
        """``wall_time`` backdates an event recorded after the fact (a failure is written
        once the survivors re-formed, but happened when they noticed it). ``kind`` must be
        one of monitor.event_kinds: the dashboard draws every kind from that one table."""
        if kind not in KINDS:
            raise ValueError(f"event kind {kind!r} is not defined in monitor/event_kinds.py")
        event = {"kind": kind, "wall_time": wall_time or time.time(), "step": step, "host": self.host,
                 "slot": self.slot, "rank": self.rank, "pid": os.getpid(), **detail}
        with self._lock:
            self._file.write(json.dumps(event) + "\n")
        if self.sink is not None:
            self.sink.emit({"type": "event", "run_id": self.run_id, "wall_time": event["wall_time"],
                            "step": step, "kind": kind, "host": self.host, "rank": self.rank,
                            "detail": detail})
            if KINDS[kind].klass != MINOR:
                self.sink.flush(0)   # starts the delivery, does not wait for it
        return event

    def flush(self, timeout: float = 5.0) -> None:
        """Deliver (or spool) what the sink holds: before a fault that leaves no later
        chance, so the store knows of it too."""
        if self.sink is not None:
            self.sink.flush(timeout)

    def close(self) -> None:
        self._file.close()


def read_events(run_dir: str | Path) -> list[dict]:
    """Every event of every worker of a run, in wall-time order."""
    events = []
    for path in sorted((Path(run_dir) / "events").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                try:
                    events.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line torn by SIGKILL mid-write
    return sorted(events, key=lambda e: e["wall_time"])


class Progress:
    """The step counter a launcher polls: one fixed-width pwrite per step, no rename."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / "progress"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)

    def update(self, step: int, size: int) -> None:
        os.pwrite(self._fd, f"{step:12d} {size:6d}\n".encode(), 0)

    def close(self) -> None:
        os.close(self._fd)


def read_progress(run_dir: str | Path) -> tuple[int, int] | None:
    try:
        step, size = (Path(run_dir) / "progress").read_text().split()
        return int(step), int(size)
    except (FileNotFoundError, ValueError):
        return None
