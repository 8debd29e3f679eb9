"""A SIGKILLed worker's lifelines, shut by its agent the moment the signal is sent.

A SIGKILLed process is certain to die, but its peers learn of it only when its kernel
closes its sockets, and the kernel does that after tearing down the process's memory:
measured here at about 95 ms per GB of resident memory on an idle machine (6 GB: 0.53 s),
0.2-1 s for a training process in a chaos run on two busy cores (its last thread waiting
for an address-space lock it shares with the processes forked from the same warm agent,
or not scheduled), seconds for a process holding tens of GB. Until then every peer waits
in its collective. No one can take a descriptor from a process once it is exiting
(``pidfd_getfd`` refuses it), so the worker hands its agent duplicates of its lifeline
sockets each time it builds them (:func:`elastic.failures.restart.hand_lifelines_to_agent`); the
agent, which looks at its workers every 10 ms, sees a SIGKILL sent to one in
/proc/PID/status and shuts them down (``shutdown`` ends the connection itself, whoever
else holds it): the peers read EOF at once and learn of the death as from the kernel.

The agent closes its duplicates when it replaces them and when the worker ends, however
it ends, so a death other than a SIGKILL is seen when the agent reaps the worker (at most
10 ms after the kernel would have shown it).
"""
from __future__ import annotations

import signal
import socket

MAX_FDS = 253          # SCM_MAX_FD: the most descriptors one message can carry


def sigkilled(pid: int) -> bool:
    """Whether someone sent ``pid`` a SIGKILL: its death is certain.

    Read from the signals pending for the whole process (``ShdPnd``), where kill(2) puts
    it and where it stays until the process is reaped. Not from a thread's own pending
    set: the kernel sets SIGKILL there also in every other thread of a process that
    exits normally from one of its threads (``os._exit`` in a watcher thread, as a
    restart in place does), and that process must not count as killed."""
    try:
        with open(f"/proc/{pid}/status") as status:
            shared = next(line for line in status if line.startswith("ShdPnd:"))
    except (OSError, StopIteration):
        return False
    return bool(int(shared.split()[1], 16) >> (signal.SIGKILL - 1) & 1)


class HeldLifelines:
    """The agent's side, one per worker: a channel the worker sends its lifelines over
    (``worker_end`` goes to the forked worker), and the duplicates it last sent."""

    def __init__(self) -> None:
        self.channel, self.worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.held: list[socket.socket] = []

    def take(self) -> None:
        """The worker sent its new lifelines (the channel is readable): hold them instead."""
        try:
            _, fds, _, _ = socket.recv_fds(self.channel, 16, MAX_FDS)
        except OSError:
            fds = []
        self._release()
        self.held = [socket.socket(fileno=fd) for fd in fds]

    def shut(self) -> int:
        """Shut every held lifeline down (the worker is dying); how many were still up."""
        count = 0
        for sock in self.held:
            try:
                sock.shutdown(socket.SHUT_RDWR)
                count += 1
            except OSError:
                pass
        self._release()
        return count

    def close(self) -> None:
        self._release()
        self.channel.close()
        self.worker_end.close()

    def _release(self) -> None:
        for sock in self.held:
            sock.close()
        self.held = []


def send_lifelines(channel_fd: int, sockets: list[socket.socket]) -> None:
    """The worker's side: hand the agent these sockets in place of the ones before."""
    channel = socket.socket(fileno=channel_fd)
    try:   # never blocks: a message the agent has not read yet is only an optimisation lost
        fds = [s.fileno() for s in sockets][:MAX_FDS]
        if fds:
            socket.send_fds(channel, [b"L"], fds, socket.MSG_DONTWAIT)
        else:       # none to hold now: the agent lets the last ones go
            channel.send(b"L", socket.MSG_DONTWAIT)
    except OSError:
        pass
    finally:
        channel.detach()     # the descriptor stays the worker's for the next world
