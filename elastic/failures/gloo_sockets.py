"""Which TCP sockets Gloo opened for this world, and shutting them down: how a survivor
leaves a collective blocked on a dead peer (recovery.py). A socket counts as Gloo's when it
was established since the last ``hvd.init`` began, and is not horovodrun's rendezvous
server: Horovod's, and a torch.distributed group's opened for the world before the
training loop is entered (recovery.py takes stock then). The driver's, the metrics
sink's and the lifelines' are never touched.
"""
from __future__ import annotations

import os
import socket

import psutil


def established() -> set[tuple[int, tuple, tuple]]:
    """(fd, local address, remote address) of this process's established TCP sockets."""
    return {(c.fd, tuple(c.laddr), tuple(c.raddr))
            for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_ESTABLISHED and c.fd >= 0 and c.raddr}


class ConnectionBaseline:
    """Remembers the sockets open before ``hvd.init`` so the new ones can be told apart."""

    def __init__(self) -> None:
        self.before: set = set()

    def mark(self) -> None:
        self.before = established()

    def gloo_connections(self, exclude_fds: set[int]) -> list[tuple[int, tuple, tuple]]:
        rendezvous = int(os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT", "0") or 0)
        return [c for c in established() - self.before
                if c[0] not in exclude_fds and c[2][1] != rendezvous]


def sever(connections: list[tuple[int, tuple, tuple]]) -> int:
    """Shut down each connection if its fd still names the same connection."""
    count = 0
    for fd, local, remote in connections:
        try:
            dup = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if dup.getsockname()[:2] == local[:2] and dup.getpeername()[:2] == remote[:2]:
                dup.shutdown(socket.SHUT_RDWR)
                count += 1
        except OSError:
            pass
        finally:
            dup.close()
    return count
