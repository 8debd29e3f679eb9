"""A warm worker factory per host: new workers start in ~0.1 s instead of ~4 s.

A worker's start is mostly imports (torch, the job's libraries, the optimizer pulling in
torch._dynamo), and an elastic job waits for all of it whenever a host joins: Horovod
spawns the new worker only once the survivors have stopped to re-form the ring. The agent
pays those imports once, ahead of time, then forks a worker per request from
``elastic.launch.shim`` (the command horovodrun runs), so the survivors wait for a fork.

    python -m elastic.launch.agent --host 127.0.0.2 --preload jobs.digits

On a cluster, run one on each node before listing the node for discovery; without an
agent the shim simply execs Python. ``regatta local`` needs one per simulated host, all on
one machine: it warms a single process up (``--hosts-on-stdin``) and forks each host's
agent from it, inside that host's namespaces, so the imports are paid once per launch.

The agent stays single-threaded so forking is safe; each child gets the shim's stdio,
environment, working directory and argv, and its exit status goes back to the shim.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import select
import signal
import socket
import sys
import time

from dataclasses import dataclass
from typing import Callable
from pathlib import Path

from ..failures.restart import (AGENT_CHANNEL_ENV, AGENT_CHILD_ENV, CUT_OFF_EXIT, HANDOFF_ENV,
                       RESTART_EXIT, handoff_files, handoff_out, handoff_path, handoff_placed,
                       put_mark, rendezvous_server)
from .agent_address import DIR_ENV, NAMESPACE_ENV, WARMING_ENV, socket_name  # noqa: F401 (its users')
from .dying import HeldLifelines, sigkilled
from .target import Target

MAX_RESTARTS = 20   # replacements of one slot's worker in a row (a worker that keeps
                    # asking to be replaced would otherwise never give its slot back)
REFILL_WINDOW_S = 60.0   # a host whose workers fail twice within this is given up on


def tell(message: dict) -> None:
    """One JSON line on stdout for the launcher: ready, a worker started, a worker ended."""
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def warm_up(modules: list[str]) -> None:
    # No BLAS thread pools before fork: a forked child would inherit a pool whose threads
    # do not exist in it.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    for module in ["elastic.train", *modules]:
        importlib.import_module(module)
    import torch
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])   # imports torch._dynamo
    import horovod.torch  # noqa: F401


def run_child(request: dict, fds: list[int]) -> None:
    """In the forked child: become the worker the shim asked for. Never returns."""
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        target = Target.from_python_args(request["target"])
        sys.argv = [target.value, *request["args"]]
        sys.path.insert(0, request["cwd"] if target.kind == "module" else os.path.dirname(target.value))
        sys.modules.pop(target.value, None)   # a preloaded module now runs as __main__
        target.run()
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        import atexit
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def verdict(code: int, siblings: int, since_last_failure: float, window: float) -> str:
    """What a worker's failure costs: ``refilled`` (its slot only) or ``host_excluded``.

    Horovod excludes the whole host of a failed worker (its issue #1965), and the healthy
    workers beside it with it: on an 8-GPU node one crashed process costs eight. While
    another worker of the host lives, the host is evidently up, so a crashed worker (killed
    by a signal: the OOM killer, a segfault) gets a fresh one in its slot, which joins the
    survivors' recovery as a replacement does (elastic/failures/restart.py) and horovodrun never
    sees a failure. The host's only worker failing, a worker that exited with an error (it
    would fail again), or a second failure within ``window`` seconds go to horovodrun,
    which excludes the host (and, given a cooldown, may take it back later)."""
    crashed = code < 0
    return "refilled" if crashed and siblings > 0 and since_last_failure > window else "host_excluded"


@dataclass
class Child:
    conn: socket.socket      # the shim's connection
    request: dict
    fds: list                # the shim's stdio, kept for a replacement
    restarts: int = 0
    orphaned: bool = False   # its shim died: nobody to start a replacement for
    lifelines: HeldLifelines | None = None   # the running worker's (set as it is forked)


class Agent:
    """``exec_worker``: given, this is a shim's own agent for its one worker
    (own_agent.py), which listens for nobody and, in the forked child, starts the worker
    with ``exec_worker(request, fds, lifeline_fd)`` as a fresh interpreter instead of
    becoming a warm one."""

    def __init__(self, host: str, refill_window: float = REFILL_WINDOW_S,
                 exec_worker: Callable[[dict, list[int], int], None] | None = None):
        self.host, self.exec_worker = host, exec_worker
        self.cold = exec_worker is not None
        self.listener = None
        if not self.cold:
            self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.listener.bind(socket_name(host))
            self.listener.listen(64)
        self.children: dict[int, Child] = {}
        self.refill_window = refill_window
        self.last_failure = float("-inf")   # monotonic time of this host's last failed worker
        self.unreaped: set[int] = set()     # killed workers ended here, not yet reaped

    def serve_forever(self) -> None:
        """Until killed; a cold agent until its worker has ended for good."""
        while not (self.cold and not self.children and not self.unreaped):
            sent = {c.lifelines.channel: c for c in self.children.values()}
            watched = [*(c.conn for c in self.children.values()), *sent]
            if self.listener is not None:
                watched.append(self.listener)
            # A worker's SIGKILL and its exit are seen by polling; an agent without either
            # sleeps: fifty idle agents polling took 0.3 of 2 cores from a chaos run.
            busy = self.children or self.unreaped
            readable, _, _ = select.select(watched, [], [], 0.01 if busy else 0.5)
            for sock in readable:
                if sock is self.listener:
                    self.accept(self.listener.accept()[0])
                elif sock in sent:
                    sent[sock].lifelines.take()
                else:
                    self._shim_gone(sock)
            self._end_killed()
            self._reap()

    def accept(self, conn: socket.socket) -> None:
        """A shim's request on ``conn``: its worker's command, environment and stdio."""
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        self._spawn(Child(conn, json.loads(message.decode()), fds))

    def _end_killed(self) -> None:
        """A worker SIGKILLed is dead now, though its kernel may take a second to tear its
        memory down before closing its sockets (elastic/launch/dying.py): its lifelines
        are shut, its death marked and its slot refilled or given up at once. The zombie
        is reaped later, with nothing left to do."""
        for pid in [pid for pid in self.children if sigkilled(pid)]:
            child = self.children.pop(pid)
            self.unreaped.add(pid)
            child.lifelines.shut()
            child.lifelines.close()
            self._ended(pid, child, -signal.SIGKILL)

    def _spawn(self, child: Child, handoff: str = "") -> None:
        env = child.request["env"]
        env[AGENT_CHILD_ENV] = "1"
        env.pop(HANDOFF_ENV, None)
        if handoff:
            env[HANDOFF_ENV] = handoff
        child.lifelines = HeldLifelines()
        env[AGENT_CHANNEL_ENV] = str(child.lifelines.worker_end.fileno())
        pid = os.fork()
        if pid == 0:
            if self.listener is not None:
                self.listener.close()
            # Nothing of the other slots' shims: a worker holding another shim's output
            # open keeps horovodrun from seeing that shim end (it reads to the end first);
            # nor of their lifelines, which would then outlive their deaths.
            for other in self.children.values():
                other.conn.close()
                other.lifelines.close()
                for fd in other.fds:
                    os.close(fd)
            child.conn.close()
            child.lifelines.channel.close()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            # Pids repeat from one run's namespaces to the next: a hand-off left at this
            # pid's path by a worker of an earlier run (its agent killed with it out) would
            # be read as this worker's own, by this agent and by a replacement.
            for stale in handoff_files(handoff_path(env.get("HOROVOD_HOSTNAME", ""), os.getpid())):
                stale.unlink(missing_ok=True)
            if self.exec_worker is not None:
                self.exec_worker(child.request, child.fds, child.lifelines.worker_end.fileno())
            run_child(child.request, child.fds)
        child.lifelines.worker_end.close()
        self.children[pid] = child
        try:
            child.conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        except OSError:   # the shim died meanwhile: its worker must not outlive it
            child.orphaned = True
            os.kill(pid, signal.SIGKILL)
        tell({"spawn": pid, "host": env.get("HOROVOD_HOSTNAME", self.host),
              "slot": int(env.get("HOROVOD_LOCAL_RANK", 0)), "restarts": child.restarts})

    def _shim_gone(self, conn: socket.socket) -> None:
        """The shim died (horovodrun killed it): its worker must not outlive it."""
        for pid, child in list(self.children.items()):
            if child.conn is conn:
                child.orphaned = True
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _reap(self) -> None:
        while True:     # a killed worker already ended (_end_killed) is still to be reaped
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            child = self.children.pop(pid, None)
            self.unreaped.discard(pid)
            code = os.waitstatus_to_exitcode(status)
            tell({"exit": pid, "code": code})
            if child is not None:
                child.lifelines.close()    # now, or the peers never read their EOF
                self._ended(pid, child, code)

    def _refilled(self, pid: int, child: Child, code: int, handoff: Path) -> bool:
        """Whether a worker that failed got a fresh one in its slot (see :func:`verdict`)."""
        if child.orphaned or -code in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            return False   # stopped on purpose (the job or the launcher ending)
        env = child.request["env"]
        now = time.monotonic()
        action = verdict(code, len(self.children), now - self.last_failure, self.refill_window)
        self.last_failure = now
        tell({"slot_failed": pid, "host": env.get("HOROVOD_HOSTNAME", self.host),
              "slot": int(env.get("HOROVOD_LOCAL_RANK", 0)), "code": code, "action": action})
        if action == "refilled":   # as a replacement with nothing handed over: it asks the
            self._spawn(child, handoff=str(handoff))   # driver for its place; the sync fills it
        return action == "refilled"

    def _ended(self, pid: int, child: Child, code: int) -> None:
        """A worker asked to be replaced (see elastic/failures/restart.py), or ended for good: then
        a death marks the rendezvous of the world it belonged to, before the shim tells
        horovodrun, so that no survivor waits for it there."""
        env = child.request["env"]
        handoff = handoff_path(env.get("HOROVOD_HOSTNAME", ""), pid)
        aborted_forming = code == -signal.SIGABRT and handoff_out(handoff)
        if aborted_forming and not handoff_placed(handoff):
            # The driver left its slot out of the world forming (its host was removed):
            # nobody waits for it and there is no place to refill. A replacement would ask
            # the driver for a place all the same and be counted in the next rendezvous.
            for leftover in handoff_files(handoff):
                leftover.unlink(missing_ok=True)
            tell({"left_out": pid, "code": code})
            self._tell_shim(child, code)
            return
        # SIGABRT with its hand-off out, placed: Gloo aborted it for a peer's death (restart.py)
        replace = code == RESTART_EXIT or aborted_forming
        if replace and child.restarts < MAX_RESTARTS:
            child.restarts += 1
            tell({"replace": pid, "code": code})
            self._spawn(child, handoff=str(handoff))
            return
        for leftover in handoff_files(handoff):   # a death while re-forming
            leftover.unlink(missing_ok=True)
        if code not in (0, CUT_OFF_EXIT):   # one cut off cannot reach the driver anyway
            put_mark(rendezvous_server(env), f"{env.get('HOROVOD_HOSTNAME')} pid {pid} exit {code}")
            if self._refilled(pid, child, code, handoff):
                return
        self._tell_shim(child, code)

    def _tell_shim(self, child: Child, code: int) -> None:
        """The slot's worker ended for good: its shim exits with ``code``."""
        try:
            child.conn.sendall(json.dumps({"exit": code}).encode() + b"\n")
        except OSError:
            pass
        child.conn.close()
        for fd in child.fds:
            os.close(fd)


def serve(host: str, refill_window: float = REFILL_WINDOW_S) -> None:
    """Be ``host``'s agent until told to stop. Never returns."""
    agent = Agent(host, refill_window)
    tell({"ready": os.getpid(), "host": host})
    # Told to stop: at once, without tearing down the preloaded libraries (seconds under
    # load); the workers it forked get the same signal from the launcher (one group).
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    agent.serve_forever()


def name_process(host: str) -> None:
    """Call this process (and the workers it forks) after its simulated host in ``ps``
    and /proc/PID/comm: forked from one warm process, they share its command line."""
    import ctypes
    ctypes.CDLL(None).prctl(15, host.encode()[:15], 0, 0, 0)   # PR_SET_NAME


def serve_hosts_on_stdin() -> None:
    """Fork an agent for each line on stdin, ``{"host": NAME, "netns": PID or null}`` (the
    process holding the host's namespaces), until stdin ends."""
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)   # agents are reaped by the kernel
    tell({"ready": os.getpid(), "host": None})
    for line in sys.stdin:
        request = json.loads(line)
        if os.fork() == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)   # an agent reaps its workers
            try:
                if request.get("netns"):
                    from .netns import join
                    join(request["netns"])
                name_process(request["host"])
                serve(request["host"], request.get("refill_window", REFILL_WINDOW_S))
            except BaseException as err:   # said on the shared stdout, or the launcher waits
                tell({"failed": request["host"], "error": f"{type(err).__name__}: {err}"})
                os._exit(1)
    os._exit(0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m elastic.launch.agent", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--host", help="the host name the launcher uses")
    which.add_argument("--hosts-on-stdin", action="store_true",
                       help="fork an agent per host named on stdin (simulated hosts)")
    parser.add_argument("--preload", action="append", default=[], metavar="MODULE")
    parser.add_argument("--refill-window", type=float, default=REFILL_WINDOW_S, metavar="SECONDS",
                        help="a crashed worker's slot is refilled while another worker of the "
                             "host lives, unless the host had a failure within SECONDS (default 60)")
    args = parser.parse_args(argv)
    warm_up(args.preload)
    if args.hosts_on_stdin:
        serve_hosts_on_stdin()
    serve(args.host, args.refill_window)


if __name__ == "__main__":
    main()
