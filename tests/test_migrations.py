"""Migrations: a store made before this schema (the first release's, which had no
Alembic) opens after the upgrade with its rows, summaries and new columns; a store at
the baseline revision on PostgreSQL upgrades too; concurrent openers upgrade once, and
processes opening a new SQLite store at the same instant all open it."""
import multiprocessing
import sqlite3
import threading
import time

from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, text

from monitor import migrate
from monitor.store import Store

# The schema the first release's Store created (SQLite), verbatim.
FIRST_RELEASE = """
CREATE TABLE run (
	id VARCHAR NOT NULL, 
	job VARCHAR NOT NULL, 
	status VARCHAR NOT NULL, 
	started_at DOUBLE NOT NULL, 
	finished_at DOUBLE, 
	config TEXT NOT NULL, 
	launcher VARCHAR NOT NULL, 
	PRIMARY KEY (id)
);
CREATE TABLE step_metric (
	id INTEGER NOT NULL, 
	run_id VARCHAR NOT NULL, 
	step INTEGER NOT NULL, 
	wall_time DOUBLE NOT NULL, 
	rank INTEGER NOT NULL, 
	world_size INTEGER NOT NULL, 
	host VARCHAR NOT NULL, 
	slot INTEGER NOT NULL, 
	stage INTEGER NOT NULL, 
	step_time DOUBLE NOT NULL, 
	data_time DOUBLE NOT NULL, 
	compute_time DOUBLE NOT NULL, 
	comm_time DOUBLE NOT NULL, 
	wait_time DOUBLE NOT NULL, 
	samples INTEGER NOT NULL, 
	bytes_sent INTEGER NOT NULL, 
	loss DOUBLE, 
	lr DOUBLE, 
	uid VARCHAR, 
	PRIMARY KEY (id), 
	UNIQUE (uid)
);
CREATE INDEX ix_step_run_host_slot ON step_metric (run_id, host, slot);
CREATE INDEX ix_step_run_step ON step_metric (run_id, step);
CREATE TABLE event (
	id INTEGER NOT NULL, 
	run_id VARCHAR NOT NULL, 
	wall_time DOUBLE NOT NULL, 
	step INTEGER, 
	kind VARCHAR NOT NULL, 
	host VARCHAR, 
	rank INTEGER, 
	detail TEXT NOT NULL, 
	uid VARCHAR, 
	PRIMARY KEY (id), 
	UNIQUE (uid)
);
CREATE INDEX ix_event_run_time ON event (run_id, wall_time);
CREATE INDEX ix_event_run_kind ON event (run_id, kind);
CREATE TABLE host_sample (
	id INTEGER NOT NULL, 
	run_id VARCHAR NOT NULL, 
	host VARCHAR NOT NULL, 
	wall_time DOUBLE NOT NULL, 
	cpu_percent DOUBLE NOT NULL, 
	rss_bytes INTEGER NOT NULL, 
	gpu_util DOUBLE, 
	gpu_mem INTEGER, 
	uid VARCHAR, 
	PRIMARY KEY (id), 
	UNIQUE (uid)
);
CREATE INDEX ix_host_run_host_time ON host_sample (run_id, host, wall_time);

"""
ROWS = """
INSERT INTO run VALUES ('old', 'digits', 'finished', 100.0, 160.0, '{"steps": 3}', 'local');
INSERT INTO run VALUES ('bad', 'digits', 'running', 100.0, NULL, '{oops', 'local');
INSERT INTO step_metric (run_id, step, wall_time, rank, world_size, host, slot, stage,
  step_time, data_time, compute_time, comm_time, wait_time, samples, bytes_sent, loss, lr, uid)
VALUES ('old', 1, 110.0, 0, 2, 'a', 0, 0, 1.0, 0, 0.5, 0.2, 0, 8, 0, 2.0, 0.1, 'u1'),
       ('old', 1, 110.5, 1, 2, 'b', 0, 0, 1.0, 0, 0.5, 0.2, 0, 8, 0, 2.0, 0.1, 'u2'),
       ('old', 2, 120.0, 0, 2, 'a', 0, 0, 1.0, 0, 0.5, 0.2, 0, 8, 0, 1.5, 0.1, 'u3'),
       ('old', 2, 121.0, 1, 2, 'b', 0, 0, 1.0, 0, 0.5, 0.2, 0, 8, 0, 1.5, 0.1, 'u4');
INSERT INTO event (run_id, wall_time, step, kind, host, rank, detail, uid)
VALUES ('old', 130.0, 2, 'commit', 'a', 0, 'not json', 'e1');
"""


def test_a_first_release_store_opens_after_the_upgrade(tmp_path):
    path = str(tmp_path / "old.db")
    with sqlite3.connect(path) as conn:
        conn.executescript(FIRST_RELEASE + ROWS)
    store = Store(path)
    with store.engine.connect() as conn:
        assert migrate.current(conn) == migrate.HEAD
    run = store.run("old")
    assert (run["status"], run["step_rows"], run["last_step"], run["world_size"]) == (
        "finished", 4, 2, 2)
    assert run["throughput"] == 32 / 11.0   # 4 rows of 8 samples over 110..121 s
    assert (run["tags"], run["notes"], run["name"]) == ([], "", None)
    assert [p["key"] for p in run["processes"]] == ["a:0", "b:0"]
    assert run["last_seen_at"] == 130.0
    assert store.runs(q="bad")[0]["config"] == {}   # a bad row stored long ago still reads
    assert store.events("old")[0]["detail"] == {}
    store.write_rows([{"type": "step", "run_id": "old", "step": 3, "wall_time": 140.0,
                       "rank": 0, "world_size": 1, "host": "a", "step_time": 1.0,
                       "samples": 8, "replica": 0, "bubble": 0.25, "overlap": 0.5},
                      {"type": "metric", "run_id": "old", "name": "eval/acc", "value": 0.9,
                       "step": 3, "wall_time": 141.0}])
    assert store.run("old")["step_rows"] == 5
    assert store.metric_points("old", "eval/acc")["value"] == [0.9]
    store.close()
    Store(path).close()   # opening a current store again changes nothing


def test_a_baseline_store_upgrades_on_postgresql(postgres):
    url = postgres.new_database()
    engine = create_engine(url)
    cfg = Config()
    cfg.set_main_option("script_location", str(migrate.SCRIPTS))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, migrate.BASELINE)
        conn.execute(text("INSERT INTO run VALUES ('old', 'digits', 'running', 1.0, NULL, "
                          "'{}', 'local')"))
        conn.execute(text("INSERT INTO step_metric (run_id, step, wall_time, rank, world_size, "
                          "host, slot, stage, step_time, data_time, compute_time, comm_time, "
                          "wait_time, samples, bytes_sent) VALUES ('old', 7, 5.0, 0, 1, 'a', 0, "
                          "0, 1.0, 0, 0, 0, 0, 4, 0)"))
    engine.dispose()
    openers = [threading.Thread(target=lambda: Store(url).close()) for _ in range(4)]
    for t in openers:
        t.start()
    for t in openers:
        t.join(timeout=60)
    store = Store(url)
    run = store.run("old")
    assert (run["last_step"], run["step_rows"], run["world_size"]) == (7, 1, 1)
    with store.engine.connect() as conn:
        assert migrate.current(conn) == migrate.HEAD
    store.close()


def _open_at(db: str, start: float, results) -> None:
    while time.time() < start:
        pass
    try:
        Store(db).close()
        results.put("ok")
    except Exception as err:           # noqa: BLE001 - the message is what is asserted
        results.put(f"{type(err).__name__}: {err}")


def test_processes_opening_a_new_sqlite_store_at_once_all_open_it(tmp_path):
    """Ranks open their run's new store together. Switching a new file to WAL from two
    connections at once made SQLite refuse one at once ("database is locked", no busy
    wait): about 1 connection in 60 here, enough to end a rank of the CI's run."""
    fork = multiprocessing.get_context("fork")
    results, outcomes = fork.Queue(), []
    for attempt in range(30):
        db = str(tmp_path / f"m{attempt}.db")
        start = time.time() + 0.2
        openers = [fork.Process(target=_open_at, args=(db, start, results)) for _ in range(4)]
        for p in openers:
            p.start()
        for p in openers:
            p.join(timeout=60)
        outcomes += [results.get(timeout=10) for _ in openers]
    assert outcomes == ["ok"] * 120, [o for o in outcomes if o != "ok"][:3]
    store = Store(str(tmp_path / "m0.db"))
    with store.engine.connect() as conn:
        assert migrate.current(conn) == migrate.HEAD
    store.close()
