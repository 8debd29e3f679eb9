"""Faults from outside the training processes, at random instants, as real ones come.

The launcher knows each host's training processes (:class:`Workers`: the processes the
warm agents forked, or with cold workers the Python processes horovodrun started) and,
once a fault's step is reached, strikes at a random instant within the next two steps:
mid-allreduce, mid-commit or mid-reset alike. Each strike is recorded as a
``fault_injected`` event (fault, target host, slot, pid) in the launcher's event log,
and so in the store when the run has one.
"""
from __future__ import annotations

import glob
import json
import os
import random
import signal
import threading
import time

import psutil

from .agent import NAMESPACE_ENV


SLOW_EXIT_S = 0.2     # a SIGKILLed process still running threads this long: say what they did
EXIT_WATCH_S = 30.0


def thread_states(pid: int) -> list[str]:
    """``STATE:wait_channel@cpuN`` of each of ``pid``'s threads that has not exited, sorted
    (N: the CPU it last ran on)."""
    states = []
    for task in glob.glob(f"/proc/{pid}/task/*"):
        try:
            with open(f"{task}/stat") as stat, open(f"{task}/wchan") as wchan:
                fields = stat.read().rsplit(")", 1)[1].split()
                if fields[0] not in ("Z", "X"):
                    states.append(f"{fields[0]}:{wchan.read()}@cpu{fields[36]}")
        except OSError:      # exited meanwhile
            pass
    return sorted(states)


def stolen_s() -> dict[str, float]:
    """Per CPU, the seconds the hypervisor ran something else while this machine's CPU
    wanted to run (/proc/stat's steal; 0 on bare metal)."""
    with open("/proc/stat") as stat:
        return {f[0]: int(f[8]) / os.sysconf("SC_CLK_TCK") for f in map(str.split, stat)
                if f[0].startswith("cpu") and f[0] != "cpu"}


class Workers:
    """Which process is the training process of (host, slot) right now."""

    def __init__(self, namespace: str, on_slot_failed=None) -> None:
        self.namespace = namespace
        self.on_slot_failed = on_slot_failed   # called with the agent's word on a failed slot
        self._lock = threading.Lock()
        self._live: dict[int, tuple[str, int]] = {}   # pid -> (host, slot), from agents
        self._said = threading.Condition(self._lock)
        self._ready = 0          # agents that said they are ready
        self._trouble = ""       # an agent that could not start, or the agents' end

    def follow(self, stream) -> None:
        """Read an agent's announcements (elastic.launch.agent.tell) until it ends."""
        def read() -> None:
            for line in stream:
                try:
                    message = json.loads(line)
                except json.JSONDecodeError:
                    continue
                with self._lock:
                    if "ready" in message or "failed" in message:
                        self._ready += "ready" in message
                        if "failed" in message and not self._trouble:
                            self._trouble = line.strip()
                        self._said.notify_all()
                    elif "spawn" in message:
                        self._live[message["spawn"]] = (message["host"], message["slot"])
                    elif "exit" in message:
                        self._live.pop(message["exit"], None)
                if "slot_failed" in message and self.on_slot_failed is not None:
                    self.on_slot_failed({"target": message["host"], "slot": message["slot"],
                                         "pid": message["slot_failed"], "code": message["code"],
                                         "action": message["action"]})
            with self._lock:
                self._trouble = self._trouble or "no answer"
                self._said.notify_all()
        threading.Thread(target=read, name="regatta-agent-reader", daemon=True).start()

    def wait_ready(self, count: int) -> str:
        """Wait until ``count`` agents said they are ready (their workers may already be
        starting meanwhile); empty, or what an agent said that could not start."""
        with self._lock:
            self._said.wait_for(lambda: self._ready >= count or self._trouble)
            return "" if self._ready >= count else self._trouble

    def pids(self, host: str, slot: int | None = None) -> list[tuple[int, int]]:
        """(pid, slot) of host's training processes, oldest first."""
        with self._lock:
            found = [(pid, s) for pid, (h, s) in self._live.items() if h == host]
        found += self._started_by_horovodrun(host)
        return sorted((p, s) for p, s in found if slot is None or s == slot)

    def _started_by_horovodrun(self, host: str) -> list[tuple[int, int]]:
        """Cold workers: Python processes whose environment names this launch and host."""
        found = []
        for proc in psutil.process_iter(["pid", "name"]):
            try:
                env = proc.environ()
            except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
                continue
            if env.get(NAMESPACE_ENV) == self.namespace and env.get("HOROVOD_HOSTNAME") == host \
                    and "python" in (proc.info["name"] or "") and "elastic.launch.shim" not in \
                    " ".join(proc.cmdline()):
                found.append((proc.pid, int(env.get("HOROVOD_LOCAL_RANK", 0))))
        return found


class Injector:
    """Strikes the plan's outside faults. ``reached(step, step_time)`` from the launcher's
    loop arms the faults whose step has come; each then strikes on its own timer."""

    def __init__(self, faults: list[dict], workers: Workers, network, log, seed: int = 0):
        self.pending = sorted(faults, key=lambda f: f["step"])   # stable: chains stay in order
        self.workers, self.network, self.log = workers, network, log
        self.rng = random.Random(seed)
        self.timers: list[threading.Timer] = []
        self.struck: list[dict] = []
        self._undos: list = []          # a link to heal, a process to continue: once each
        self._undo_lock = threading.Lock()

    def reached(self, step: int, step_time: float) -> None:
        while self.pending and step >= self.pending[0]["step"]:
            chain = [self.pending.pop(0)]
            while self.pending and self.pending[0].get("after") is not None:
                chain.append(self.pending.pop(0))
            after = chain[0].get("after")
            self._later(after if after is not None else self.rng.uniform(0, 2 * max(step_time, 0.01)),
                        self._strike_chain, chain, step)

    def _strike_chain(self, chain: list[dict], step: int) -> None:
        """A fault, then each that follows it AFTER seconds after it struck (finding a
        host's processes takes tens of milliseconds: a timer from the arming would not do)."""
        self._strike(chain[0], step)
        if chain[1:]:
            self._later(chain[1]["after"], self._strike_chain, chain[1:], step)

    def _later(self, seconds: float, action, *args) -> None:
        timer = threading.Timer(seconds, action, args)
        timer.daemon = True
        self.timers.append(timer)
        timer.start()

    def _undo_later(self, seconds: float, action, *args) -> None:
        """``action`` undoes a fault: it runs after ``seconds``, or at :meth:`stop` if the
        job ends sooner, and once only either way."""
        done = []

        def once() -> None:
            with self._undo_lock:
                if done:
                    return
                done.append(True)
            action(*args)
        self._undos.append(once)
        self._later(seconds, once)

    def _strike(self, fault: dict, step: int) -> None:
        kind, host = fault["fault"], fault["host"]
        if kind in ("sigkill", "stop"):
            sig = signal.SIGKILL if kind == "sigkill" else signal.SIGSTOP
            name = "kill" if kind == "sigkill" else "stop"
            targets = self.workers.pids(host, fault["slot"])
            for pid, slot in targets:
                self._signal(pid, sig, name, host, slot, step)
            if not targets:
                self._missed(name, host, fault["slot"], None, step)
            if kind == "stop":
                self._undo_later(fault["seconds"], self._resume, targets, host, step)
        else:
            self.network.link(host, up=False)
            self._record(kind, host, None, None, step, seconds=fault["seconds"])
            if kind == "partition":
                self._undo_later(fault["seconds"], self._heal, host, step)

    def _signal(self, pid: int, sig: int, name: str, host: str, slot: int, step: int) -> None:
        # Stamped before the signal: this thread may be descheduled right after it, while
        # the victim's agent and peers already record what followed (its slot_failed)
        sent = time.time()
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            self._missed(name, host, slot, pid, step)
            return
        self._record(name, host, slot, pid, step, wall_time=sent)
        if sig == signal.SIGKILL:
            threading.Thread(target=self._watch_death, args=(pid, host, step),
                             name="regatta-victim-watch", daemon=True).start()

    def _watch_death(self, pid: int, host: str, step: int) -> None:
        """Record ``victim_exited`` once every thread of the SIGKILLed ``pid`` has exited:
        only then does the kernel close its sockets, so no peer can notice the death
        sooner. A slow exit (over SLOW_EXIT_S) also records what its threads were doing
        (state, kernel wait channel, CPU) as they changed and each CPU's time stolen by the
        hypervisor meanwhile, so a recovery's tail can be told apart: ours, or a victim
        the kernel had not finished killing."""
        started, seen, last, steal = time.perf_counter(), [], None, stolen_s()
        while time.perf_counter() - started < EXIT_WATCH_S:
            live = thread_states(pid)
            if not live:
                break
            if live != last:
                seen.append([round(time.perf_counter() - started, 3), live])
                last = live
            time.sleep(0.003)
        after = time.perf_counter() - started
        slow = {"threads": seen[:12], "stolen_s": {cpu: round(s - steal[cpu], 2)
                                                   for cpu, s in stolen_s().items()}}
        self.log.record("victim_exited", step, target=host, victim=pid, after_s=round(after, 4),
                        **(slow if after > SLOW_EXIT_S else {}))

    def _missed(self, fault: str, host: str, slot, pid, step: int) -> None:
        """Said, not silently dropped: the target died before the fault came (a chained
        kill's target that Gloo aborted for the first death, say)."""
        self.log.record("fault_missed", step, fault=fault, target=host, slot=slot, pid=pid)

    def _resume(self, targets: list, host: str, step: int) -> None:
        for pid, slot in targets:
            self._signal(pid, signal.SIGCONT, "cont", host, slot, step)

    def _heal(self, host: str, step: int) -> None:
        self.network.link(host, up=True)
        self._record("heal", host, None, None, step)

    def _record(self, fault: str, host: str, slot, pid, step: int, wall_time: float | None = None,
                **detail) -> None:
        event = self.log.record("fault_injected", step, wall_time, fault=fault, target=host, slot=slot,
                                pid=pid, **detail)
        self.struck.append(event)

    def stop(self) -> None:
        """No fault strikes any more; the ones struck are undone now (a healed link, a
        continued process, recorded as such) where the job ended before their time."""
        for timer in self.timers:
            timer.cancel()
        for undo in self._undos:
            undo()
