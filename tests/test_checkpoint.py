"""Durable checkpoints on a real filesystem with a real writer thread: atomic background
writes one at a time, the previous checkpoint kept, and a clear error naming a foreign or
corrupt file (runtime/checkpoint.py). Whole jobs resuming are in test_state.py."""
from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from elastic.runtime.checkpoint import CheckpointError, load, previous_path
from elastic.runtime.checkpoint_writer import PROCESS_MIN_BYTES, SPREAD, CheckpointWriter
from elastic.runtime.runs import resumed_run_id

ROOT = Path(__file__).resolve().parents[1]

FORMAT = "regatta-test/1"


def up(writer: CheckpointWriter) -> CheckpointWriter:
    """The writer with its process started and ready (before, writes go to a thread)."""
    writer.start()
    deadline = time.monotonic() + 60
    while not writer.ready and time.monotonic() < deadline:
        time.sleep(0.02)
    assert writer.ready
    return writer


def payload(step: int, numel: int = 1000) -> dict:
    return {"format": FORMAT, "step": step, "w": torch.full((numel,), float(step))}


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_background_writes_keep_the_previous_checkpoint_and_never_overlap(tmp_path):
    path, writer = tmp_path / "state.pt", CheckpointWriter()
    first = writer.submit(lambda: payload(1, numel=20_000_000), path)      # 80 MB: takes a while
    second = writer.submit(lambda: payload(2), path)
    assert first.done()          # submit waited for the write in flight before the next
    assert second.result(timeout=60)["waited_s"] > 0
    assert first.result()["bytes"] > 80_000_000 and second.result()["bytes"] < 100_000
    assert load(path, expect=FORMAT)["step"] == 2
    assert load(previous_path(path), expect=FORMAT)["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.previous.pt", "state.pt"]


def test_the_shared_snapshot_is_written_over_only_after_its_write_ended(tmp_path):
    """One shared memory and one writer process serve every checkpoint; the next
    snapshot goes into that memory only once the write in flight has ended."""
    live = {"w": torch.zeros(20_000_000), "b": [torch.zeros(3, dtype=torch.bfloat16)], "step": 0}

    def snapshot(step: int):
        def take() -> dict:
            live["w"].fill_(float(step))
            live["b"][0].fill_(-float(step))
            live["step"] = step
            return {"format": FORMAT, **live}
        return take

    path, writer = tmp_path / "state.pt", up(CheckpointWriter())
    try:
        writer.submit(snapshot(1), path)          # 80 MB: still writing when the next comes
        process = writer.pid
        assert writer.busy
        writer.submit(snapshot(2), path).result(timeout=120)
        writer.wait()
        assert not writer.busy
        assert writer.pid == process               # the same writer, the same memory
        for saved, step in ((load(previous_path(path), expect=FORMAT), 1), (load(path, expect=FORMAT), 2)):
            assert saved["step"] == step and bool((saved["w"] == step).all())
            assert saved["b"][0].dtype == torch.bfloat16 and saved["b"][0].tolist() == [-step] * 3
        assert os.sched_getscheduler(process) == os.SCHED_IDLE    # only CPU no rank wants
    finally:
        writer.close()


def test_a_large_write_is_spread_over_the_interval_and_hurried_when_needed(tmp_path):
    """A state of PROCESS_MIN_BYTES or more is written at a pace that lands it at SPREAD of
    the time since the previous checkpoint (here the writer's start, 6 s ago), until
    someone needs it: from a thread and from the process alike. Unpaced, these 68 MB take
    well under a second; a small state is not paced at all."""
    threaded, process = CheckpointWriter(), CheckpointWriter()
    started = time.monotonic()
    try:
        up(process)
        time.sleep(max(0.0, started + 6 - time.monotonic()))
        numel = PROCESS_MIN_BYTES // 4 + (1 << 20)
        writes = [w.submit(lambda: payload(1, numel), tmp_path / f"{i}.pt")
                  for i, w in enumerate((threaded, process))]
        time.sleep(1.5)
        assert threaded.busy and process.busy            # paced: not done yet
        writes[0].hurry()                                # as the worker does at the end
        process.wait()                                   # as the next checkpoint does
        for done, writer in zip(writes, ("thread", "process")):
            detail = done.result(timeout=30)
            assert detail["writer"] == writer
            assert 6 * SPREAD <= detail["spread_s"] < 6 * SPREAD + 1.0
            assert 1.4 <= detail["write_s"] < 3.0    # hurried at 1.5 s, paced to 4.5 s
        time.sleep(2)
        small = process.submit(lambda: payload(2), tmp_path / "0.pt").result(timeout=30)
        assert small["spread_s"] == 0.0 and load(tmp_path / "0.pt", expect=FORMAT)["step"] == 2
        assert load(tmp_path / "1.pt", expect=FORMAT)["step"] == 1
    finally:
        threaded.close()
        process.close()


def test_a_writer_killed_mid_write_fails_that_checkpoint_only(tmp_path):
    """SIGKILL of the writer process from outside at random instants of its writes: that
    checkpoint fails with a message naming it, the one in force stays whole, the next
    write starts a new writer and clears the killed one's temporary file."""
    path, writer, outcomes = tmp_path / "state.pt", CheckpointWriter(), []
    try:
        for step in range(1, 7):
            up(writer)
            done = writer.submit(lambda: payload(step, numel=30_000_000), path)    # 120 MB
            if step > 1:     # kill once the write is under way (its temporary exists)
                deadline = time.monotonic() + 60
                while not list(tmp_path.glob("state.pt.*.tmp")) and time.monotonic() < deadline \
                        and not done.done():
                    time.sleep(0.005)
                time.sleep(random.uniform(0.0, 0.2))
                os.kill(writer.pid, signal.SIGKILL)
            try:
                done.result(timeout=120)
                outcomes.append(step)
            except RuntimeError as err:
                assert f"before writing {path}" in str(err) and "untouched" in str(err)
            assert load(path, expect=FORMAT)["step"] == outcomes[-1]
        assert len(outcomes) < 6      # some kill came mid-write
        assert writer.submit(lambda: payload(7), path).result(timeout=120)["bytes"] > 0
        assert load(path, expect=FORMAT)["step"] == 7
        assert sorted(p.name for p in tmp_path.iterdir()) == ["state.previous.pt", "state.pt"]
    finally:
        writer.close()


WRITING_PARENT = """
import sys, time, torch
from elastic.runtime.checkpoint_writer import CheckpointWriter
writer = CheckpointWriter()
writer.start()
while not writer.ready:
    time.sleep(0.02)
writer.submit(lambda: {"format": "x", "w": torch.zeros(25_000_000)}, sys.argv[1] + "/state.pt")
print(writer.pid, flush=True)
sys.stdin.read()
"""


def test_the_writer_dies_with_its_training_process(tmp_path):
    """A write finishing after its job died could replace a resumed job's newer checkpoint
    with an older one: the writer is SIGKILLed with its parent, mid-write."""
    parent = subprocess.Popen([sys.executable, "-c", WRITING_PARENT, str(tmp_path)], cwd=ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        writer = int(parent.stdout.readline())
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob("state.pt.*.tmp")) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert list(tmp_path.glob("state.pt.*.tmp")), "the write never started"
        parent.kill()
        parent.wait(timeout=30)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{writer}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not Path(f"/proc/{writer}").exists()
        assert not (tmp_path / "state.pt").exists()
    finally:
        parent.kill()


def test_a_checkpoint_before_the_writer_is_up_is_written_from_a_thread(tmp_path):
    """The writer's imports take a second or two; a run's first checkpoint does not wait."""
    path, writer = tmp_path / "state.pt", CheckpointWriter()
    try:
        done = writer.submit(lambda: payload(1), path).result(timeout=60)
        assert done["writer"] == "thread" and load(path, expect=FORMAT)["step"] == 1
        up(writer)
        assert writer.submit(lambda: payload(2), path).result(timeout=60)["writer"] == "process"
        assert load(path, expect=FORMAT)["step"] == 2
    finally:
        writer.close()


def test_only_a_large_state_is_written_from_a_niced_thread(tmp_path, monkeypatch):
    """Nice 19 keeps a large write off the ranks' CPU; a small one takes milliseconds, and
    a starved thread would keep a SIGKILLed rank 0 alive (its sockets open) until it ran."""
    from elastic.runtime import checkpoint_writer
    niceness, real_save = [], checkpoint_writer.save_atomic

    def save_atomic(*args):
        niceness.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return real_save(*args)
    monkeypatch.setattr(checkpoint_writer, "save_atomic", save_atomic)
    writer = CheckpointWriter()
    try:
        for numel in (1000, PROCESS_MIN_BYTES // 4):
            done = writer.submit(lambda: payload(1, numel), tmp_path / "state.pt").result(timeout=120)
            assert done["writer"] == "thread"
    finally:
        writer.close()
    assert niceness == [0, 19]


def test_the_writer_is_not_taken_for_a_horovod_worker(monkeypatch):
    """Tools find a host's workers by their environment (regatta local's fault injection
    struck one kill twice when it counted the writer too)."""
    monkeypatch.setenv("HOROVOD_HOSTNAME", "127.0.0.9")
    monkeypatch.setenv("REGATTA_AGENT_NAMESPACE", "test")
    writer = CheckpointWriter()
    try:
        writer.start()
        environment = Path(f"/proc/{writer.pid}/environ").read_bytes().split(b"\0")
        assert not [v for v in environment if v.startswith((b"HOROVOD_", b"REGATTA_AGENT_"))]
    finally:
        writer.close()


def test_a_failed_write_leaves_the_checkpoint_in_force_untouched(tmp_path):
    path, writer = tmp_path / "state.pt", CheckpointWriter()
    writer.submit(lambda: payload(1), path).result(timeout=60)
    before = digest(path)
    failed = writer.submit(lambda: {**payload(2), "hook": lambda: None}, path)   # cannot pickle
    with pytest.raises(Exception):
        failed.result(timeout=60)
    assert digest(path) == before and load(path, expect=FORMAT)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["state.pt"]      # no temporary left behind


def test_foreign_and_corrupt_files_are_refused_by_name(tmp_path):
    path = tmp_path / "state.pt"
    torch.save({"weights": torch.ones(3)}, path)                  # another program's file
    with pytest.raises(CheckpointError, match=f"checkpoint {path} has format None, expected"):
        load(path, expect=FORMAT)
    path.write_text("not a checkpoint at all")
    with pytest.raises(CheckpointError, match=f"checkpoint {path} is corrupt"):
        load(path, expect=FORMAT)

    writer = CheckpointWriter()
    writer.submit(lambda: payload(1, numel=100_000), path).result(timeout=60)
    writer.submit(lambda: payload(2, numel=100_000), path).result(timeout=60)
    kept = digest(previous_path(path))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF              # one flipped bit inside a tensor's bytes
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match="CRC-32") as err:
        load(path, expect=FORMAT)
    assert str(path) in str(err.value) and str(previous_path(path)) in str(err.value)
    path.write_bytes(data[:len(data) // 3])   # truncated
    with pytest.raises(CheckpointError, match=f"checkpoint {path} is corrupt"):
        load(path, expect=FORMAT)
    assert digest(previous_path(path)) == kept
    assert load(previous_path(path), expect=FORMAT)["step"] == 1


MARKING = """
import sys, itertools
from pathlib import Path
from elastic.runtime.runs import mark_checkpoint_folder
folder = Path(sys.argv[1])
for n in itertools.count():
    mark_checkpoint_folder(folder, ("run-a", "run-b")[n % 2])
    if n == 10:
        print("marking", flush=True)
"""


def test_a_job_killed_while_marking_its_checkpoint_folder_still_resumes(tmp_path):
    """SIGKILL from outside at random instants of a process rewriting the run-id marker
    (the CI once found it empty after a whole-job kill): it always names a whole run id,
    and an empty one is refused by name rather than starting a new run."""
    rng = random.Random(7)
    for _ in range(25):
        marker = subprocess.Popen([sys.executable, "-c", MARKING, str(tmp_path)], cwd=ROOT,
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert marker.stdout.readline() == "marking\n"
            time.sleep(rng.uniform(0, 0.05))
        finally:
            marker.kill()
            marker.wait(timeout=10)
        assert (tmp_path / "run_id").read_text() in ("run-a", "run-b")
    (tmp_path / "run_id").write_text("")
    cfg = SimpleNamespace(resume="auto", checkpoint_path=tmp_path / "state.pt")
    with pytest.raises(ValueError, match=f"{tmp_path / 'run_id'} is empty"):
        resumed_run_id(cfg)
