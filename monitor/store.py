"""SQLite store for Regatta's metrics: row validation and batched, exactly-once writes.

Rows arrive as plain dicts with a ``type`` key (``run``, ``step``, ``event``, ``host``);
the fields of each type are exactly the columns of its model in monitor.models, and
``validate_row`` derives its checks from those columns. Queries live in monitor.queries.

The database runs in WAL mode with a long busy timeout so that several writer processes
(one SQLiteSink per rank on a single host) and the dashboard's readers can share it.
Every write is one ``BEGIN IMMEDIATE`` transaction: taking the write lock up front lets
SQLite's busy handler wait for it, instead of failing a deferred transaction that tries
to upgrade its lock halfway through.
"""
from __future__ import annotations

import json
import math
import threading
from contextlib import contextmanager
from typing import Any, Iterator

from sqlalchemy import create_engine, event, func
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection, Engine

from monitor.models import MODELS, RUN_STATUSES, Base, Event, HostSample, Run, StepMetric
from monitor.queries import Queries

__all__ = ["Store", "validate_row", "MODELS", "RUN_STATUSES", "Base", "Run", "StepMetric",
           "Event", "HostSample"]
BUSY_TIMEOUT_MS = 30_000

META_FIELDS = ("type", "uid")  # allowed on every row; ``run`` rows ignore the uid


def _fields(model) -> dict[str, tuple[type, bool, bool, Any, dict]]:
    """name -> (python type, required, nullable, default, info), read off the model."""
    out = {}
    for col in model.__table__.columns:
        if col.primary_key and col.autoincrement is not False and col.type.python_type is int:
            continue  # surrogate key: assigned by SQLite, never sent
        default = col.default.arg if col.default is not None else None
        required = not col.nullable and col.default is None
        out[col.name] = (col.type.python_type, required, bool(col.nullable), default, col.info)
    return out


FIELDS = {kind: _fields(model) for kind, model in MODELS.items()}


def _check_value(kind: str, name: str, value: Any, spec) -> Any:
    """Return the value as stored (JSON text, None for NaN) or raise ValueError."""
    typ, _required, nullable, _default, info = spec
    if value is None:
        if nullable:
            return None
        raise ValueError(f"{kind} row: field '{name}' must not be null")
    if info.get("json"):
        if isinstance(value, str):
            return value
        try:
            return json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{kind} row: field '{name}' is not JSON-serialisable: {exc}")
    ok = isinstance(value, typ) and not isinstance(value, bool)
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if not ok:
        raise ValueError(f"{kind} row: field '{name}' must be {typ.__name__}, "
                         f"got {type(value).__name__}")
    if typ is float and not math.isfinite(value):
        # SQLite stores NaN as NULL, and browsers cannot parse NaN/Infinity in JSON.
        if nullable:
            return None
        raise ValueError(f"{kind} row: field '{name}' must be finite, got {value}")
    if "choices" in info and value not in info["choices"]:
        raise ValueError(f"{kind} row: field '{name}' must be one of {info['choices']}, "
                         f"got {value!r}")
    return value


def validate_row(row: dict) -> dict:
    """Check one row and return it normalised (every column present, JSON as text).

    Raises ValueError naming the offending field: unknown type, missing required field,
    wrong type, or unknown field.
    """
    if not isinstance(row, dict):
        raise ValueError(f"row must be an object, got {type(row).__name__}")
    kind = row.get("type")
    if kind not in FIELDS:
        raise ValueError(f"field 'type' must be one of {sorted(FIELDS)}, got {kind!r}")
    fields = FIELDS[kind]
    for name in row:
        if name not in fields and name not in META_FIELDS:
            raise ValueError(f"{kind} row: unknown field '{name}'")
    uid = row.get("uid")
    if uid is not None and not isinstance(uid, str):
        raise ValueError(f"{kind} row: field 'uid' must be str, got {type(uid).__name__}")
    out = {}
    for name, spec in fields.items():
        if name in row:
            out[name] = _check_value(kind, name, row[name], spec)
        elif spec[1]:
            raise ValueError(f"{kind} row: missing required field '{name}'")
        else:
            out[name] = spec[3]
    return out


def _on_connect(dbapi_conn, _record) -> None:
    """Per-connection settings: busy wait first, so switching to WAL can wait too."""
    dbapi_conn.isolation_level = None  # let the "begin" hook below issue BEGIN itself
    cur = dbapi_conn.cursor()
    cur.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    cur.execute("PRAGMA journal_mode=WAL")
    cur.close()


def _on_begin(conn) -> None:
    """Writers ask for BEGIN IMMEDIATE through an execution option; readers defer."""
    mode = conn.get_execution_options().get("sqlite_begin", "DEFERRED")
    conn.exec_driver_sql(f"BEGIN {mode}")


class Store(Queries):
    """A Regatta metrics database: ``Store(path)`` opens it, creating tables if needed."""

    def __init__(self, path: str):
        self.path = path
        self.engine: Engine = create_engine(f"sqlite:///{path}")
        event.listen(self.engine, "connect", _on_connect)
        event.listen(self.engine, "begin", _on_begin)
        # In-process writers take turns here rather than spinning in SQLite's busy handler.
        self._write_lock = threading.Lock()
        with self._writer() as conn:  # serialised, so concurrent creators do not race
            Base.metadata.create_all(conn)

    @contextmanager
    def _writer(self) -> Iterator[Connection]:
        """A connection inside one BEGIN IMMEDIATE transaction, committed on success."""
        with self.engine.connect() as conn:
            conn = conn.execution_options(sqlite_begin="IMMEDIATE")
            with conn.begin():
                yield conn

    def write_rows(self, rows: list[dict]) -> int:
        """Validate every row, then insert them all in ONE transaction.

        Rows whose uid is already stored are skipped, so replays are exactly-once.
        ``run`` rows upsert by id. Returns the number of rows inserted or upserted.
        Raises ValueError (``rows[i]: ...``) before writing anything if a row is bad.
        """
        grouped: dict[str, list[dict]] = {kind: [] for kind in MODELS}
        for i, row in enumerate(rows):
            try:
                normalised = validate_row(row)
            except ValueError as exc:
                raise ValueError(f"rows[{i}]: {exc}") from None
            grouped[row["type"]].append(normalised)
        stored = 0
        with self._write_lock, self._writer() as conn:
            for kind, batch in grouped.items():
                if batch:
                    stored += conn.execute(self._insert(kind), batch).rowcount
        return stored

    @staticmethod
    def _insert(kind: str):
        table = MODELS[kind].__table__
        stmt = sqlite_insert(table)
        if kind != "run":
            return stmt.on_conflict_do_nothing(index_elements=["uid"])
        # A stale 'running' row (a replay) must not reopen a finished or failed run.
        return stmt.on_conflict_do_update(
            index_elements=["id"],
            set_={"status": stmt.excluded.status,
                  "finished_at": func.coalesce(stmt.excluded.finished_at, table.c.finished_at)},
            where=(table.c.status == "running") | (stmt.excluded.status != "running"),
        )

    def close(self) -> None:
        """Release pooled connections."""
        self.engine.dispose()

