"""Launchers stop on SIGTERM, SIGINT and SIGHUP: everything they started ends, and every
alias or namespace they made goes, within seconds; a second signal forces it.

Python runs no ``finally`` when SIGTERM or SIGHUP kills it, so a launcher that is told
to stop by ``timeout``, a scheduler or a closed terminal would leave its workers
training. :class:`Stopping` turns the first signal into a flag the launcher's loop
checks (its ``finally`` blocks then clean up) and passes it on to the children it was
given; a second signal SIGKILLs those children at once and raises ``KeyboardInterrupt``.
Nested (``regatta demo`` runs ``regatta local``), the inner one passes the signal on to
the outer one when it is done.
"""
from __future__ import annotations

import os
import signal
import subprocess

import psutil

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
GRACE_S = 2.0


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def stop_tree(*procs: subprocess.Popen, grace: float = GRACE_S) -> None:
    """End each of ``procs`` and every process under them (horovodrun puts workers in
    their own process groups, so a group is not enough): SIGTERM to all at once, then
    SIGKILL to whatever is left after ``grace`` seconds."""
    victims = [v for proc in procs for v in _descendants(proc.pid)]
    for victim in victims:
        for sig in (signal.SIGTERM, signal.SIGCONT):   # a stopped process acts on it once continued
            try:
                victim.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
    _, alive = psutil.wait_procs(victims, timeout=grace)
    late = [v for proc in procs for v in _descendants(proc.pid) if v not in victims]
    for victim in alive + late:
        try:
            victim.kill()
        except psutil.NoSuchProcess:
            pass
    for proc in procs:
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass


def _ignores(proc: subprocess.Popen) -> bool:
    """``unshare --fork`` ignores SIGTERM and SIGINT while it waits: its child, the first
    process of the new namespaces, is the one to tell."""
    try:
        return psutil.Process(proc.pid).name() == "unshare"
    except psutil.NoSuchProcess:
        return False


class Stopping:
    """``with Stopping() as stopping:`` ... ``stopping.forward_to(child)`` ...
    ``if stopping.requested: ...`` (the signal number, or 0)."""

    def __init__(self) -> None:
        self.requested = 0
        self._children: list[tuple[subprocess.Popen, bool]] = []
        self._previous: dict = {}

    def forward_to(self, proc: subprocess.Popen, group: bool = False) -> None:
        """Pass signals on to ``proc`` (its whole process group with ``group``)."""
        self._children.append((proc, group))

    def __enter__(self) -> "Stopping":
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, _frame) -> None:
        forced = bool(self.requested)
        self.requested = self.requested or signum
        for proc, group in self._children:
            if proc.poll() is not None:
                continue
            sig = signal.SIGKILL if forced else signal.SIGTERM
            try:
                if group:
                    os.killpg(proc.pid, sig)
                else:
                    proc.send_signal(sig)
                    if _ignores(proc):
                        for child in psutil.Process(proc.pid).children():
                            child.send_signal(sig)
            except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
                pass
        if forced:
            for proc, _ in self._children:
                for victim in _descendants(proc.pid):
                    try:
                        victim.kill()
                    except psutil.NoSuchProcess:
                        pass
            raise KeyboardInterrupt(f"second signal {signum}: stopping now")

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        outer = self._previous.get(self.requested)
        if self.requested and isinstance(getattr(outer, "__self__", None), Stopping):
            outer(self.requested, None)   # a launcher around this one must stop as well
