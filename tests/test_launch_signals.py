"""SIGTERM, SIGINT and SIGHUP to `regatta local`, `regatta supervise` and `regatta demo`
while they train: every process they started ends and every alias or namespace goes,
within 10 s; a second signal forces it. Real launchers, real workers."""
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import pytest

from conftest import BIN, ROOT, kill_tree
from elastic.launch import netns

MARK = "REGATTA_SIGNAL_TEST"
NETNS = not netns.available()


def marked(mark: str) -> list[psutil.Process]:
    """Live processes that inherited this test's mark: everything the launcher started."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get(MARK) == mark:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def loopback() -> set[str]:
    return set(subprocess.run(["ip", "-br", "addr", "show", "lo"], capture_output=True,
                              text=True).stdout.split()[2:])


def temporary() -> set[Path]:
    """What Regatta keeps in the machine's temporary folder (agents' sockets, say)."""
    return set(Path(tempfile.gettempdir()).glob("regatta-*"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp, kind: str) -> tuple[list[str], object]:
    """The command line of each launcher under test, and how to tell it is training."""
    local = [str(BIN / "regatta"), "local", "digits", "--hosts", "2", "--steps", "100000",
             "--run-dir", str(tmp / "run"), "--timeout", "300"]
    progress = tmp / "run" / "progress"
    if kind == "local-netns":
        return local + ["--netns"], progress
    if kind == "local-aliases":
        return local + ["--aliases"], progress
    if kind == "supervise":
        (tmp / "hosts.txt").write_text("localhost slots=2\n")
        return [sys.executable, "-m", "regatta", "supervise", "charlm", "--hostfile",
                str(tmp / "hosts.txt"), "--pp", "2", "--run-dir", str(tmp / "run"), "--",
                "--steps", "100000", "--global-batch", "8", "--microbatches", "2",
                "--set", "model.layers=2", "--set", "model.dim=32", "--set", "model.context=16"], \
            tmp / "run" / "events"
    return [sys.executable, "-m", "regatta", "demo", "--db", str(tmp / "demo.db"),
            "--port", str(free_port()), "--steps", "100000"], tmp / "runs" / "demo" / "progress"


CASES = [("local-netns", [signal.SIGTERM]), ("local-aliases", [signal.SIGINT]),
         ("local-netns", [signal.SIGHUP, signal.SIGHUP]), ("supervise", [signal.SIGTERM]),
         ("demo", [signal.SIGHUP])]


@pytest.mark.parametrize("kind, signals", CASES, ids=[f"{k}-{'-'.join(s.name for s in sig)}"
                                                      for k, sig in CASES])
def test_a_signal_stops_everything_the_launcher_started(tmp_path, kind, signals):
    if "netns" in kind and not NETNS:
        pytest.skip(f"network namespaces are unavailable: {netns.available()}")
    mark, before, kept = uuid.uuid4().hex, loopback(), temporary()
    ours = {f"127.0.0.{i}/8" for i in (2, 3)} - before if kind == "local-aliases" else set()
    command, training = launch(tmp_path, kind)
    env = {**os.environ, MARK: mark, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    log = open(tmp_path / "launcher.log", "w")
    proc = subprocess.Popen(command, cwd=tmp_path if kind == "demo" else ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not training.exists() or len(marked(mark)) < 4:   # workers are up
            assert proc.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "launcher.log").read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(1.0)
        signalled = time.monotonic()
        for signum in signals:
            proc.send_signal(signum)
            time.sleep(0.3)
        proc.wait(timeout=10)
        while marked(mark) and time.monotonic() - signalled < 10:
            time.sleep(0.1)
        took = time.monotonic() - signalled
        assert marked(mark) == [] and took < 10, (took, marked(mark))
        assert not (loopback() - before) & ours          # every alias we added is gone
        assert temporary() - kept == set()
        assert proc.returncode != 0                       # stopped, not finished
    finally:
        kill_tree(proc.pid)
        for leftover in marked(mark):
            leftover.kill()
        log.close()
