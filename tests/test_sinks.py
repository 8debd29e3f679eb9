"""Sinks: concurrent writer processes, non-blocking emit, spool adoption, the factory."""
import json
import multiprocessing as mp
import subprocess
import sys
import time

import pytest

from monitor.sink import HttpSink, NullSink, SinkConfig, SQLiteSink, make_sink
from monitor.spool import Spool
from monitor.store import Store

ROWS_PER_PROCESS = 2000


def step_row(rank, step):
    return {"type": "step", "run_id": "r1", "step": step, "wall_time": float(step),
            "rank": rank, "world_size": 4, "host": f"h{rank}", "step_time": 0.01,
            "samples": 8}


def _writer(db, spool_dir, rank, barrier, results):
    """One rank: emit its rows as fast as it can, then report what went wrong, if anything."""
    sink = SQLiteSink(db, spool_dir=spool_dir,
                      config=SinkConfig(batch_size=100, flush_interval=0.05))
    barrier.wait(timeout=60)  # all four write at the same time
    for s in range(ROWS_PER_PROCESS):
        sink.emit(step_row(rank, s))
    sink.close(timeout=60)
    results.put((rank, sink.failures, sink.spooled))


def test_four_processes_share_one_store(tmp_path):
    db = str(tmp_path / "m.db")
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(db, str(tmp_path / "spool"), r, barrier, results))
             for r in range(4)]
    for p in procs:
        p.start()
    try:
        reports = sorted(results.get(timeout=90) for _ in procs)
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    # no delivery ever failed (a 'database is locked' would count), nothing left spooled
    assert reports == [(r, 0, 0) for r in range(4)]
    store = Store(db)
    assert store.count("step") == 4 * ROWS_PER_PROCESS
    for rank in range(4):
        series = store.step_series("r1", "samples", max_points=10_000)["series"][rank]
        assert series["step"] == list(range(ROWS_PER_PROCESS))


HOLD_LOCK = """
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
conn.execute("COMMIT")
"""


def test_emit_does_not_block_on_a_locked_database(tmp_path):
    """Another process holds the write lock; emits (including queue overflow spilled
    to the spool) return at once, and every row is stored exactly once afterwards."""
    db = str(tmp_path / "m.db")
    Store(db).close()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, db, "2.0"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        sink = SQLiteSink(db, spool_dir=str(tmp_path / "spool"),
                          config=SinkConfig(batch_size=200, queue_size=500,
                                            flush_interval=0.05))
        slowest, started = 0.0, time.perf_counter()
        for s in range(3000):
            t = time.perf_counter()
            sink.emit(step_row(0, s))
            slowest = max(slowest, time.perf_counter() - t)
        elapsed = time.perf_counter() - started
        assert holder.poll() is None, "the lock was released before emitting finished"
        assert sink.spooled > 0  # the queue overflowed and rows went to disk instead
        assert elapsed < 1.5 and slowest < 0.1, (elapsed, slowest)
        assert holder.wait(timeout=30) == 0
        sink.close(timeout=60)
    finally:
        if holder.poll() is None:
            holder.kill()
    assert sink.spooled == 0
    assert Store(db).count("step") == 3000


def test_flush_waits_for_delivery(tmp_path):
    db = str(tmp_path / "m.db")
    sink = SQLiteSink(db, spool_dir=str(tmp_path / "spool"),
                      config=SinkConfig(flush_interval=30.0))  # only flush() sends now
    for s in range(7):
        sink.emit(step_row(1, s))
    assert sink.flush(timeout=30)
    assert Store(db).count("step") == 7
    sink.close()
    with pytest.raises(RuntimeError):
        sink.emit(step_row(1, 8))


def test_bad_row_raises_at_emit(tmp_path):
    with SQLiteSink(str(tmp_path / "m.db"), spool_dir=str(tmp_path / "s")) as sink:
        with pytest.raises(ValueError, match="unknown field 'speed'"):
            sink.emit(dict(step_row(0, 0), speed=3))


def test_orphaned_spool_is_adopted(tmp_path):
    """A producer that died with rows spooled: the next sink for the same destination
    delivers them; a live producer's spool is left alone."""
    db, spool_dir = str(tmp_path / "m.db"), tmp_path / "spool"
    probe = SQLiteSink(db, spool_dir=str(spool_dir))
    tag = probe._spool.path.rsplit("/", 1)[1].split(".")[0]  # destination's file prefix
    probe.close()
    dead = spool_dir / f"{tag}.deadhost-1-aaaaaa.jsonl"
    rows = [dict(step_row(2, s), uid=f"dead:{s}") for s in range(5)]
    dead.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"torn')
    alive = Spool(str(spool_dir / f"{tag}.livehost-2-bbbbbb.jsonl"))
    alive.append([dict(step_row(3, 0), uid="live:0")])
    with SQLiteSink(db, spool_dir=str(spool_dir)) as sink:
        assert sink.flush(timeout=30)
    assert not dead.exists()
    assert len(alive) == 1
    alive.close()
    assert Store(db).count("step") == 5


def test_make_sink_picks_the_implementation(tmp_path):
    spool = str(tmp_path / "spool")
    assert isinstance(make_sink(), NullSink)
    with make_sink(db=str(tmp_path / "m.db"), spool_dir=spool) as sink:
        assert isinstance(sink, SQLiteSink)
    with make_sink(db=str(tmp_path / "m.db"), ingest="http://127.0.0.1:9", token="t",
                   spool_dir=spool) as sink:
        assert isinstance(sink, HttpSink) and sink.endpoint == "http://127.0.0.1:9/api/v1/ingest"
