"""A local file of rows that a sink could not deliver yet (JSON lines, one row a line).

Rows are appended at the end and replayed from the front. The read position is kept in
memory only: after a crash the next owner replays the whole file, and the rows' uids
make the repeats harmless. The file is truncated once everything in it was delivered.

A live owner holds an exclusive ``flock`` on its spool, so another process can tell a
spool left behind by a dead producer (lock free) from a live one and adopt its rows.
"""
from __future__ import annotations

import fcntl
import glob
import json
import logging
import os
import threading

log = logging.getLogger("regatta.monitor.spool")


def _lock(fh) -> bool:
    """Take the exclusive lock without waiting; False if another owner holds it."""
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _encode(rows: list[dict]) -> bytes:
    return b"".join(json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in rows)


def _decode(lines: list[bytes], path: str) -> list[dict]:
    rows = []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line torn by a crash mid-append: nothing to recover
            log.warning("spool %s: skipping unreadable line %r", path, line[:80])
    return rows


class Spool:
    """Thread-safe append/replay file owned by one producer (see module docstring)."""

    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._mutex = threading.Lock()
        self._fh = open(path, "a+b")
        if not _lock(self._fh):
            self._fh.close()
            raise RuntimeError(f"spool {path} is owned by another live process")
        self._fh.seek(0)
        data = self._fh.read()
        if data and not data.endswith(b"\n"):
            self._fh.write(b"\n")  # isolate a torn last line from the next append
            self._fh.flush()
        self._pending = data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)
        self._offset = 0  # bytes already delivered, from the front

    def __len__(self) -> int:
        """Rows (lines) not yet delivered."""
        return self._pending

    def append(self, rows: list[dict]) -> None:
        """Add rows at the end (written through to the OS before returning)."""
        if not rows:
            return
        data = _encode(rows)
        with self._mutex:
            self._fh.seek(0, os.SEEK_END)
            self._fh.write(data)
            self._fh.flush()
            self._pending += len(rows)

    def peek(self, n: int) -> tuple[list[dict], tuple[int, int]]:
        """Up to n oldest undelivered rows, and a token to pass to ``consume``."""
        with self._mutex:
            self._fh.seek(self._offset)
            lines = []
            while len(lines) < n:
                line = self._fh.readline()
                if not line:
                    break
                lines.append(line)
            end = self._offset + sum(len(line) for line in lines)
        return _decode(lines, self.path), (end, len(lines))

    def consume(self, token: tuple[int, int]) -> None:
        """Mark the rows returned by the ``peek`` that gave ``token`` as delivered."""
        end, n_lines = token
        with self._mutex:
            self._pending -= n_lines
            self._offset = end
            if self._offset >= os.fstat(self._fh.fileno()).st_size:
                self._fh.truncate(0)  # all delivered: nothing can be lost by emptying it
                self._offset = 0
                self._pending = 0

    def adopt(self, pattern: str) -> int:
        """Move rows of dead producers' spools (glob ``pattern`` in this spool's folder)
        into this one and delete them. Returns the number of rows adopted."""
        adopted = 0
        folder = os.path.dirname(os.path.abspath(self.path))
        for other in sorted(glob.glob(os.path.join(folder, pattern))):
            if os.path.abspath(other) == os.path.abspath(self.path):
                continue
            with open(other, "rb") as fh:
                if not _lock(fh):
                    continue  # its producer is alive
                rows = _decode(fh.read().splitlines(), other)
                self.append(rows)  # a crash before the unlink only causes repeats
                os.unlink(other)
            adopted += len(rows)
            log.info("adopted %d rows from %s", len(rows), other)
        return adopted

    def close(self) -> None:
        """Release the file (and its lock); an empty spool is removed."""
        with self._mutex:
            if self._fh.closed:
                return
            empty = self._pending == 0
            if empty:
                os.unlink(self.path)  # while still locked, so nobody adopts a ghost
            self._fh.close()
