"""Shared fixtures: run real commands (mpirun, horovodrun via `regatta local`) with a
timeout, and always clean up their whole process group."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
BIN = Path(PYTHON).parent


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant: mpirun puts its ranks in other process
    groups, so killing the group alone leaves them running."""
    try:
        parent = psutil.Process(pid)
        victims = parent.children(recursive=True) + [parent]
    except psutil.NoSuchProcess:
        return
    for proc in victims:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(victims, timeout=10)


def run(cmd: list[str], timeout: float, env: dict | None = None, check: bool = True,
        cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own session; on timeout kill the whole group and fail."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} timed out after {timeout} s:\n{out[-4000:]}")
    finally:
        kill_tree(proc.pid)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, "")
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}:\n{out[-4000:]}")
    return result


def regatta_local(tmp: Path, *args: str, timeout: float = 240, env: dict | None = None,
                  job_args: list[str] = ()) -> dict:
    """Run `regatta local` and return its JSON report."""
    report = tmp / "report.json"
    cmd = [str(BIN / "regatta"), "local", *args, "--run-dir", str(tmp / "run"),
           "--report", str(report), "--timeout", str(timeout - 20)]
    if job_args:
        cmd += ["--", *job_args]
    run(cmd, timeout, env={"REGATTA_AUDIT": "1", **(env or {})})
    return json.loads(report.read_text())


def mpirun(np: int, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(np),
                "-x", "OMP_NUM_THREADS", "-x", "PYTHONUNBUFFERED", *args], timeout)


def kinds(report: dict, kind: str) -> list[dict]:
    return [e for e in report["events"] if e["kind"] == kind]
