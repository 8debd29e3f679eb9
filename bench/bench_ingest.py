"""Batched versus row-by-row ingest into the Regatta store, measured side by side.

    .venv/bin/python bench/bench_ingest.py [--rows 50000] [--batch 1000] [--single 1000]
    .venv/bin/python bench/bench_ingest.py --db postgresql+psycopg://user@host/empty_db

Writes realistic ``step`` rows into a fresh SQLite store (WAL, default synchronous mode,
the same settings the dashboard server uses) in a temporary folder (or the store at
``--db``), keeping the per-run summary as the server does, first in batches of
``--batch`` rows per ``Store.write_rows`` call (one transaction each), then one
transaction per row, and prints both rates and their ratio. Goals: at least 20,000
rows/s batched and at least 100x the row-by-row rate.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from monitor.store import Store  # noqa: E402

GOAL_ROWS_PER_S, GOAL_RATIO = 20_000, 100


@dataclass
class BenchConfig:
    rows: int = 50_000    # rows written in batches
    batch: int = 1000     # rows per batch (one transaction)
    single: int = 1000    # rows written one transaction each (slow: keep it small)
    folder: str = ""      # where the database goes; default: a fresh temporary folder
    db: str = ""          # a store URL instead (an empty PostgreSQL database, say)


def make_rows(n: int, prefix: str) -> list[dict]:
    """n step rows of 8 ranks over n/8 steps, with every metric filled in."""
    return [{"type": "step", "run_id": "bench", "step": i // 8, "wall_time": 1e9 + i * 0.01,
             "rank": i % 8, "world_size": 8, "host": f"node{i % 8 // 4}", "slot": i % 4,
             "step_time": 0.1, "data_time": 0.01, "compute_time": 0.06, "comm_time": 0.03,
             "wait_time": 0.0, "samples": 64, "bytes_sent": 4_000_000, "loss": 1.0 / (i + 1),
             "lr": 0.01, "uid": f"{prefix}:{i}"} for i in range(n)]


def rate(store: Store, rows: list[dict], batch: int) -> float:
    """Rows per second writing ``rows`` in chunks of ``batch``."""
    started = time.perf_counter()
    for i in range(0, len(rows), batch):
        store.write_rows(rows[i:i + batch])
    return len(rows) / (time.perf_counter() - started)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cfg = BenchConfig()
    for name, value in vars(cfg).items():
        parser.add_argument(f"--{name}", type=type(value), default=value)
    cfg = BenchConfig(**vars(parser.parse_args(argv)))
    with tempfile.TemporaryDirectory(dir=cfg.folder or None) as folder:
        store = Store(cfg.db or os.path.join(folder, "bench.db"))
        store.write_rows([{"type": "run", "id": "bench", "job": "bench", "status": "running",
                           "started_at": 1e9}])
        store.write_rows(make_rows(100, "warmup"))  # connection, pages and caches warm
        batched = rate(store, make_rows(cfg.rows, "batched"), cfg.batch)
        single = rate(store, make_rows(cfg.single, "single"), 1)
        total = store.count("step")
        store.close()
    assert total == 100 + cfg.rows + cfg.single, total  # every row stored exactly once
    ratio = batched / single
    print(f"batched ({cfg.batch} rows/transaction): {batched:12,.0f} rows/s "
          f"({cfg.rows} rows)  goal >= {GOAL_ROWS_PER_S:,}: "
          f"{'met' if batched >= GOAL_ROWS_PER_S else 'MISSED'}")
    print(f"one transaction per row:          {single:12,.0f} rows/s ({cfg.single} rows)")
    print(f"ratio batched / per-row:          {ratio:12,.1f}x  goal >= {GOAL_RATIO}x: "
          f"{'met' if ratio >= GOAL_RATIO else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
