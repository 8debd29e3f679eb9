"""A write-only file that bypasses the page cache (``O_DIRECT``) and can be paced, for
checkpoints.

Why direct: a checkpoint of a large model written through the page cache costs the
kernel a copy of every byte and a writeback thread at normal priority, whatever the
writer's own priority; on a machine whose cores the ranks fill, that CPU is taken from
training. With ``O_DIRECT`` the device reads the bytes straight from an aligned buffer of
ours. Writes go through a bounce buffer of ``CHUNK`` bytes (torch.save hands over records
of any length and alignment); the unaligned tail is written with ``O_DIRECT`` switched off.
Where the file system refuses ``O_DIRECT`` (tmpfs on older kernels), it is an ordinary
buffered file.

Why paced: even so, the steps a write overlaps ran 1.19-1.29x slower at 100M parameters
(bench/bench_state.py); written at a third of the disk's speed, 1.07x. A ``Pace`` spreads
the write over a given time, and whoever needs the file now sets ``hurry``.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import threading
import time
from dataclasses import dataclass

CHUNK = 8 << 20     # a multiple of every block size; large requests, few system calls


@dataclass
class Pace:
    """Spread a write of ``total`` bytes over ``seconds``. ``hurry`` may be set from
    another thread or a signal handler: the rest goes at full speed, as it does once the
    main thread has ended (the process exits only when the write is done)."""
    seconds: float
    total: int
    hurry: bool = False

    def hold(self, started: float, written: int) -> None:
        """Sleep until ``written`` bytes are due, in short naps so a hurry is seen."""
        due = started + self.seconds * written / max(self.total, 1)
        while not self.hurry and threading.main_thread().is_alive() \
                and (left := due - time.monotonic()) > 0:
            time.sleep(min(left, 0.02))


class DirectFile:
    """``write``/``tell``/``flush`` over ``fd`` for torch.save; ``finish`` writes the tail
    and fsyncs. The caller owns ``fd``."""

    def __init__(self, fd: int, pace: Pace | None = None):
        self.fd, self.pace, self.written, self.fill = fd, pace, 0, 0
        self.started = time.monotonic()
        self.buffer = mmap.mmap(-1, CHUNK)      # page-aligned, as O_DIRECT needs
        self.view = memoryview(self.buffer)
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
            self.direct = True
        except OSError:
            self.direct = False

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        position = 0
        while position < len(data):
            take = min(CHUNK - self.fill, len(data) - position)
            self.view[self.fill:self.fill + take] = data[position:position + take]
            self.fill += take
            position += take
            if self.fill == CHUNK:
                self._drain(CHUNK)
        return len(data)

    def tell(self) -> int:
        return self.written + self.fill

    def flush(self) -> None:
        """Nothing: whole chunks are written as they fill, the tail by ``finish``."""

    def finish(self) -> int:
        """Write what is buffered, fsync; the file's size."""
        if self.fill:
            if self.direct:     # the tail's length is not a multiple of the block size
                flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
                fcntl.fcntl(self.fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
            self._drain(self.fill)
        os.fsync(self.fd)
        self.view.release()
        self.buffer.close()
        return self.written

    def _drain(self, length: int) -> None:
        done = 0
        while done < length:
            done += os.write(self.fd, self.view[done:length])
        self.written += length
        self.fill = 0
        if self.pace is not None:
            self.pace.hold(self.started, self.written)
