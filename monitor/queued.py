"""The machinery behind the queued sinks: bounded queue, worker thread, spool, retries.

``emit(row)`` validates the row, gives it a ``uid`` (``"<producer_id>:<seq>"``) if it has
none, and puts it on a bounded in-memory queue; a daemon thread drains the queue and
delivers batches (every ``flush_interval`` seconds or ``batch_size`` rows). A batch that
cannot be delivered is appended to a local spool file and replayed, oldest first, once
the destination answers again. If the queue is full, ``emit`` spills the row straight to
the spool rather than block training. The destination ignores uids it has already
stored, so replays and retries are exactly-once.

Each spool file is named ``<tag>.<producer>.jsonl`` in the spool folder, the tag a hash of
the destination, and ``<tag>.dest`` beside it (written when rows are first spooled) names
the destination, so that ``regatta replay`` (monitor.replay) can deliver what a finished
producer left behind.

When the spool itself cannot be written (a full disk), undelivered rows are held in
memory (up to ``queue_size``; beyond that they are dropped and counted in ``dropped``),
one warning says so, and spooling is retried with the same backoff as delivery.

The implementations (SQLiteSink, HttpSink) and ``make_sink`` live in monitor.sink.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from monitor.spool import (Spool, default_spool_dir, forget_destination,
                           record_destination, spool_tag)
from monitor.store import validate_row

log = logging.getLogger("regatta.monitor.sink")
_FLUSH, _STOP = object(), object()  # queue markers for the worker


def default_producer_id() -> str:
    """Unique per process *instance*: a restarted worker must not reuse old uids."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


@dataclass
class SinkConfig:
    """Batching, buffering and retry settings shared by every queued sink."""

    batch_size: int = 500         # rows per delivery
    flush_interval: float = 1.0   # seconds a row may wait before its batch is sent
    queue_size: int = 10_000      # rows buffered in memory before emit spills to disk
    retry_min: float = 0.5        # first wait after a failed delivery, doubled each time
    retry_max: float = 10.0       # longest wait between delivery attempts
    producer_id: str = field(default_factory=default_producer_id)


class Rejected(Exception):
    """The destination refused a batch for good (invalid rows): retrying cannot help."""


class NotYet(Exception):
    """The destination cannot take the batch yet (its run row has not arrived): retry."""


class Sink:
    """Interface: ``emit`` never blocks; ``flush`` waits; ``close`` flushes and stops."""

    def emit(self, row: dict) -> None:
        raise NotImplementedError

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every row emitted so far is delivered or spooled; False on timeout.
        ``flush(0)`` starts their delivery and returns at once."""
        return True

    def close(self, timeout: Optional[float] = 10.0) -> None:
        """Flush, try once more to deliver the spool, and stop."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class QueuedSink(Sink):
    """The queue, worker thread, spool and retry logic; subclasses implement _deliver."""

    def __init__(self, destination: str, spool_path: Optional[str] = None,
                 spool_dir: Optional[str] = None, config: Optional[SinkConfig] = None):
        self.config = config or SinkConfig()
        self._queue: queue.Queue = queue.Queue(self.config.queue_size)
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._wake = threading.Event()   # a full batch, a flush or a close is waiting
        self._accepted = self._handled = 0  # rows queued / rows delivered or spooled
        self._retry_at, self._delay, self._failing = 0.0, 0.0, False
        self.failures = 0  # failed delivery attempts, for tests and health reporting
        self.dropped = 0   # rows lost because neither the destination nor the disk took them
        self._held: list = []   # rows the spool could not take (full disk)
        self._held_lock = threading.Lock()
        self._disk_failing = False
        self._closed = False
        self._destination, self._recorded = destination, spool_path is not None
        if spool_path is None:  # auto-named: also adopt what dead producers left behind
            tag = spool_tag(destination)
            folder = spool_dir or default_spool_dir()
            spool_path = os.path.join(folder, f"{tag}.{self.config.producer_id}.jsonl")
            self._spool = Spool(spool_path)
            try:
                self._spool.adopt(f"{tag}.*.jsonl")
            except OSError as exc:   # a full disk: leave them for a later replay
                log.warning("sink %s: cannot adopt spooled rows in %s: %s", destination,
                            folder, exc)
        else:
            self._spool = Spool(spool_path)
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"regatta-sink-{self.config.producer_id}")
        self._thread.start()

    @property
    def spooled(self) -> int:
        """Rows waiting in the spool file for the destination to come back."""
        return len(self._spool)

    def emit(self, row: dict) -> None:
        """Queue one row (a copy); raises ValueError at once if the row is malformed."""
        if self._closed:
            raise RuntimeError("emit() on a closed sink")
        validate_row(row)
        row = dict(row)
        if row.get("uid") is None:
            row["uid"] = f"{self.config.producer_id}:{next(self._seq)}"
        try:
            self._queue.put_nowait(row)
        except queue.Full:  # the worker is behind: go to disk, never wait
            self._keep([row])
            return
        with self._cond:
            self._accepted += 1
        if self._queue.qsize() >= self.config.batch_size:
            self._wake.set()

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every row emitted so far is delivered or spooled; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            target = self._accepted
        try:  # a marker makes the worker send its partial batch now
            self._queue.put(_FLUSH, timeout=timeout)
        except queue.Full:
            return False
        self._wake.set()
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        with self._cond:
            return self._cond.wait_for(lambda: self._handled >= target, left)

    def close(self, timeout: Optional[float] = 10.0) -> None:
        """Flush, try once more to deliver the spool, stop the worker and release the
        spool. Rows still undelivered stay in the spool file for a later sink to adopt.
        Call it after the last emit (it is not meant to race with emitting threads)."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        try:
            self._queue.put(_STOP, timeout=timeout)
            self._wake.set()
            self._thread.join(max(0.0, deadline - time.monotonic()))
        except queue.Full:
            pass
        if self._thread.is_alive():
            log.warning("sink %s: worker still busy after close(%s)", self, timeout)
            return
        if len(self._spool):
            log.warning("%d undelivered rows stay in %s for `regatta replay` (or the next "
                        "sink or server start)", len(self._spool), self._spool.path)
        if self._held:
            log.error("sink %s: %d rows held in memory are lost (the spool %s could not be "
                      "written)", self, len(self._held), self._spool.path)
        self._spool.close()
        if self._recorded and not len(self._spool):
            forget_destination(os.path.dirname(os.path.abspath(self._spool.path)),
                               spool_tag(self._destination))

    # -- worker thread ---------------------------------------------------------------

    def _run(self) -> None:
        stop = False
        while not stop:
            batch, stop = self._collect()
            try:
                if batch:
                    self._handle(batch)
                self._replay(force=stop)
            except Exception:  # noqa: BLE001 - e.g. the spool's disk is full
                # Say so loudly, but keep the thread alive: flush() must not hang forever.
                log.exception("sink %s: could neither deliver nor spool %d rows", self,
                              len(batch))
            with self._cond:
                self._handled += len(batch)
                self._cond.notify_all()

    def _collect(self) -> tuple[list, bool]:
        """Up to batch_size rows, at most flush_interval after the first; (rows, stop).

        The worker sleeps while a batch fills instead of waking for every row: a wake-up
        per emit cost the training thread ~10 % of a 2 ms step in GIL hand-offs."""
        try:
            items = [self._queue.get(timeout=self.config.flush_interval)]
        except queue.Empty:
            return [], False
        if items[0] is not _FLUSH and items[0] is not _STOP:
            self._wake.wait(self.config.flush_interval)   # emit/flush/close cut it short
        self._wake.clear()
        while len(items) < self.config.batch_size + 1:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        batch: list = []
        for item in items:
            if item is _STOP:
                return batch, True
            if item is not _FLUSH:
                batch.append(item)
        return batch, False

    def _handle(self, batch: list) -> None:
        if time.monotonic() < self._retry_at:  # known down: do not wait on it again
            self._keep(batch)
            return
        try:
            self._deliver(batch)
        except Rejected as exc:
            self._reject(batch, exc)
        except NotYet:
            # Its run row may be in this producer's spool: replay it now, this batch behind
            # it (at the retry, the next batch would fail first and put the replay off).
            self._keep(batch)
            self._replay(force=True)
        except Exception as exc:  # noqa: BLE001 - any failure means "keep it for later"
            self._keep(batch)
            self._failed(exc)
        else:
            self._succeeded()

    def _keep(self, rows: list) -> None:
        """Spool rows for later; if the spool cannot be written, hold them in memory."""
        if not self._recorded:   # the first rows spooled: say where they were going
            record_destination(os.path.dirname(os.path.abspath(self._spool.path)),
                               self._destination)
            self._recorded = True
        try:
            self._spool.append(rows)
        except OSError as exc:
            with self._held_lock:
                room = max(0, self.config.queue_size - len(self._held))
                self._held.extend(rows[:room])
                self.dropped += len(rows) - len(rows[:room])
            if not self._disk_failing:   # once per outage, never a traceback per batch
                log.warning("sink %s: cannot write the spool %s (%s); holding up to %d rows "
                            "in memory (the rest are dropped) and retrying every %.1f-%.0f s",
                            self, self._spool.path, exc, self.config.queue_size,
                            self.config.retry_min, self.config.retry_max)
            self._disk_failing = True
            if time.monotonic() >= self._retry_at:
                self._failed(exc)

    def _retry_held(self) -> bool:
        """Deliver (or at least spool) the rows held in memory; False if they are still held."""
        with self._held_lock:
            held, self._held = self._held, []
        if not held:
            return True
        try:
            self._deliver(held)
        except Rejected as exc:
            self._reject(held, exc)
        except Exception as exc:  # noqa: BLE001
            self._keep(held)
            self._failed(exc)
            if self._held:
                return False
        if self._disk_failing and not self._held:
            log.warning("sink %s: rows flow again; %d rows were dropped while the spool could "
                        "not be written", self, self.dropped)
            self._disk_failing = False
        return True

    def _replay(self, force: bool = False) -> None:
        """Deliver the spool oldest first until empty or the destination fails again."""
        if not force and time.monotonic() < self._retry_at:
            return
        if not self._retry_held() or not len(self._spool):
            return
        waiting = 0   # rows moved to the back because their run row is not stored yet
        while len(self._spool) > waiting:
            rows, token = self._spool.peek(self.config.batch_size)
            try:
                if rows:
                    self._deliver(rows)
            except Rejected as exc:
                self._reject(rows, exc)
            except NotYet:   # let the rows behind them through; they come round again
                self._spool.append(rows)
                waiting += len(rows)
            except Exception as exc:  # noqa: BLE001
                self._failed(exc)
                return
            self._spool.consume(token)
        if waiting:
            self._failed(NotYet(f"{waiting} rows wait for their run row"))
        else:
            self._succeeded()

    def _failed(self, exc: Exception) -> None:
        self.failures += 1
        self._delay = min(self.config.retry_max, max(self.config.retry_min, self._delay * 2))
        self._retry_at = time.monotonic() + self._delay
        if isinstance(exc, OSError) and self._disk_failing:
            return   # said already, by _keep
        if not self._failing:  # once per outage, not once per batch
            level = logging.INFO if isinstance(exc, NotYet) else logging.WARNING
            log.log(level, "sink %s: delivery %s (%s); spooling to %s", self,
                    "waits" if isinstance(exc, NotYet) else "failed", exc, self._spool.path)
        self._failing = True

    def _succeeded(self) -> None:
        if self._failing:
            log.info("sink %s: delivering again", self)
        self._failing, self._delay, self._retry_at = False, 0.0, 0.0

    def _reject(self, rows: list, exc: Exception) -> None:
        """Keep refused rows aside for a human instead of retrying them forever."""
        path = self._spool.path + ".rejected"
        try:
            with open(path, "a", encoding="utf-8") as fh:
                fh.writelines(json.dumps(r) + "\n" for r in rows)
        except OSError as err:
            path = f"nowhere ({err})"
        log.error("sink %s: %d rows rejected (%s); kept in %s", self, len(rows), exc, path)

    def _deliver(self, rows: list[dict]) -> None:
        """Store rows at the destination or raise (Rejected: never retry them)."""
        raise NotImplementedError
