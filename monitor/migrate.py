"""Schema migrations (Alembic, scripts in monitor/migrations): every Store brings its
database to ``HEAD`` when it opens it.

A database without tables is built by running every migration; one made before
migrations existed (tables, no ``alembic_version``) is stamped with the first revision,
whose schema it has, and upgraded from there. Opening a current store costs one small
read; an upgrade runs in one transaction that holds the database's write lock (SQLite's
BEGIN IMMEDIATE, a PostgreSQL advisory lock), so processes opening the same store at the
same moment upgrade it once.
"""
from __future__ import annotations

from pathlib import Path

from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection, Engine

HEAD = "0003"
BASELINE = "0001"
SCRIPTS = Path(__file__).resolve().parent / "migrations"
_PG_LOCK = 0x5265_6761_7474_61  # "Regatta": the advisory lock id of an upgrade


def current(conn: Connection) -> str | None:
    """The revision a database is at; "" if it has Regatta's tables but no revision
    (a store from before migrations); None if it is empty."""
    tables = set(inspect(conn).get_table_names())
    if "alembic_version" in tables:
        return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
    return "" if "run" in tables else None


def upgrade(engine: Engine) -> None:
    """Bring the database behind ``engine`` to HEAD (a no-op when it is there)."""
    with engine.connect() as conn:   # a read: does not wait for a busy writer
        if current(conn) == HEAD:
            return
    from alembic import command
    from alembic.config import Config
    with engine.connect() as conn:
        conn = conn.execution_options(sqlite_begin="IMMEDIATE")
        with conn.begin():
            if conn.dialect.name == "postgresql":
                conn.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": _PG_LOCK})
            found = current(conn)   # again, now that we hold the lock
            if found == HEAD:
                return
            cfg = Config()
            cfg.set_main_option("script_location", str(SCRIPTS))
            cfg.attributes["connection"] = conn
            if found == "":
                command.stamp(cfg, BASELINE)
            command.upgrade(cfg, "head")
