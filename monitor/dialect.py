"""Where a store lives: a SQLite file path or any SQLAlchemy URL, and what differs per
database. Only SQLite and PostgreSQL are supported; everything else in monitor/ is
written once for both.

    engine_for("runs/regatta.db")                          # SQLite file (WAL)
    engine_for("postgresql+psycopg://user@db:5432/regatta")  # PostgreSQL (psycopg 3)

SQLite gets WAL and a long busy timeout so that several writer processes (one sink per
rank on a single host) and the dashboard's readers share the file, and writers take the
write lock up front (``BEGIN IMMEDIATE``) so SQLite's busy handler waits for it instead of
failing a transaction that upgrades its lock halfway. PostgreSQL needs neither.
"""
from __future__ import annotations

import random
import sqlite3
import time

from sqlalchemy import create_engine, event
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine, make_url

BUSY_TIMEOUT_MS = 30_000
SUPPORTED = ("sqlite", "postgresql")
_INSERTS = {"sqlite": sqlite.insert, "postgresql": postgresql.insert}


def to_url(db: str) -> str:
    """A SQLAlchemy URL for ``db``: URLs pass (plain postgresql:// gets psycopg 3, the
    driver Regatta installs); anything else is a SQLite file path."""
    if "://" not in db:
        return f"sqlite:///{db}"
    url = make_url(db)
    if url.get_backend_name() not in SUPPORTED:
        raise ValueError(f"unsupported database {url.get_backend_name()!r} in --db; "
                         f"use a SQLite path or a postgresql:// URL")
    if url.drivername in ("postgresql", "postgres"):
        url = url.set(drivername="postgresql+psycopg")
    return url.render_as_string(hide_password=False)


def shown(db: str) -> str:
    """``db`` fit for logs and messages: no password."""
    return make_url(to_url(db)).render_as_string(hide_password=True) if "://" in db else db


def insert_for(dialect_name: str):
    """The dialect's INSERT construct: both have on_conflict_do_nothing/_do_update."""
    return _INSERTS[dialect_name]


def _sqlite_connect(dbapi_conn, _record) -> None:
    """Per-connection settings: busy wait first, so switching to WAL can wait too."""
    dbapi_conn.isolation_level = None  # let the "begin" hook below issue BEGIN itself
    cur = dbapi_conn.cursor()
    cur.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    _switch_to_wal(cur)
    # In WAL mode NORMAL syncs at checkpoints only: a process killed at any instant loses
    # nothing it committed (only a power cut can take back the last commits), and the
    # workers stop paying an fsync per batch of rows. A SIGKILL cannot end a process inside
    # fsync: a worker killed there kept its sockets 2 s (seen once in a chaos run).
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


def _switch_to_wal(cur) -> None:
    """Two connections switching a new file to WAL at once each hold the read lock and
    want the exclusive one; SQLite then fails one at once with "database is locked"
    without calling the busy handler (it would wait forever). Two ranks opening a
    run's new store together hit this (about 1 connection in 60 here): retry for as
    long as the busy timeout would have waited."""
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            cur.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as err:
            if "locked" not in str(err) or time.monotonic() > deadline:
                raise
            time.sleep(random.uniform(0.005, 0.05))


def _sqlite_begin(conn) -> None:
    """Writers ask for BEGIN IMMEDIATE through an execution option; readers defer."""
    mode = conn.get_execution_options().get("sqlite_begin", "DEFERRED")
    conn.exec_driver_sql(f"BEGIN {mode}")


def engine_for(db: str) -> Engine:
    """An engine for a SQLite path or a SQLAlchemy URL, set up for concurrent use."""
    url = to_url(db)
    if url.startswith("sqlite"):
        engine = create_engine(url)
        event.listen(engine, "connect", _sqlite_connect)
        event.listen(engine, "begin", _sqlite_begin)
        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=8, max_overflow=8)
