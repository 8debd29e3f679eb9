"""Durable checkpoints written in the background, from a process of their own at the
lowest CPU priority (CheckFreq's snapshot/persist split).

``CheckpointWriter.submit`` waits for the write in flight, takes the snapshot on the
calling thread straight into shared memory (a memfd both processes map, reused from one
checkpoint to the next: fresh host memory costs its page faults, 0.4-0.7 s per GB here
against 0.08 s for a copy into memory already mapped), and hands the tree's small skeleton
to the writer process, which builds tensors over that same memory and writes them with
``checkpoint.save_atomic``. One write at a time.

Why a process: a thread of the training process shares its GIL. Given ``SCHED_IDLE`` (run
only on an idle core), a thread starved while holding the GIL stalled the training thread
for a second in a test here; niced instead, it takes CPU the ranks wanted. A process has
its own GIL, so this writer runs at ``SCHED_IDLE``. Measured at 100M parameters, dp = 3 on
two cores (bench/bench_state.py), the steps a write overlaps still ran 1.32x slower (a
niced thread: 1.60x; the write replaced by a sleep: 0.99x): the write's I/O slows the
ranks even on the other core. Written past the page cache (direct_file.py), 1.19-1.29x;
also paced over SPREAD of the time between checkpoints, 0.98x and 0.975x (every step a
write overlapped over the steps just before it, two runs; docs/measurements.md). The writer
is started ahead of need (``start``, for states of PROCESS_MIN_BYTES or more), dies with
the training process (``PR_SET_PDEATHSIG``), and is started again if it died; without it,
and until it says it is ready (its imports take a second or two), writes go from a niced thread as before.

    python -m elastic.runtime.checkpoint_writer SOCKET_FD PARENT_PID   (CheckpointWriter starts it)
"""
from __future__ import annotations

import json
import mmap
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Callable

import torch

from .checkpoint import save_atomic
from .direct_file import Pace
from .flat import TensorSlot, map_tree, slots_of
from .parent_death import die_with

ALIGN = 64   # every tensor starts on a cache line
# Below this a write takes milliseconds from a thread; a process (a second Python with
# torch, 1-2 s of CPU to start, again after every change of rank 0) is not worth it.
PROCESS_MIN_BYTES = 64 << 20
# A large state's write is spread over this share of the time since the previous checkpoint
# (the writer's start for the first), at most MAX_SPREAD_S: the steps it overlaps barely
# notice, and it lands well before the next; whoever waits for it hurries it.
SPREAD = 0.75
MAX_SPREAD_S = 120.0


def layout(tree) -> tuple[object, list[torch.Tensor], int]:
    """(skeleton, the tree's tensors in skeleton order, bytes needed): an aligned
    TensorSlot per tensor, end to end."""
    tensors, end = [], 0

    def slot(value):
        nonlocal end
        if not torch.is_tensor(value):
            return value
        offset = -(-end // ALIGN) * ALIGN
        end = offset + value.numel() * value.element_size()
        tensors.append(value.detach())
        return TensorSlot(offset, end - offset, value.dtype, tuple(value.shape))
    return map_tree(tree, slot), tensors, end


def view(slot: TensorSlot, memory: mmap.mmap) -> torch.Tensor:
    """A tensor over ``memory`` at ``slot``, with a storage of its own (torch.save then
    writes each tensor's bytes, not the whole memory)."""
    if slot.nbytes == 0:
        return torch.empty(slot.shape, dtype=slot.dtype)
    raw = torch.frombuffer(memory, dtype=torch.uint8, count=slot.nbytes, offset=slot.offset)
    return raw.view(slot.dtype).view(slot.shape)   # via bytes: frombuffer knows no bf16


class SharedSnapshot:
    """Host memory both processes map; a new memfd when a state outgrows it."""

    def __init__(self):
        self.fd, self.size, self.memory = -1, 0, None
        self.used = 0     # bytes of the last snapshot taken

    def take(self, tree) -> object:
        """Copy ``tree``'s tensors in; its skeleton."""
        skeleton, tensors, needed = layout(tree)
        if needed > self.size or self.memory is None:
            self.close()
            self.fd = os.memfd_create("regatta-checkpoint")
            self.size = max(needed, 1)
            os.ftruncate(self.fd, self.size)
            self.memory = mmap.mmap(self.fd, self.size)
        for slot, value in zip(slots_of(skeleton), tensors):
            view(slot, self.memory).copy_(value)
        self.used = needed
        return skeleton

    def close(self) -> None:
        if self.memory is not None:
            self.memory.close()
            os.close(self.fd)
        self.fd, self.size, self.memory = -1, 0, None


class PendingWrite(Future):
    """A write in flight. It is paced to land well before the next checkpoint; ``hurry()``
    when someone needs it on disk now."""

    def __init__(self, hurry: Callable[[], None]):
        super().__init__()
        self.hurry = hurry


class CheckpointWriter:
    """Durable writes in the background, one at a time: ``submit`` first waits for the
    write in flight. The waiting thread is not a daemon, so a process that ends while one
    is in flight finishes it first."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._shared = SharedSnapshot()
        self._process: subprocess.Popen | None = None
        self._socket: socket.socket | None = None
        self._ready = False      # the process said it finished its imports
        self._last_submit = time.monotonic()
        self._pace: Pace | None = None      # the write in flight's, when a thread writes it

    @property
    def pid(self) -> int | None:
        """The writer process's pid, once started."""
        return None if self._process is None else self._process.pid

    @property
    def busy(self) -> bool:
        """A write is in flight."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the writer process now, if it is not running: its imports (torch) take a
        second or two, better spent before the first checkpoint than inside it."""
        if self._process is not None and self._process.poll() is None:
            return
        if self._process is not None:
            self._socket.close()
            self._process.wait()
        ours, theirs = socket.socketpair()
        with theirs:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "elastic.runtime.checkpoint_writer", str(theirs.fileno()),
                 str(os.getpid())], pass_fds=(theirs.fileno(),),
                env=writer_environment())
        self._socket, self._ready = ours, False

    @property
    def ready(self) -> bool:
        """The writer process is up (its one-line greeting has come), so writes go there;
        until then, to a thread. Never blocks."""
        if not self._ready and self._process is not None and self._process.poll() is None:
            if select.select([self._socket], [], [], 0)[0]:
                self._ready = self._socket.recv(6) == b"ready\n"
        return self._ready

    def wait(self) -> float:
        """Block until no write is in flight; the seconds spent waiting. Someone waits for
        the write now: at normal priority it can no longer starve (the writer drops back to
        SCHED_IDLE at its next write)."""
        started = time.perf_counter()
        if self._thread is not None:
            while self._thread.is_alive():
                self._hurry()     # again: the request may not have reached the process yet
                self._thread.join(0.1)
            self._thread = None
        return time.perf_counter() - started

    def _hurry(self) -> None:
        """The write in flight goes at full speed from now on."""
        if not self.busy:
            return
        if self._pace is not None:
            self._pace.hurry = True
        elif self._process is not None:
            try:    # its SIGUSR1 handler lifts the pace
                os.sched_setscheduler(self._process.pid, os.SCHED_OTHER, os.sched_param(0))
                os.kill(self._process.pid, signal.SIGUSR1)
            except (ProcessLookupError, PermissionError):
                pass

    def submit(self, snapshot: Callable[[], dict], path: Path, keep_previous: bool = True) -> PendingWrite:
        """Wait for the write in flight, copy ``snapshot()`` (the payload, tensors anywhere)
        into shared memory here, then have it written to ``path``, paced. The result is
        the checkpoint event's detail, or the write's exception."""
        interval, self._last_submit = time.monotonic() - self._last_submit, time.monotonic()
        waited = self.wait()
        started = time.perf_counter()
        skeleton = self._shared.take(snapshot())
        snapshot_s = time.perf_counter() - started
        if self._process is not None:
            self.start()     # again, if it died
        process, channel, future = self._process, self._socket, PendingWrite(self._hurry)
        request = {"skeleton": skeleton, "size": self._shared.size, "path": str(path),
                   "keep_previous": keep_previous, "spread_s": self._spread(interval),
                   "used": self._shared.used}
        in_thread = not self.ready
        self._pace = Pace(request["spread_s"], self._shared.used) if in_thread else None
        pace = self._pace

        def write() -> None:
            try:
                if in_thread:
                    future.set_result(write_here(request, self._shared.memory, waited, snapshot_s, pace))
                    return
                message = pickle.dumps(request)    # whole, or nothing reaches the writer
                try:
                    socket.send_fds(channel, [struct.pack("!Q", len(message))], [self._shared.fd])
                    channel.sendall(message)
                    while not select.select([channel], [], [], 0.1)[0]:
                        if not threading.main_thread().is_alive():
                            self._hurry()      # the training process is ending
                    answer = channel.makefile("rb").readline()
                except OSError:    # the connection broke: the writer is gone
                    answer = b""
                if not answer:
                    raise RuntimeError(f"the checkpoint writer process ended "
                                       f"({process.wait()}) before writing {path}; "
                                       f"the checkpoint in force is untouched")
                done = json.loads(answer)
                if "error" in done:
                    raise RuntimeError(f"writing checkpoint {path} failed: {done['error']}")
            except BaseException as err:  # noqa: BLE001 - handed to whoever waits on it
                future.set_exception(err)
            else:
                future.set_result({"path": str(path), "bytes": done["bytes"], "waited_s": waited,
                                   "snapshot_s": snapshot_s, "background": True,
                                   "write_s": done["write_s"], "spread_s": request["spread_s"],
                                   "writer": "process"})
        self._thread = threading.Thread(target=write, name="regatta-checkpoint")
        self._thread.start()
        return future

    def _spread(self, interval: float) -> float:
        """The seconds to spread this write over: none for a small state, which writes in
        milliseconds anyway; pacing it would only leave it in flight, lost with its rank."""
        if self._shared.used < PROCESS_MIN_BYTES:
            return 0.0
        return min(SPREAD * interval, MAX_SPREAD_S)

    def close(self) -> None:
        """Wait for the write in flight, then end the writer process."""
        self._ready = False
        self.wait()
        if self._process is not None:
            self._socket.close()     # the writer reads the end and exits
            self._process.wait()
            self._process = self._socket = None
        self._shared.close()


def writer_environment() -> dict[str, str]:
    """The training process's environment without what makes a process a Horovod worker
    (tools that find a host's workers by it, `regatta local`'s fault injection among them,
    must not take the writer for one), and with this package importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "REGATTA_AGENT_"))}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH", "")]))
    return env


def write_here(request: dict, memory: mmap.mmap, waited: float, snapshot_s: float, pace: Pace) -> dict:
    """A small state's write, or a large one's while the writer process imports. Large only at
    nice 19: a starved thread keeps a SIGKILLed rank alive (0.6-1 s on 2 busy cores)."""
    if request["used"] >= PROCESS_MIN_BYTES:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    started = time.perf_counter()
    payload = map_tree(request["skeleton"], lambda v: view(v, memory) if isinstance(v, TensorSlot) else v)
    size = save_atomic(payload, Path(request["path"]), request["keep_previous"], pace)
    return {"path": request["path"], "bytes": size, "waited_s": waited, "snapshot_s": snapshot_s,
            "background": True, "write_s": time.perf_counter() - started,
            "spread_s": request["spread_s"], "writer": "thread"}


# -- the writer process ------------------------------------------------------------------------
def _receive(channel: socket.socket) -> tuple[dict, int] | None:
    """The next request and the memfd sent with it; None when the training process closed
    the connection."""
    try:
        head, fds, _, _ = socket.recv_fds(channel, 8, 1)
    except ConnectionResetError:     # the training process went away
        return None
    if not head:
        return None
    while len(head) < 8:
        head += channel.recv(8 - len(head))
    length, body = struct.unpack("!Q", head)[0], bytearray()
    while len(body) < length:
        chunk = channel.recv(min(1 << 20, length - len(body)))
        if not chunk:
            return None
        body += chunk
    return pickle.loads(body), fds[0]


def serve(channel_fd: int, parent: int) -> None:
    die_with(parent)   # a write finishing after a resumed job wrote a newer checkpoint would replace it
    pace = Pace(0.0, 0)

    def hurry(*_) -> None:    # the training process waits for this write
        pace.hurry = True
    signal.signal(signal.SIGUSR1, hurry)
    channel = socket.socket(fileno=channel_fd)
    channel.sendall(b"ready\n")     # torch is imported: writes may come here now
    while (received := _receive(channel)) is not None:
        request, fd = received
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))   # only CPU no one wants
        pace.seconds, pace.total, pace.hurry = request["spread_s"], request["used"], False
        started = time.perf_counter()
        try:    # the mapping goes when its last view does (closing it under them raises)
            memory = mmap.mmap(fd, request["size"])
            payload = map_tree(request["skeleton"],
                               lambda v: view(v, memory) if isinstance(v, TensorSlot) else v)
            size = save_atomic(payload, Path(request["path"]), request["keep_previous"], pace)
            answer = {"bytes": size, "write_s": time.perf_counter() - started}
        except Exception as err:  # noqa: BLE001 - reported to the training process
            answer = {"error": f"{type(err).__name__}: {err}"[:2000]}
        finally:
            os.close(fd)
            memory = payload = None
        channel.sendall((json.dumps(answer) + "\n").encode())


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
