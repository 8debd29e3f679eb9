"""What horovodrun runs for each worker when warm agents are in use:

    python -m elastic.launch.shim -m jobs.digits --steps 100 ...
    python -m elastic.launch.shim path/to/train.py --steps 100 ...

It asks this host's agent (elastic.launch.agent) to fork the worker, hands over its
stdin/stdout/stderr, forwards signals to the worker, and exits as the worker did (killed
by a signal -> killed by the same signal), so horovodrun cannot tell the difference. A
worker the agent replaced in place (elastic/failures/restart.py) is, to horovodrun, the same one. With
no agent listening (and no launcher's marker, ``$REGATTA_AGENTS_WARMING``, saying the
agents are still warming up: then it waits for its agent) it forks an agent of its own,
which starts ``python -m MODULE ...`` cold: a worker's death is then marked and its
lifelines shut by that agent, and a worker restarted in place gets a fresh one, as
under a host's agent. Imports nothing heavy.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time

from .agent_address import FORWARDED, WARMING_ENV, socket_name


WARMING_WAIT_S = 120.0   # an agent still warming up after this is not coming


def _own_agent(host: str) -> socket.socket:
    """No agent on this host: fork one for this worker alone (own_agent.serve_one), and a
    connection to it. Its worker starts cold, but dies and restarts as a warm agent's do."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    if os.fork() == 0:
        ours.close()
        from .own_agent import serve_one
        serve_one(host, theirs)
    theirs.close()
    return ours


def _connect(host: str) -> socket.socket | None:
    """A connection to this host's agent; while the launcher says the agents are still
    warming up (horovodrun starts meanwhile), wait for it. None: no agent."""
    warming = os.environ.get(WARMING_ENV, "")
    deadline = time.monotonic() + WARMING_WAIT_S
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(socket_name(host))
            return conn
        except OSError:
            conn.close()
            if not (warming and os.path.exists(warming)) or time.monotonic() > deadline:
                return None
            time.sleep(0.02)


def _read_message(stream) -> dict | None:
    line = stream.readline()
    return json.loads(line) if line else None


def _exit_like(code: int) -> None:
    if code < 0:   # the worker died of a signal: die of the same one
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


def main(argv: list[str]) -> None:
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        sys.exit("usage: python -m elastic.launch.shim (-m MODULE | SCRIPT) [ARGS...]")
    split = 2 if argv[0] == "-m" else 1
    target, args = argv[:split], argv[split:]
    host = os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()
    # Held from before the worker exists until they can be forwarded to it: a signal in
    # between would kill the shim, and the agent would SIGKILL the worker unwarned.
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    conn = _connect(host) or _own_agent(host)
    request = {"target": target, "args": args, "cwd": os.getcwd(), "env": dict(os.environ)}
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
    stream = conn.makefile("r")
    started = _read_message(stream)
    if started is None:
        sys.exit("regatta shim: the agent closed the connection before starting the worker")
    worker = {"pid": started["pid"]}

    def forward(signum, _frame):
        try:
            os.kill(worker["pid"], signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)    # one held meanwhile arrives now
    while True:   # a worker replaced in place (elastic/failures/restart.py) is announced by its pid
        message = _read_message(stream)
        if message is None:   # the agent died: take the worker down rather than orphan it
            forward(signal.SIGKILL, None)
            sys.exit("regatta shim: lost the agent while the worker ran")
        if "exit" in message:
            _exit_like(message["exit"])
        worker["pid"] = message["pid"]


if __name__ == "__main__":
    main(sys.argv[1:])
