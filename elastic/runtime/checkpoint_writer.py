"""Durable checkpoints written in the background, from a process of their own at the
lowest CPU priority (CheckFreq's snapshot/persist split).

``CheckpointWriter.submit`` waits for the write in flight, takes the snapshot on the
calling thread straight into shared memory (a memfd both processes map, reused from one
checkpoint to the next: fresh host memory costs its page faults, 0.4-0.7 s per GB here
against 0.08 s for a copy into memory already mapped), and hands the tree's small skeleton
to the writer process, which builds tensors over that same memory and writes them with
``checkpoint.save_atomic``. One write at a time.

Why a process: a write from a niced thread of the training process still slowed the steps
it overlapped 1.28-1.60x at 100M parameters, dp = 3 on two cores (bench/bench_state.py);
the same write replaced by a sleep, 0.99x. Serialising, checksumming and copying 1.2 GB
into the page cache is CPU the ranks want. A thread cannot be given ``SCHED_IDLE`` (run
only on an idle core): starved while holding the GIL, it stalled the training thread for a
second in a test here. A process has its own GIL, so the writer runs at ``SCHED_IDLE``. It
starts at the first write, dies with the training process (``PR_SET_PDEATHSIG``), and is
started again if it died.

    python -m elastic.runtime.checkpoint_writer     (started by CheckpointWriter only)
"""
from __future__ import annotations

import ctypes
import json
import mmap
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Callable

import torch

from .checkpoint import save_atomic
from .flat import TensorSlot, map_tree, slots_of

ALIGN = 64   # every tensor starts on a cache line


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
        self.generation = 0     # a new memfd may get the old one's number: count them

    def take(self, tree) -> object:
        """Copy ``tree``'s tensors in; its skeleton."""
        skeleton, tensors, needed = layout(tree)
        if needed > self.size or self.memory is None:
            self.close()
            self.fd, self.generation = os.memfd_create("regatta-checkpoint"), self.generation + 1
            self.size = max(needed, 1)
            os.ftruncate(self.fd, self.size)
            self.memory = mmap.mmap(self.fd, self.size)
        for slot, value in zip(slots_of(skeleton), tensors):
            view(slot, self.memory).copy_(value)
        return skeleton

    def close(self) -> None:
        if self.memory is not None:
            self.memory.close()
            os.close(self.fd)
        self.fd, self.size, self.memory = -1, 0, None


class CheckpointWriter:
    """Durable writes in the background, one at a time: ``submit`` first waits for the
    write in flight. The waiting thread is not a daemon, so a process that ends while one
    is in flight finishes it first."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._shared = SharedSnapshot()
        self._process: subprocess.Popen | None = None
        self._given = 0    # the generation of the memfd the process was given

    @property
    def pid(self) -> int | None:
        """The writer process's pid, once started."""
        return None if self._process is None else self._process.pid

    def wait(self) -> float:
        """Block until no write is in flight; the seconds spent waiting. Someone waits for
        the write now: at normal priority it can no longer starve (the writer drops back to
        SCHED_IDLE at its next write)."""
        started = time.perf_counter()
        if self._thread is not None:
            if self._process is not None:
                try:
                    os.sched_setscheduler(self._process.pid, os.SCHED_OTHER, os.sched_param(0))
                except (ProcessLookupError, PermissionError):
                    pass
            self._thread.join()
            self._thread = None
        return time.perf_counter() - started

    def submit(self, snapshot: Callable[[], dict], path: Path, keep_previous: bool = True) -> Future:
        """Wait for the write in flight, copy ``snapshot()`` (the payload, tensors anywhere)
        into shared memory here, then have it written to ``path``. The future's result is
        the checkpoint event's detail, or the write's exception."""
        waited = self.wait()
        started = time.perf_counter()
        skeleton = self._shared.take(snapshot())
        snapshot_s = time.perf_counter() - started
        process = self._writer_process()
        future: Future = Future()
        request = {"skeleton": skeleton, "size": self._shared.size, "path": str(path),
                   "keep_previous": keep_previous}

        def write() -> None:
            try:
                message = pickle.dumps(request)    # whole, or nothing reaches the pipe
                try:
                    process.stdin.write(message)
                    process.stdin.flush()
                    answer = process.stdout.readline()
                except OSError:    # the pipe broke: the writer is gone
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
                                   "write_s": done["write_s"]})
        self._thread = threading.Thread(target=write, name="regatta-checkpoint")
        self._thread.start()
        return future

    def _writer_process(self) -> subprocess.Popen:
        """The running writer, given the current memfd; started (again) when needed."""
        process = self._process
        if process is not None and process.poll() is None and self._given == self._shared.generation:
            return process
        if process is not None:
            process.kill()
            process.wait()
        self._process = subprocess.Popen(
            [sys.executable, "-m", "elastic.runtime.checkpoint_writer", str(self._shared.fd),
             str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(self._shared.fd,),
            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
                str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]))})
        self._given = self._shared.generation
        return self._process

    def close(self) -> None:
        """Wait for the write in flight, then end the writer process."""
        self.wait()
        if self._process is not None:
            self._process.stdin.close()
            self._process.wait()
            self._process = None
        self._shared.close()


# -- the writer process ------------------------------------------------------------------------
def _die_with(parent: int) -> None:
    """SIGKILL when the training process dies: a write finishing after a resumed job wrote
    a newer checkpoint would replace it with an older one."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:     # it died before the line above
        os._exit(1)


def serve(fd: int, parent: int) -> None:
    _die_with(parent)
    memory = None
    while True:
        try:
            request = pickle.load(sys.stdin.buffer)
        except EOFError:
            return
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))   # only CPU no one wants
        started = time.perf_counter()
        try:
            if memory is None or len(memory) != request["size"]:
                memory = mmap.mmap(fd, request["size"])
            payload = map_tree(request["skeleton"],
                               lambda v: view(v, memory) if isinstance(v, TensorSlot) else v)
            size = save_atomic(payload, Path(request["path"]), request["keep_previous"])
            answer = {"bytes": size, "write_s": time.perf_counter() - started}
        except Exception as err:  # noqa: BLE001 - reported to the training process
            answer = {"error": f"{type(err).__name__}: {err}"[:2000]}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
