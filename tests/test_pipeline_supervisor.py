"""The supervisor relaunches a pipeline job after a rank is SIGKILLed, on the slots left,
from the last durable checkpoint, and the job finishes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic.runtime.events import read_events
from elastic.launch.hosts import Host
from elastic.pipeline.checkpoint import read_manifest
from elastic.pipeline.supervisor import SupervisorConfig, command, drop_failed, rank_hosts, replan

ROOT = Path(__file__).resolve().parents[1]
STEPS, EVERY = 240, 10     # the kill comes after step 20: room for a slow reaction
JOB_ARGS = ["--steps", str(STEPS), "--commit-every", str(EVERY), "--checkpoint-every", "1",
            "--global-batch", "8", "--microbatches", "2", "--lr", "0.01",
            "--set", "model.layers=2", "--set", "model.dim=32", "--set", "model.context=16"]


def test_replan_keeps_stages_and_drops_what_failed():
    hosts = [Host("a", 2), Host("b", 2)]
    assert replan(hosts, 2) == (2, 2) and replan([Host("a", 3)], 2) == (2, 1)
    assert replan([Host("a", 1)], 2) == (1, 1)
    placed = rank_hosts(hosts, 4)
    assert placed == ["a", "a", "b", "b"]
    out = "mpirun noticed that process rank 2 with PID 0 on node vm exited on signal 9 (Killed)."
    left, dropped = drop_failed(hosts, out, placed)
    assert left == [Host("a", 2), Host("b", 1)] and dropped[0]["host"] == "b"
    out = "  Remote daemon: [[1,0],1] on node a\n"
    assert drop_failed(hosts, out, placed)[0] == [Host("b", 2)]


def test_relaunch_command_replans_stages(tmp_path):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("a slots=1\n")
    cfg = SupervisorConfig(job="charlm", hostfile=str(hostfile), pp=2,
                           job_args=["--boundaries", "0,3", "--steps", "5"])
    line = command(cfg, hostfile, *replan([Host("a", 1)], cfg.pp))
    tail = line[line.index("jobs.charlm") + 1:]
    # The re-plan comes after the user's arguments (argparse: last wins): one stage,
    # balanced boundaries, and the pipeline trainer even at pp = 1 (its checkpoint format).
    assert tail[:4] == ["--boundaries", "0,3", "--steps", "5"]
    assert tail[4:] == ["--pp", "1", "--dp", "1", "--run-dir", "runs/pipeline", "--set",
                        "pipeline.engine=pipeline", "--boundaries", ""]
    assert line[line.index("-np") + 1] == "1"


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def rank_pid(run_dir: Path, rank: int) -> int | None:
    starts = [e for e in read_events(run_dir) if e["kind"] == "start" and e.get("rank") == rank]
    return starts[-1]["pid"] if starts else None


@pytest.mark.timeout(600)   # three interpreter start-ups of up to 4 ranks on a shared 2-core box
def test_sigkilled_rank_restarts_on_the_rest_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("localhost slots=4\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    command = [sys.executable, "-m", "elastic.pipeline.supervisor", "charlm", "--hostfile",
               str(hostfile), "--pp", "2", "--run-dir", str(run_dir), "--max-restarts", "2",
               "--timeout", "400", "--", *JOB_ARGS]
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        manifest = wait_for(lambda: (m := read_manifest(run_dir / "checkpoint")) and
                            m["step"] >= 2 * EVERY and m, 240, "a checkpoint at step 20")
        pid = rank_pid(run_dir, 3)
        os.kill(pid, signal.SIGKILL)    # replica 1's last stage
        killed_after = manifest["step"]
        output, _ = proc.communicate(timeout=420)
    finally:
        if proc.poll() is None:    # the supervisor stops mpirun and its ranks on SIGTERM
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    report = json.loads((run_dir / "supervisor" / "report.json").read_text())
    assert proc.returncode == 0, output
    first, second = report["attempts"]
    assert (first["np"], first["dp"], first["exit_code"]) == (4, 2, 137), first
    assert first["dropped"] == [{"rank": 3, "host": "localhost", "signal": 9, "lost": "slot"}]
    assert (second["np"], second["pp"], second["dp"], second["exit_code"]) == (2, 2, 1, 0), second
    # Resumed exactly at the checkpoint in force when the rank died, then ran to the end.
    assert second["resumed_from"] >= killed_after and second["resumed_from"] % EVERY == 0
    assert second["resumed_from"] < STEPS
    resumes = [e for e in read_events(run_dir) if e["kind"] == "resume"]
    assert {e["step"] for e in resumes} == {second["resumed_from"]} and len(resumes) == 2
    assert {e["saved_world_size"] for e in resumes} == {4}
    result = report["result"]
    assert result["step"] == STEPS and result["world_size"] == 2
    assert result["metrics"]["test_loss"] < result["metrics"]["unigram_loss"] + 0.5
