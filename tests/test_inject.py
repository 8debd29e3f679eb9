"""Outside faults chained with +AFTER strike AFTER seconds after the one before them
struck, however long finding a host's processes took."""
import json
import subprocess
import sys
import time

import psutil

from elastic.launch.inject import Injector, Workers, thread_states
from elastic.launch.plan import fault
from elastic.runtime.events import EventLog


class SlowToFind(Workers):
    """Real processes, found as slowly as a busy machine's process table allows."""

    def __init__(self, procs: dict, lookup_s: float) -> None:
        super().__init__("test")
        self.procs, self.lookup_s = procs, lookup_s

    def pids(self, host, slot=None):
        time.sleep(self.lookup_s)
        return [(self.procs[host].pid, 0)] if host in self.procs else []


def test_a_chained_fault_strikes_after_the_one_before_it(tmp_path):
    procs = {h: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
             for h in ("a", "b", "c")}
    try:
        injector = Injector([fault("sigkill", "a", 5), fault("sigkill", "b", 5, after=0.1),
                             fault("sigkill", "c", 5, after=0.25)],
                            SlowToFind(procs, lookup_s=0.15), None, EventLog(tmp_path, "launcher", 0))
        injector.reached(4, 0.01)
        assert injector.timers == []                      # not yet: step 5 is not reached
        injector.reached(5, 0.01)
        for proc in procs.values():
            assert proc.wait(timeout=10) == -9
        deadline = time.monotonic() + 10     # each strike is recorded just after its kill
        while len(injector.struck) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        a, b, c = injector.struck
        assert [e["target"] for e in (a, b, c)] == ["a", "b", "c"]
        # each lookup took 0.15 s: from one arming timer, b would strike 0.05 s before a.
        # The upper bound leaves a busy machine room to wake a timer late.
        assert 0.1 + 0.15 <= b["wall_time"] - a["wall_time"] < 0.1 + 0.15 + 1.5
        assert 0.25 + 0.15 <= c["wall_time"] - b["wall_time"] < 0.25 + 0.15 + 1.5
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


def test_a_kill_whose_target_died_already_is_recorded_as_missed(tmp_path):
    """The second of two chained kills finds its target dead (Gloo aborted it for the
    first death): the run's events say so instead of dropping the fault."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        log = EventLog(tmp_path, "launcher", 0)
        injector = Injector([fault("sigkill", "a", 5), fault("sigkill", "b", 5, after=0.05),
                             fault("sigkill", "gone", 5, after=0.05)],
                            SlowToFind({"a": alive, "b": dead}, lookup_s=0), None, log)
        injector.reached(5, 0.01)
        assert alive.wait(timeout=10) == -9
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            text = "".join(p.read_text() for p in (tmp_path / "events").glob("*.jsonl"))
            if text.count('"fault_missed"') == 2:
                break
            time.sleep(0.02)
        events = [json.loads(line) for line in text.splitlines() if "victim_exited" not in line]
        assert [(e["kind"], e["target"], e["pid"]) for e in events] == [
            ("fault_injected", "a", alive.pid), ("fault_missed", "b", dead.pid),
            ("fault_missed", "gone", None)]
        assert [e["target"] for e in injector.struck] == ["a"]
    finally:
        alive.kill()
        alive.wait()


def test_the_launcher_records_when_a_killed_process_has_exited(tmp_path):
    """A SIGKILL is not a death: the kernel closes the victim's sockets only once its last
    thread has exited, and chaos runs measure their recoveries' tails against that."""
    victim = subprocess.Popen([sys.executable, "-c", (
        "import threading, time\n"
        "for _ in range(3): threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "print('up', flush=True); time.sleep(60)")], stdout=subprocess.PIPE, text=True)
    try:
        assert victim.stdout.readline() == "up\n"
        deadline = time.monotonic() + 5      # the main thread may not be asleep yet
        while not all(s.startswith("S:") for s in thread_states(victim.pid)) \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        states = thread_states(victim.pid)
        assert len(states) == 4 and all(s.startswith("S:") for s in states), states
        log = EventLog(tmp_path, "launcher", 0)
        injector = Injector([fault("sigkill", "a", 5)], SlowToFind({"a": victim}, 0), None, log)
        injector.reached(5, 0.01)
        assert victim.wait(timeout=10) == -9
        deadline, exited = time.monotonic() + 10, []
        while not exited and time.monotonic() < deadline:
            text = "".join(p.read_text() for p in (tmp_path / "events").glob("*.jsonl"))
            exited = [json.loads(line) for line in text.splitlines() if "victim_exited" in line]
            time.sleep(0.02)
        (event,) = exited
        assert (event["target"], event["victim"]) == ("a", victim.pid)
        struck = injector.struck[0]["wall_time"]
        assert 0 <= event["after_s"] <= event["wall_time"] - struck + 0.01
        assert event["after_s"] < 5
        assert thread_states(victim.pid) == []
    finally:
        victim.kill()
        victim.wait()


def test_a_stopped_process_is_continued_once_when_the_job_ends_before_its_time(tmp_path):
    """A stop of 60 s in a job that ends after 1: the injector's stop continues the
    process (recorded), once however often it is stopped (the launcher stops it twice)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        injector = Injector([fault("stop", "a", 5, seconds=60)], SlowToFind({"a": proc}, 0), None,
                            EventLog(tmp_path, "launcher", 0))
        injector.reached(5, 0.001)
        deadline = time.monotonic() + 10
        while not injector.struck and time.monotonic() < deadline:
            time.sleep(0.01)
        assert psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED
        injector.stop()
        assert psutil.Process(proc.pid).status() != psutil.STATUS_STOPPED
        injector.stop()
        assert [e["fault"] for e in injector.struck] == ["stop", "cont"]
    finally:
        proc.kill()
        proc.wait()
