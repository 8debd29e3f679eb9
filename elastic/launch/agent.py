"""A warm worker factory per host: new workers start in ~0.1 s instead of ~4 s.

A worker's start is mostly imports (torch, the job's libraries, the optimizer pulling in
torch._dynamo), and an elastic job waits for all of it whenever a host joins: Horovod
spawns the new worker only once the survivors have stopped to re-form the ring. The agent
pays those imports once, ahead of time, then forks a worker per request from
``elastic.launch.shim`` (the command horovodrun runs), so the survivors wait for a fork.

    python -m elastic.launch.agent --host 127.0.0.2 --preload jobs.digits

``regatta local`` starts one per simulated host. On a cluster, run one on each node
before listing the node for discovery; without an agent the shim simply execs Python.

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

SOCKET_PREFIX = "\0regatta-agent-"   # abstract unix socket: nothing to clean up on disk
NAMESPACE_ENV = "REGATTA_AGENT_NAMESPACE"


def socket_name(host: str, namespace: str | None = None) -> str:
    """Agents of different launches on one machine (simulated hosts share it) must not
    serve each other's workers: the launcher's namespace keeps them apart."""
    namespace = os.environ.get(NAMESPACE_ENV, "") if namespace is None else namespace
    return f"{SOCKET_PREFIX}{namespace}-{host}" if namespace else SOCKET_PREFIX + host


def warm_up(modules: list[str]) -> None:
    # No BLAS thread pools before fork: a forked child would inherit a pool whose threads
    # do not exist in it.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    for module in ["elastic.runner", *modules]:
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
        sys.argv = [request["module"], *request["args"]]
        sys.path.insert(0, request["cwd"])
        import runpy
        sys.modules.pop(request["module"], None)   # preloaded; now it runs as __main__
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
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


class Agent:
    def __init__(self, host: str):
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(socket_name(host))
        self.listener.listen(64)
        self.children: dict[int, socket.socket] = {}   # pid -> the shim's connection

    def serve_forever(self) -> None:
        while True:
            watched = [self.listener, *self.children.values()]
            readable, _, _ = select.select(watched, [], [], 0.05)
            for sock in readable:
                if sock is self.listener:
                    self._spawn(*self.listener.accept())
                else:
                    self._shim_gone(sock)
            self._reap()

    def _spawn(self, conn: socket.socket, _addr) -> None:
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        request = json.loads(message.decode())
        pid = os.fork()
        if pid == 0:
            self.listener.close()
            for other in self.children.values():
                other.close()
            conn.close()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            run_child(request, fds)
        for fd in fds:
            os.close(fd)
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        self.children[pid] = conn

    def _shim_gone(self, conn: socket.socket) -> None:
        """The shim died (horovodrun killed it): its worker must not outlive it."""
        for pid, other in list(self.children.items()):
            if other is conn:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m elastic.launch.agent", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", required=True, help="the host name the launcher uses")
    parser.add_argument("--preload", action="append", default=[], metavar="MODULE")
    args = parser.parse_args(argv)
    warm_up(args.preload)
    agent = Agent(args.host)
    print(f"regatta agent for {args.host} ready (pid {os.getpid()})", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    agent.serve_forever()


if __name__ == "__main__":
    main()
