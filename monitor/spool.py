"""A local file of rows that a sink could not deliver yet (JSON lines, one row a line).

Rows are appended at the end and replayed from the front. The read position is kept in
memory only: after a crash the next owner replays the whole file, and the rows' uids
make the repeats harmless. The file is truncated once everything in it was delivered, and
rewritten without its delivered front once that front is half of it: rows that wait for
their run row go round to the back on every replay, and without the rewrite a spool that
waits for hours grows by all of them each time (and whoever adopts it reads it all).

A live owner holds an exclusive ``flock`` on its spool, so another process can tell a
spool left behind by a dead producer (lock free) from a live one and adopt its rows.
"""
from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import logging
import os
import tempfile
import threading
import time

log = logging.getLogger("regatta.monitor.spool")

COMPACT_MIN = 64 << 10   # a delivered front smaller than this is not worth a rewrite


def try_lock(fh) -> bool:
    """Take the exclusive lock without waiting; False if another owner holds it."""
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def claim(path: str):
    """A dead producer's spool, opened and locked, or None while its owner lives (or when
    the file under that name changed while we locked: a live owner rewrote it)."""
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        return None
    try:
        if try_lock(fh) and os.stat(path).st_ino == os.fstat(fh.fileno()).st_ino:
            return fh
    except FileNotFoundError:   # removed while we locked: delivered, or rewritten away
        pass
    fh.close()
    return None


def _open_locked(path: str, patience_s: float = 10.0):
    """``path`` opened for appending and locked. A new file exists for an instant before
    its lock: a producer starting at that instant (restarted workers start together) may
    take it for a dead one's, adopt it (empty) and remove it. Then open it anew. The
    adopter holds the lock while it moves rows, longer when the machine is busy: hence
    the patience."""
    deadline = time.monotonic() + patience_s
    while True:
        fh = open(path, "a+b")
        try:
            if try_lock(fh) and os.stat(path).st_ino == os.fstat(fh.fileno()).st_ino:
                return fh
        except FileNotFoundError:   # removed after we locked it
            pass
        fh.close()
        if time.monotonic() > deadline:
            raise RuntimeError(f"spool {path} is owned by another live process")
        time.sleep(0.01)


def _encode(rows: list[dict]) -> bytes:
    return b"".join(json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in rows)


def decode_lines(lines: list[bytes], path: str) -> list[dict]:
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
        self._fh = _open_locked(path)
        if os.path.exists(self._compacting):   # a rewrite cut short: the original is whole
            os.unlink(self._compacting)
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
        """Add rows at the end (written through to the OS before returning); on OSError
        (a full disk) nothing of them is left in the file."""
        if not rows:
            return
        data = memoryview(_encode(rows))
        with self._mutex:
            fd = self._fh.fileno()   # opened for appending: every write lands at the end
            size = os.fstat(fd).st_size
            try:
                while data:
                    data = data[os.write(fd, data):]
            except OSError:
                os.ftruncate(fd, size)   # a full disk leaves no torn line behind
                raise
            self._pending += len(rows)

    def peek(self, n: int) -> tuple[list[dict], tuple[int, int]]:
        """Up to n oldest undelivered rows, and a token to pass to ``consume``."""
        with self._mutex:   # pread: appends go through os.write, not a read buffer
            fd, pos, lines, tail = self._fh.fileno(), self._offset, [], b""
            while len(lines) < n:
                chunk = os.pread(fd, 1 << 20, pos)
                if not chunk:
                    break
                pos += len(chunk)
                parts = (tail + chunk).split(b"\n")
                tail = parts.pop()
                lines += [p + b"\n" for p in parts]
            if len(lines) < n and tail:
                lines.append(tail)   # a last line without its newline (torn)
            lines = lines[:n]
            end = self._offset + sum(len(line) for line in lines)
        return decode_lines(lines, self.path), (end, len(lines))

    def consume(self, token: tuple[int, int]) -> None:
        """Mark the rows returned by the ``peek`` that gave ``token`` as delivered."""
        end, n_lines = token
        with self._mutex:
            self._pending -= n_lines
            self._offset = end
            size = os.fstat(self._fh.fileno()).st_size
            if self._offset >= size:
                self._fh.truncate(0)  # all delivered: nothing can be lost by emptying it
                self._offset = 0
                self._pending = 0
            elif self._offset >= max(COMPACT_MIN, size // 2):
                self._compact()

    @property
    def _compacting(self) -> str:
        return self.path + ".compacting"   # not matched by adopters' ``*.jsonl`` patterns

    def _compact(self) -> None:
        """Replace the file by its undelivered rows (mutex held). The copy is locked before
        it takes the file's name, so no adopter can take it; a crash before the rename
        leaves the original whole."""
        new = open(self._compacting, "a+b")   # appending, as the file it replaces
        try:
            try_lock(new)
            new.truncate(0)
            fd, pos = self._fh.fileno(), self._offset
            while chunk := os.pread(fd, 1 << 20, pos):
                new.write(chunk)
                pos += len(chunk)
            new.flush()
            os.replace(self._compacting, self.path)
        except OSError as exc:   # a full disk: keep the longer file, it is still correct
            new.close()
            if os.path.exists(self._compacting):
                os.unlink(self._compacting)
            log.warning("spool %s: cannot rewrite without its delivered rows: %s", self.path, exc)
            return
        self._fh.close()   # the replaced file; its lock goes with it, ``new`` holds its own
        self._fh, self._offset = new, 0

    def adopt(self, pattern: str) -> int:
        """Move rows of dead producers' spools (glob ``pattern`` in this spool's folder)
        into this one and delete them. Run rows go first: another producer's steps may
        need them. Returns the number of rows adopted."""
        folder = os.path.dirname(os.path.abspath(self.path))
        taken, rows = [], []
        try:
            for other in sorted(glob.glob(os.path.join(folder, pattern))):
                if os.path.abspath(other) == os.path.abspath(self.path):
                    continue
                fh = claim(other)
                if fh is None:
                    continue  # its producer is alive
                taken.append((other, fh))
                rows += decode_lines(fh.read().splitlines(), other)
            rows.sort(key=lambda r: not (isinstance(r, dict) and r.get("type") == "run"))
            self.append(rows)  # a crash before the unlinks only causes repeats
            for other, _ in taken:
                os.unlink(other)
                log.info("adopted the rows of %s", other)
        finally:
            for _, fh in taken:
                fh.close()
        return len(rows)

    def close(self) -> None:
        """Release the file (and its lock); an empty spool is removed."""
        with self._mutex:
            if self._fh.closed:
                return
            empty = self._pending == 0
            if empty:
                os.unlink(self.path)  # while still locked, so nobody adopts a ghost
            self._fh.close()


# -- where spools live and what they were for (monitor.replay reads it) ---------------

def default_spool_dir() -> str:
    return os.environ.get("REGATTA_SPOOL_DIR") or os.path.join(tempfile.gettempdir(),
                                                              "regatta-spool")


def spool_tag(destination: str) -> str:
    return hashlib.sha1(destination.encode()).hexdigest()[:10]


def forget_destination(folder: str, tag: str) -> None:
    """Remove ``<tag>.dest`` once no spool file of that destination is left."""
    if glob.glob(os.path.join(folder, f"{tag}.*.jsonl*")):
        return
    try:
        os.unlink(os.path.join(folder, f"{tag}.dest"))
    except OSError:
        pass


def record_destination(folder: str, destination: str) -> None:
    """Write ``<tag>.dest`` (once) so a later replay knows where the tag's rows go."""
    path = os.path.join(folder, spool_tag(destination) + ".dest")
    if os.path.exists(path):
        return
    try:
        os.makedirs(folder, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(destination + "\n")
        os.replace(tmp, path)
    except OSError as exc:   # a full disk: the replay can still be told the destination
        log.warning("cannot record the destination of spool tag %s in %s: %s",
                    spool_tag(destination), folder, exc)
