"""The agent a worker's shim forks for it where its host has no warm one (shim.py): one
worker, started cold as a fresh interpreter, its death and its restarts in place handled
as a host's agent (agent.py) handles them.
"""
from __future__ import annotations

import os
import signal
import socket
import sys

from .agent import Agent
from .agent_address import FORWARDED   # the shim's to forward: the worker's to act on


def exec_child(request: dict, fds: list[int], keep: int) -> None:
    """In the forked child of a cold agent: exec a fresh interpreter as the worker the
    shim asked for, with the shim's stdio and environment and the lifeline channel
    ``keep`` left open. Never returns."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.set_inheritable(keep, True)
    for signum in FORWARDED:   # ignored ones survive exec
        signal.signal(signum, signal.SIG_DFL)
    os.chdir(request["cwd"])
    os.execve(sys.executable, [sys.executable, *request["target"], *request["args"]],
              request["env"])


def serve_one(host: str, conn: socket.socket) -> None:
    """A shim's own agent, for a host without one (forked by the shim, which talks to it
    over ``conn`` as to a host's agent): its worker starts cold, as without an agent, but
    its death is marked and its lifelines shut at once, and a worker restarted in place
    gets a fresh one in its slot (elastic/failures/restart.py), instead of its peers waiting
    out Gloo's 30 s. Signals are the shim's to forward; ends with its worker. Never
    returns."""
    for signum in FORWARDED:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)   # what it tells a launcher would land in the job's output
    os.close(devnull)
    try:
        agent = Agent(host, exec_worker=exec_child)
        agent.accept(conn)
        agent.serve_forever()
    except BaseException:
        import traceback
        traceback.print_exc()
        os._exit(1)
    os._exit(0)
