"""Deliver rows that finished producers left in their spools: ``regatta replay``.

    regatta replay                               # every spool in $REGATTA_SPOOL_DIR
    regatta replay --spool-dir /tmp/regatta-spool --ingest http://dash:8050
    regatta replay --db runs/regatta.db          # only the rows meant for this store
    .venv/bin/python -m monitor.replay [same options]

A sink that cannot deliver keeps its rows in ``<tag>.<producer>.jsonl`` in the spool
folder, and ``<tag>.dest`` names where they were going (monitor.queued). Here every such
file whose producer is gone (its lock is free) is delivered to its destination in
batches, then deleted; uids make a second delivery harmless, so rows are stored exactly
once. Rows refused as invalid go to ``<file>.rejected``; rows whose run row sits in
another file are tried again after the other files (a few passes). The ingest token
comes from REGATTA_INGEST_TOKEN or ``--token-file``. The dashboard server runs the same
replay, into its own store, when it starts (webui.serve).
"""
from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Callable, Optional

from monitor.queued import NotYet, Rejected
from monitor.spool import claim, decode_lines, default_spool_dir, forget_destination, spool_tag

log = logging.getLogger("regatta.monitor.replay")
BATCH = 500
PASSES = 5


@dataclass
class ReplayReport:
    delivered: int = 0
    rejected: int = 0
    files_done: int = 0
    left: dict = field(default_factory=dict)   # file -> why its rows are still there


def destinations(spool_dir: str) -> dict[str, str]:
    """tag -> the destination recorded for it."""
    out = {}
    for path in glob.glob(os.path.join(spool_dir, "*.dest")):
        try:
            with open(path, encoding="utf-8") as fh:
                out[os.path.basename(path)[:-5]] = fh.read().strip()
        except OSError:
            continue
    return out


def deliverer(destination: str, token: Optional[str]) -> tuple[Callable, Callable]:
    """(deliver(rows), close()) for a recorded destination."""
    from monitor.sink import post_rows, store_rows
    if destination.startswith(("http://", "https://")):
        return (lambda rows: post_rows(destination, token, rows)), (lambda: None)
    from monitor.store import Store
    store = Store(destination[len("sqlite:"):] if destination.startswith("sqlite:") else destination)
    return (lambda rows: store_rows(store, rows)), store.close


def replay(spool_dir: Optional[str] = None, only: Optional[str] = None,
           token: Optional[str] = None,
           deliver: Optional[Callable[[list], None]] = None,
           match: Optional[Callable[[str], bool]] = None) -> ReplayReport:
    """Deliver every abandoned spool file in ``spool_dir``. ``only``: just the files of
    this destination (monitor.sink.destination_of). ``deliver``/``match``: deliver the
    files whose destination ``match`` accepts with ``deliver`` (the server's own store)."""
    spool_dir = spool_dir or default_spool_dir()
    report = ReplayReport()
    dests = destinations(spool_dir)
    if only is not None:
        dests = {spool_tag(only): only}
    for tag, destination in sorted(dests.items()):
        if match is not None and not match(destination):
            continue
        files = sorted(glob.glob(os.path.join(spool_dir, f"{tag}.*.jsonl")))
        if not files:
            continue
        send, close = (deliver, lambda: None) if deliver else deliverer(destination, token)
        try:
            _replay_files(files, send, report)
        finally:
            close()
        forget_destination(spool_dir, tag)
    return report


def _replay_files(files: list[str], send: Callable, report: ReplayReport) -> None:
    """Deliver the files' rows, run rows first, in passes until nothing more moves."""
    handles = {}
    try:
        for path in files:
            fh = claim(path)
            if fh is not None:   # else a live producer's: it will deliver them itself
                handles[path] = fh
        pending = {path: decode_lines(fh.read().splitlines(), path) for path, fh in handles.items()}
        for path in pending:
            pending[path].sort(key=lambda r: not (isinstance(r, dict) and r.get("type") == "run"))
        for _ in range(PASSES):
            moved = False
            for path in list(pending):
                rows, why = _send_all(pending[path], send, path, report)
                moved = moved or len(rows) < len(pending[path])
                if rows:
                    pending[path] = rows
                    report.left[path] = why
                else:
                    del pending[path]
                    report.left.pop(path, None)
                    os.unlink(path)   # while still locked: nobody adopts a ghost
                    report.files_done += 1
            if not pending or not moved:
                break
        for path, rows in pending.items():   # what stays: exactly what was not delivered
            with open(path + ".tmp", "w", encoding="utf-8") as out:
                out.writelines(json.dumps(r) + "\n" for r in rows)
            os.replace(path + ".tmp", path)
    finally:
        for fh in handles.values():
            fh.close()


def _send_all(rows: list, send: Callable, path: str, report: ReplayReport) -> tuple[list, str]:
    """Deliver rows in batches; the rows still to deliver and why."""
    left, why = [], ""
    for i in range(0, len(rows), BATCH):
        batch = rows[i:i + BATCH]
        try:
            send(batch)
            report.delivered += len(batch)
        except Rejected as exc:
            with open(path + ".rejected", "a", encoding="utf-8") as fh:
                fh.writelines(json.dumps(r) + "\n" for r in batch)
            report.rejected += len(batch)
            log.error("%s: %d rows refused (%s); kept in %s.rejected", path, len(batch), exc, path)
        except NotYet as exc:
            left += batch
            why = str(exc)
        except Exception as exc:  # noqa: BLE001 - destination down: keep the rest
            return left + rows[i:], f"{type(exc).__name__}: {exc}"
    return left, why


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``replay`` to the ``regatta`` command's subparsers; it runs ``main(args)``."""
    p = subparsers.add_parser("replay", help="deliver rows left in sink spools",
                              description=__doc__.splitlines()[0])
    p.add_argument("--spool-dir", default=None,
                   help="folder of the spools (default: $REGATTA_SPOOL_DIR or <tmp>/regatta-spool)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--db", help="only rows meant for this store (SQLite path or URL)")
    where.add_argument("--ingest", metavar="URL", help="only rows meant for this dashboard")
    p.add_argument("--token-file", help="file holding the ingest token "
                                        "(default: $REGATTA_INGEST_TOKEN)")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    """Run ``regatta replay``; exit status 0 when nothing was left behind."""
    from monitor.sink import destination_of
    token = os.environ.get("REGATTA_INGEST_TOKEN")
    if args.token_file:
        with open(args.token_file, encoding="utf-8") as fh:
            token = fh.read().strip()
    only = destination_of(db=args.db, ingest=args.ingest) if (args.db or args.ingest) else None
    report = replay(args.spool_dir, only=only, token=token)
    print(f"replayed {report.delivered} rows from {report.files_done} spool files"
          f"{f'; {report.rejected} rows refused' if report.rejected else ''}")
    for path, why in report.left.items():
        print(f"  left in {path}: {why}", file=sys.stderr)
    return 1 if report.left else 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m monitor.replay")
    add_parser(_parser.add_subparsers(dest="command", required=True))
    sys.exit(main(_parser.parse_args(["replay", *sys.argv[1:]])))
