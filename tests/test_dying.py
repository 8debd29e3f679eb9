"""A SIGKILLed worker's lifelines are shut by its agent the moment the signal is sent, not
when its kernel has finished tearing its memory down (elastic/launch/dying.py)."""
import os
import signal
import socket
import subprocess
import sys
import time

from conftest import PYTHON, ROOT, kill_tree
from elastic.launch.dying import HeldLifelines, sigkilled
from elastic.launch.inject import thread_states
from test_agent import agent, shim  # noqa: F401 (the module's warm agent)

GB = 2.0     # torn down in about 0.2 s here: far longer than shutting a connection takes
BIG = str(ROOT / "tests" / "workers" / "big_worker.py")


def test_only_a_sigkill_makes_a_death_certain():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    exiting = subprocess.Popen([sys.executable, "-c", "import os, time; time.sleep(0.3); os._exit(9)"])
    try:
        assert not sigkilled(sleeper.pid)
        sleeper.send_signal(signal.SIGKILL)
        assert sigkilled(sleeper.pid)       # pending, delivered, or a zombie: all certain
        assert exiting.wait(timeout=30) == 9
        assert not sigkilled(exiting.pid)   # a zombie that exited with 9, not from SIGKILL
    finally:
        for proc in (sleeper, exiting):
            proc.kill()
            proc.wait()


# The main thread spins at SCHED_IDLE beside busy processes on one CPU, so it runs long
# after another thread's os._exit marked it with SIGKILL (how the kernel ends the other
# threads of an exiting process): hundreds of ms here, while the agent looks every 10 ms.
STARVED_EXIT = """
import os, sys, threading, time
os.sched_setaffinity(0, {0})
os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
threading.Thread(target=lambda: (time.sleep(0.5), os._exit(7))).start()
while True:
    pass
"""
BUSY = "import os, time; os.sched_setaffinity(0, {0}); end = time.time() + 20\nwhile time.time() < end: pass"


def test_an_exit_from_a_thread_is_not_a_sigkill():
    """A worker restarting in place leaves by os._exit from a watcher thread: its agent
    must see an exit with its code, never a SIGKILL (it would refill the slot)."""
    busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(3)]
    child = subprocess.Popen([sys.executable, "-c", STARVED_EXIT])
    try:
        polls = 0
        while child.poll() is None:   # (the old check said yes here in 3 runs of 3)
            assert not sigkilled(child.pid), f"after {polls} polls"
            polls += 1
        assert child.returncode == 7 and polls > 100
    finally:
        for proc in busy + [child]:
            proc.kill()
            proc.wait()


def big_process(server: socket.socket, held: HeldLifelines | None):
    """A process with GB of memory and a connection to ``server``, handed to ``held``."""
    channel = [str(held.worker_end.fileno())] if held else []
    child = subprocess.Popen([PYTHON, BIG, str(server.getsockname()[1]), str(GB), *channel],
                             cwd=ROOT, pass_fds=[int(c) for c in channel])
    ours = server.accept()[0]
    ours.settimeout(60)
    assert int(ours.recv(16).split()[0]) == child.pid    # resident, and handed over
    return child, ours


def eof_after_kill(pid: int, ours, held: HeldLifelines | None = None) -> tuple[float, bool]:
    """Seconds from the SIGKILL to our EOF, and whether the process was still exiting.
    With ``held``, this test is the agent: it shuts the lifeline the process handed over."""
    os.kill(pid, signal.SIGKILL)
    killed = time.perf_counter()
    if held is not None:
        held.take()
        assert sigkilled(pid) and held.shut() == 1
    assert ours.recv(1) == b""
    return time.perf_counter() - killed, thread_states(pid) != []


def gone_within(pid: int, seconds: float) -> bool:
    """Whether every thread of ``pid`` has exited (a zombie, or reaped) within ``seconds``."""
    deadline = time.perf_counter() + seconds
    while thread_states(pid) and time.perf_counter() < deadline:
        time.sleep(0.001)
    return thread_states(pid) == []


def test_held_lifelines_are_shut_before_the_memory_is_torn_down():
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(60)
        plain, plain_ours = big_process(server, None)
        held = HeldLifelines()
        handed, handed_ours = big_process(server, held)
    try:
        eof, _ = eof_after_kill(plain.pid, plain_ours)
        # Without: EOF only once the kernel has torn the memory down (about 0.2 s here);
        # the exit's last steps after closing the files can still be running as we look.
        assert gone_within(plain.pid, 0.1), thread_states(plain.pid)
        eof, exiting = eof_after_kill(handed.pid, handed_ours, held)
        assert exiting and eof < 0.1, eof
        assert plain.wait(timeout=30) == handed.wait(timeout=30) == -signal.SIGKILL
    finally:
        held.close()
        for proc in (plain, handed):
            proc.kill()
            proc.wait()


def test_the_agent_shuts_a_killed_workers_lifelines_and_ends_its_slot_at_once(agent):  # noqa: F811
    """The worker hands its lifeline over as a Regatta worker does after each build
    (elastic.failures.restart.hand_lifelines_to_agent); SIGKILLed from outside, its peer reads EOF
    and its shim exits -9 while the kernel still tears its memory down."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(60)
        proc = shim(agent, job=(BIG,), args=(str(server.getsockname()[1]), str(GB)))
        try:
            ours = server.accept()[0]
            ours.settimeout(60)
            pid = int(ours.recv(16).split()[0])
            time.sleep(0.2)                   # the agent has read what the worker sent
            eof, exiting = eof_after_kill(pid, ours)
            assert exiting and eof < 0.5, eof
            assert proc.wait(timeout=30) == -signal.SIGKILL
        finally:
            kill_tree(proc.pid)

