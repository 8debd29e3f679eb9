"""Sinks: where a training process sends its metric rows without ever waiting on them.

    sink = make_sink(db="runs/regatta.db")                       # one host
    sink = make_sink(ingest="http://dash:8050", token="s3cret")   # cluster
    sink.emit({"type": "step", "run_id": "r1", "step": 3, ...})   # never blocks
    sink.close()                                                  # flush, replay, stop

SQLiteSink writes the store directly (WAL lets several ranks share one file); HttpSink
POSTs ``{"rows": [...]}`` batches to the dashboard server, the single writer; NullSink
drops everything. Both queued sinks spool what they cannot deliver and replay it later
(see monitor.queued); uids make every replay exactly-once.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Optional

from monitor.queued import QueuedSink, Rejected, Sink, SinkConfig
from monitor.store import Store, validate_row

__all__ = ["Sink", "SinkConfig", "NullSink", "SQLiteSink", "HttpSink", "Rejected",
           "make_sink"]


class NullSink(Sink):
    """Monitoring switched off; rows are still validated so bugs show up anyway."""

    def emit(self, row: dict) -> None:
        validate_row(row)


class SQLiteSink(QueuedSink):
    """Writes batches straight into the SQLite store at ``path``."""

    def __init__(self, path: str, spool_path: Optional[str] = None, *,
                 spool_dir: Optional[str] = None, config: Optional[SinkConfig] = None):
        self.store = Store(path)  # first, so a bad path fails here and not in the thread
        super().__init__(f"sqlite:{path}", spool_path, spool_dir, config)

    def _deliver(self, rows: list[dict]) -> None:
        try:
            self.store.write_rows(rows)
        except ValueError as exc:
            raise Rejected(str(exc)) from None

    def close(self, timeout: Optional[float] = 10.0) -> None:
        super().close(timeout)
        if not self._thread.is_alive():
            self.store.close()

    def __repr__(self) -> str:
        return f"SQLiteSink({self.store.path!r})"


class HttpSink(QueuedSink):
    """POSTs batches to ``<url>/api/v1/ingest`` with a bearer token (urllib only)."""

    def __init__(self, url: str, token: Optional[str] = None,
                 spool_path: Optional[str] = None, *, spool_dir: Optional[str] = None,
                 config: Optional[SinkConfig] = None, timeout: float = 10.0):
        self.endpoint = url.rstrip("/") + "/api/v1/ingest"
        self.token = token
        self.timeout = timeout
        super().__init__(self.endpoint, spool_path, spool_dir, config)

    def _deliver(self, rows: list[dict]) -> None:
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        body = json.dumps({"rows": rows}, separators=(",", ":")).encode()
        request = urllib.request.Request(self.endpoint, data=body, headers=headers,
                                         method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:300].decode("utf-8", "replace")
            if exc.code == 413 and len(rows) > 1:  # too big for the server: halve it
                self._deliver(rows[: len(rows) // 2])
                self._deliver(rows[len(rows) // 2:])
                return
            if exc.code in (400, 413):
                raise Rejected(f"HTTP {exc.code}: {detail}") from None
            # 401/403 (token), 5xx, 429: the server may be fixed or restarted; keep rows.
            raise ConnectionError(f"HTTP {exc.code}: {detail}") from None

    def __repr__(self) -> str:
        return f"HttpSink({self.endpoint!r})"


def make_sink(db: Optional[str] = None, ingest: Optional[str] = None,
              token: Optional[str] = None, spool_dir: Optional[str] = None,
              config: Optional[SinkConfig] = None) -> Sink:
    """The sink a worker should use: HTTP if an ingest URL is given, else SQLite if a db
    path is given, else NullSink. ``spool_dir`` holds undelivered rows (default: the
    REGATTA_SPOOL_DIR environment variable, else <tmp>/regatta-spool)."""
    if ingest:
        return HttpSink(ingest, token, spool_dir=spool_dir, config=config)
    if db:
        return SQLiteSink(db, spool_dir=spool_dir, config=config)
    return NullSink()
