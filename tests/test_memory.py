"""Kept freed memory (runtime/memory.py): a training step of the throughput bench's MLP
faults in thousands of pages a step under glibc's default malloc and none once the
runtime keeps what it frees; the environment can turn it off."""
import json
import statistics
import sys

from conftest import ROOT, run

from elastic.runtime.env import Env

STEPS = 10


def faults_per_step(arm: str) -> list[int]:
    """Minor page faults of each of the MLP's steps, in a fresh process (malloc's settings
    are per process)."""
    done = run([sys.executable, str(ROOT / "bench" / "bench_allocator.py"), "--steps", str(STEPS),
                "--worker", "mlp", arm], timeout=120)
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    faults = json.loads(line[len("RESULT "):])["faults"]
    assert len(faults) == STEPS
    return faults


def test_a_step_faults_no_pages_in_once_freed_memory_is_kept():
    glibc, kept = faults_per_step("glibc"), faults_per_step("kept")
    # 16 MB gradients given back and faulted in again: 8,000-26,000 pages a step
    assert statistics.median(glibc) > 1000, glibc
    # kept: none in a typical step; a step that first needs more heap than any before it
    # still faults that growth in (seen: one step in ten, up to 4,096 pages)
    assert statistics.median(kept) < 50, kept
    assert statistics.mean(kept) < statistics.mean(glibc) / 10, (kept, glibc)


def test_the_environment_turns_keeping_off():
    assert Env.read({}).keep_freed_memory
    assert Env.read({"REGATTA_KEEP_FREED_MEMORY": "1"}).keep_freed_memory
    assert not Env.read({"REGATTA_KEEP_FREED_MEMORY": "0"}).keep_freed_memory
    # glibc's own tunables, where the user set them, win
    assert not Env.read({"MALLOC_TRIM_THRESHOLD_": "1000000"}).keep_freed_memory
    assert not Env.read({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}).keep_freed_memory
