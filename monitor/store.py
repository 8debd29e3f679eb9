"""The metrics store: batched, exactly-once writes of validated rows, on SQLite or
PostgreSQL (monitor.dialect), with the schema kept current by Alembic (monitor.migrate).

Rows are plain dicts with a ``type`` (``run``, ``step``, ``event``, ``host``, ``metric``)
whose fields are the columns of that type's model (monitor.models); monitor.schema
validates them, monitor.rollup keeps the per-run summary while writing, and
monitor.queries holds the read helpers, mixed into Store.

Every batch is one transaction. A row whose uid is already stored is skipped (replays
are exactly-once); a ``run`` row upserts its run, and a stale ``running`` row never
reopens a finished or failed one. A row of any other type must belong to a run the
store knows (its run row came first, in this batch or before): UnknownRun otherwise, and
nothing of the batch is written, so a producer can send it again once the run row is in.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

from sqlalchemy import func, literal_column, select, update
from sqlalchemy.engine import Connection, Engine

from monitor import migrate, rollup
from monitor.dialect import engine_for, insert_for, shown
from monitor.models import (MODELS, RUN_STATUSES, TABLES, Base, CustomMetric, Event,
                            HostSample, Run, StepMetric)
from monitor.queries import Queries
from monitor.schema import COLUMNS, RowError, normalise, validate_row

__all__ = ["Store", "UnknownRun", "RowError", "validate_row", "MODELS", "RUN_STATUSES",
           "Base", "Run", "StepMetric", "Event", "HostSample", "CustomMetric"]
RUNNING = literal_column("'running'")
_RUN_ID = {kind: names.index("run_id") for kind, names in COLUMNS.items() if kind != "run"}
_WALL = {kind: names.index("wall_time") for kind, names in COLUMNS.items() if kind != "run"}
_UID = {kind: names.index("uid") for kind, names in COLUMNS.items() if kind != "run"}
_RETURNED = tuple(COLUMNS["step"].index(name) for name in rollup.RETURNED)
_SUMMARY = ("step_rows", "samples_done", "last_step", "first_step_at", "last_step_at",
            "world_size", "world_size_min", "world_size_max")


class UnknownRun(RowError):
    """Rows of a run whose run row the store has not seen (yet): send it first."""

    def __init__(self, run_ids: list[str]):
        shown_ids = ", ".join(repr(r[:60]) for r in run_ids[:3])
        super().__init__(f"field 'run_id': unknown run {shown_ids}; its run row must be "
                         f"stored first", "run_id")
        self.run_ids = run_ids


class Store(Queries):
    """A Regatta metrics database: ``Store(path_or_url)`` opens it, creating or upgrading
    its tables if needed."""

    def __init__(self, db: str):
        self.path = db   # as given: a SQLite path or a SQLAlchemy URL
        self.engine: Engine = engine_for(db)
        self.dialect = self.engine.dialect.name
        self._write_lock = threading.Lock()   # in-process writers take turns here
        self._insert = insert_for(self.dialect)
        self._upsert_run = self._run_upsert()
        self._positional = self.engine.dialect.positional
        self._sql = self._compile_inserts()
        migrate.upgrade(self.engine)

    def __repr__(self) -> str:
        return f"Store({shown(self.path)!r})"

    @contextmanager
    def writer(self) -> Iterator[Connection]:
        """A connection inside one write transaction, committed on success."""
        with self.engine.connect() as conn:
            conn = conn.execution_options(sqlite_begin="IMMEDIATE")
            with conn.begin():
                yield conn

    def write_rows(self, rows: list[dict]) -> int:
        """Validate every row, then write them all in ONE transaction.

        Returns the number of rows inserted or upserted. Raises RowError
        (``rows[i]: ...``) or UnknownRun before writing anything if a row is refused.
        """
        grouped: dict[str, list[tuple]] = {kind: [] for kind in MODELS}
        for i, row in enumerate(rows):
            try:
                kind, values = normalise(row)
            except RowError as exc:
                raise RowError(f"rows[{i}]: {exc}", exc.field) from None
            grouped[kind].append(values)
        with self._write_lock, self.writer() as conn:
            return self._write(conn, grouped)

    def _write(self, conn: Connection, grouped: dict) -> int:
        stored = 0
        if grouped["run"]:   # RETURNING counts on every driver (rowcount may be -1)
            params = [dict(zip(COLUMNS["run"], v)) for v in grouped["run"]]
            stored += len(conn.execute(self._upsert_run, params).all())
        newest: dict = {}
        for kind, batch in grouped.items():
            if kind != "run":
                for values in batch:
                    rid, t = values[_RUN_ID[kind]], values[_WALL[kind]]
                    newest[rid] = max(t, newest.get(rid, t))
        if not newest:
            return stored
        runs = self._lock_runs(conn, sorted(newest))
        if grouped["step"]:
            fresh = self._new_rows(conn, "step", grouped["step"])
            summary = [tuple(v[i] for i in _RETURNED) for v in fresh]
            done = rollup.done_steps(conn, summary)
            self._insert_rows(conn, "step", fresh)
            rollup.apply(conn, runs, summary, done)
            stored += len(fresh)
        for kind in ("event", "host", "metric"):
            if grouped[kind]:
                fresh = self._new_rows(conn, kind, grouped[kind])
                self._insert_rows(conn, kind, fresh)
                stored += len(fresh)
        for rid, t in newest.items():
            seen = runs[rid]["last_seen_at"]
            if seen is None or t > seen:
                conn.execute(update(Run).where(Run.id == rid).values(last_seen_at=t))
        return stored

    def _lock_runs(self, conn: Connection, ids: list[str]) -> dict:
        """The summaries of these runs, their rows locked for this transaction (on
        PostgreSQL; SQLite's writer holds the whole database); UnknownRun if any is
        missing."""
        cols = [Run.id, Run.last_seen_at] + [getattr(Run, c) for c in _SUMMARY]
        found = {}
        for i in range(0, len(ids), 500):
            stmt = select(*cols).where(Run.id.in_(ids[i:i + 500])).order_by(Run.id)
            for row in conn.execute(stmt.with_for_update()):
                found[row.id] = row._asdict()
        missing = [rid for rid in ids if rid not in found]
        if missing:
            raise UnknownRun(missing)
        return found

    def _new_rows(self, conn: Connection, kind: str, batch: list[tuple]) -> list[tuple]:
        """The rows whose uid is not stored yet (nor earlier in the batch). The runs'
        locks (SQLite: the database's) keep another writer of the same run from racing
        this check; the INSERT's ON CONFLICT DO NOTHING stays as the last guard."""
        i = _UID[kind]
        uid = TABLES[kind].c.uid
        uids = [v[i] for v in batch if v[i] is not None]
        seen = set()
        for j in range(0, len(uids), 500):
            seen.update(u for (u,) in conn.execute(select(uid).where(uid.in_(uids[j:j + 500]))))
        fresh = []
        for v in batch:
            if v[i] is None or v[i] not in seen:
                fresh.append(v)
                if v[i] is not None:
                    seen.add(v[i])
        return fresh

    def _insert_rows(self, conn: Connection, kind: str, rows: list[tuple]) -> None:
        if rows:   # plain DB-API executemany: SQLAlchemy's per-row work costs 3x
            params = rows if self._positional else [dict(zip(COLUMNS[kind], v)) for v in rows]
            conn.exec_driver_sql(self._sql[kind], params)

    def _compile_inserts(self) -> dict[str, str]:
        """INSERT SQL per row type for the driver, parameters in COLUMNS order."""
        out = {}
        for kind, names in COLUMNS.items():
            if kind == "run":
                continue
            stmt = self._insert(TABLES[kind]).on_conflict_do_nothing(index_elements=["uid"])
            compiled = stmt.compile(dialect=self.engine.dialect, column_keys=list(names))
            if self._positional:
                assert tuple(compiled.positiontup) == names, (kind, compiled.positiontup)
            out[kind] = str(compiled)
        return out

    def _run_upsert(self):
        """Insert a run, or update the status, finish time and error of a known one."""
        table = TABLES["run"]
        stmt = self._insert(table)
        # A stale 'running' row (a replay) must not reopen a finished or failed run;
        # name, tags, notes and config come with the first row only (and the API edits).
        reopen = (table.c.status == RUNNING) | (stmt.excluded.status != RUNNING)
        return stmt.on_conflict_do_update(
            index_elements=["id"],
            set_={"status": stmt.excluded.status,
                  "finished_at": func.coalesce(stmt.excluded.finished_at, table.c.finished_at),
                  "error": func.coalesce(stmt.excluded.error, table.c.error)},
            where=reopen).returning(table.c.id)

    def close(self) -> None:
        """Release pooled connections."""
        self.engine.dispose()
