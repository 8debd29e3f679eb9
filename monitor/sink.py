"""Sinks: where a training process sends its metric rows without ever waiting on them.

    sink = make_sink(db="runs/regatta.db")                       # one host (SQLite)
    sink = make_sink(db="postgresql+psycopg://u@db/regatta")     # a shared database
    sink = make_sink(ingest="http://dash:8050", token="s3cret")   # cluster
    sink.emit({"type": "step", "run_id": "r1", "step": 3, ...})   # never blocks
    sink.close()                                                  # flush, replay, stop

SqlSink writes the store directly (a SQLite file, which WAL lets several ranks share, or
any SQLAlchemy URL); HttpSink POSTs ``{"rows": [...]}`` batches to the dashboard server,
the single writer; NullSink drops everything. Both queued sinks spool what they cannot
deliver and replay it later (see monitor.queued and monitor.replay); uids make every
replay exactly-once. Rows of a run whose run row has not reached the store yet (another
rank sent it) wait in the spool and are sent again.
"""
from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Optional

from monitor.dialect import shown
from monitor.queued import NotYet, QueuedSink, Rejected, Sink, SinkConfig
from monitor.store import Store, UnknownRun, validate_row

__all__ = ["Sink", "SinkConfig", "NullSink", "SqlSink", "SQLiteSink", "HttpSink", "Rejected",
           "make_sink", "destination_of", "store_rows", "post_rows"]


class NullSink(Sink):
    """Monitoring switched off; rows are still validated so bugs show up anyway."""

    def emit(self, row: dict) -> None:
        validate_row(row)


def destination_of(db: Optional[str] = None, ingest: Optional[str] = None) -> str:
    """The name a sink's spool files are filed under (monitor.replay reads it back)."""
    if ingest:
        return ingest.rstrip("/") + "/api/v1/ingest"
    # Absolute: two checkouts' ``runs/regatta.db`` are different stores and must not
    # adopt each other's rows.
    return f"sqlite:{os.path.abspath(db)}" if "://" not in db else db


def store_rows(store: Store, rows: list[dict]) -> None:
    """Write rows into a store, in the sinks' terms: NotYet (their run row is not stored
    yet: retry), Rejected (invalid: never retry), anything else (retry later)."""
    try:
        store.write_rows(rows)
    except UnknownRun as exc:
        raise NotYet(str(exc)) from None
    except ValueError as exc:
        raise Rejected(str(exc)) from None


def post_rows(endpoint: str, token: Optional[str], rows: list[dict], timeout: float = 10.0) -> None:
    """POST rows to a dashboard's ingest endpoint, in the same terms as store_rows; a
    batch the server finds too big (413) is sent again in halves."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    body = json.dumps({"rows": rows}, separators=(",", ":")).encode()
    request = urllib.request.Request(endpoint, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:300].decode("utf-8", "replace")
        if exc.code == 413 and len(rows) > 1:  # too big for the server: halve it
            post_rows(endpoint, token, rows[: len(rows) // 2], timeout)
            post_rows(endpoint, token, rows[len(rows) // 2:], timeout)
            return
        if exc.code == 409:   # rows of a run whose run row is not stored yet
            raise NotYet(f"HTTP 409: {detail}") from None
        if exc.code in (400, 413, 422):
            raise Rejected(f"HTTP {exc.code}: {detail}") from None
        # 401/403 (token), 404, 5xx, 429: the server may be fixed or restarted; keep rows.
        raise ConnectionError(f"HTTP {exc.code}: {detail}") from None


class SqlSink(QueuedSink):
    """Writes batches straight into the store at ``db`` (SQLite path or SQLAlchemy URL)."""

    def __init__(self, db: str, spool_path: Optional[str] = None, *,
                 spool_dir: Optional[str] = None, config: Optional[SinkConfig] = None):
        self.store = Store(db)  # first, so a bad path fails here and not in the thread
        super().__init__(destination_of(db=db), spool_path, spool_dir, config)

    def _deliver(self, rows: list[dict]) -> None:
        store_rows(self.store, rows)

    def close(self, timeout: Optional[float] = 10.0) -> None:
        super().close(timeout)
        if not self._thread.is_alive():
            self.store.close()

    def __repr__(self) -> str:
        return f"SqlSink({shown(self.store.path)!r})"


SQLiteSink = SqlSink   # its name before it took any SQLAlchemy URL


class HttpSink(QueuedSink):
    """POSTs batches to ``<url>/api/v1/ingest`` with a bearer token (urllib only)."""

    def __init__(self, url: str, token: Optional[str] = None,
                 spool_path: Optional[str] = None, *, spool_dir: Optional[str] = None,
                 config: Optional[SinkConfig] = None, timeout: float = 10.0):
        self.endpoint = destination_of(ingest=url)
        self.token = token
        self.timeout = timeout
        super().__init__(self.endpoint, spool_path, spool_dir, config)

    def _deliver(self, rows: list[dict]) -> None:
        post_rows(self.endpoint, self.token, rows, self.timeout)

    def __repr__(self) -> str:
        return f"HttpSink({self.endpoint!r})"


def make_sink(db: Optional[str] = None, ingest: Optional[str] = None,
              token: Optional[str] = None, spool_dir: Optional[str] = None,
              config: Optional[SinkConfig] = None) -> Sink:
    """The sink a worker should use: HTTP if an ingest URL is given, else the store at
    ``db`` (a SQLite path or a SQLAlchemy URL such as postgresql+psycopg://...) if given,
    else NullSink. ``spool_dir`` holds undelivered rows (default: the REGATTA_SPOOL_DIR
    environment variable, else <tmp>/regatta-spool)."""
    if ingest:
        return HttpSink(ingest, token, spool_dir=spool_dir, config=config)
    if db:
        return SqlSink(db, spool_dir=spool_dir, config=config)
    return NullSink()
