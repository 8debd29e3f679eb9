"""SQLite store for Regatta's metrics: batched, exactly-once writes of validated rows.

Rows are plain dicts with a ``type`` (``run``, ``step``, ``event``, ``host``) whose
fields are the columns of that type's model (monitor.models); monitor.schema validates
them and monitor.queries holds the read helpers, mixed into Store.

The database runs in WAL mode with a long busy timeout so that several writer processes
(one SQLiteSink per rank on a single host) and the dashboard's readers can share it.
Every write is one ``BEGIN IMMEDIATE`` transaction: taking the write lock up front lets
SQLite's busy handler wait for it, instead of failing a deferred transaction that tries
to upgrade its lock halfway through.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

from sqlalchemy import create_engine, event, func, inspect, literal_column
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection, Engine

from monitor.models import MODELS, RUN_STATUSES, Base, Event, HostSample, Run, StepMetric
from monitor.queries import Queries
from monitor.schema import COLUMNS, normalise, validate_row

__all__ = ["Store", "validate_row", "MODELS", "RUN_STATUSES", "Base", "Run", "StepMetric",
           "Event", "HostSample"]
BUSY_TIMEOUT_MS = 30_000
RUNNING = literal_column("'running'")  # inline, so the INSERT's only parameters are columns


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
        self._sql = self._compile_inserts()
        with self.engine.connect() as conn:  # a read: does not wait for a busy writer
            missing = set(Base.metadata.tables) - set(inspect(conn).get_table_names())
        if missing:
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
        grouped: dict[str, list[tuple]] = {kind: [] for kind in MODELS}
        for i, row in enumerate(rows):
            try:
                kind, values = normalise(row)
            except ValueError as exc:
                raise ValueError(f"rows[{i}]: {exc}") from None
            grouped[kind].append(values)
        stored = 0
        with self._write_lock, self._writer() as conn:
            for kind, batch in grouped.items():
                if batch:  # plain DB-API executemany: SQLAlchemy's per-row work costs 2x
                    stored += conn.exec_driver_sql(self._sql[kind], batch).rowcount
        return stored

    def _compile_inserts(self) -> dict[str, str]:
        """Positional INSERT SQL per row type, parameters in COLUMNS order."""
        out = {}
        for kind, names in COLUMNS.items():
            compiled = self._insert(kind).compile(dialect=self.engine.dialect,
                                                  column_keys=list(names))
            assert tuple(compiled.positiontup) == names, (kind, compiled.positiontup)
            out[kind] = str(compiled)
        return out

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
            where=(table.c.status == RUNNING) | (stmt.excluded.status != RUNNING),
        )

    def close(self) -> None:
        """Release pooled connections."""
        self.engine.dispose()

