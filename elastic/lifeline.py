"""Fast failure detection: survivors leave a blocked collective within a second of a peer's
death instead of waiting out Gloo's receive timeout (30 s by default).

Every rank keeps one idle TCP connection to every other rank, its *lifeline*. When a
process dies, SIGKILL included, its kernel closes its sockets, so the peers read EOF or a
reset on the lifeline at once: a death is learned positively, never guessed from silence.
A stalled process (SIGSTOP, a hung data loader) keeps its sockets open, so it is never
declared dead; TCP keepalive, answered by the kernel even for a stopped process, still
catches a machine that vanished without closing anything.

On a death the watchdog shuts down this rank's Gloo peer connections (a shutdown on a
dup of each fd), which makes Horovod raise ``HorovodInternalError`` in the blocked
collective; ``hvd.elastic.run`` then restores the last commit and resets. Only the
connections Horovod's Gloo opened during the last ``hvd.init`` are touched (see
:class:`ConnectionBaseline`), never the driver's, the metrics sink's or a
torch.distributed group's. A rank leaving on purpose says goodbye first.
"""
from __future__ import annotations

import os
import select
import socket
import threading
import time

import psutil

BYE = b"B"


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


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


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


def host_address(host: str) -> str:
    """The address peers reach this host at: the launcher's host name when it is one of
    this machine's addresses (simulated hosts), else the Gloo interface's IPv4."""
    local = {a.address: nic for nic, addrs in psutil.net_if_addrs().items() for a in addrs
             if a.family == socket.AF_INET}
    try:
        resolved = socket.gethostbyname(host)
    except OSError:
        resolved = ""
    if resolved in local:
        return resolved
    iface = os.environ.get("HOROVOD_GLOO_IFACE", "")
    return next((a for a, nic in local.items() if nic == iface), resolved or "127.0.0.1")


class Lifeline:
    """One generation's mesh of lifelines and the watchdog thread that reads them."""

    def __init__(self, hvd, world, gloo: list, on_death) -> None:
        self.world, self.gloo, self.on_death = world, gloo, on_death
        self._armed = threading.Event()
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self.peers: dict[socket.socket, int] = {}
        self.address = host_address(world.host)
        self._connect(hvd)
        self._armed.set()
        self._thread = threading.Thread(target=self._watch, name="regatta-lifeline", daemon=True)
        self._thread.start()

    def _connect(self, hvd) -> None:
        listener = socket.create_server((self.address, 0), backlog=self.world.size)
        address = (self.address, listener.getsockname()[1])
        addresses = hvd.allgather_object(address, name="regatta.lifeline")
        for rank, peer in enumerate(addresses):   # lower rank dials the higher one
            if rank > self.world.rank:
                sock = socket.create_connection(peer, timeout=30)
                sock.sendall(self.world.rank.to_bytes(4, "big"))
                self.peers[sock] = rank
        listener.settimeout(30)
        for _ in range(self.world.rank):
            sock, _ = listener.accept()
            self.peers[sock] = int.from_bytes(sock.recv(4, socket.MSG_WAITALL), "big")
        listener.close()
        for sock in self.peers:
            sock.settimeout(None)
            _keepalive(sock)

    def _watch(self) -> None:
        while not self._stop.is_set() and self.peers:
            readable, _, _ = select.select([self._wake_r, *self.peers], [], [])
            for sock in readable:
                if sock == self._wake_r or self._stop.is_set():
                    return
                try:
                    data = sock.recv(1)
                except OSError:
                    data = b""
                rank = self.peers.pop(sock)
                sock.close()
                if data != BYE and self._armed.is_set():
                    self._armed.clear()
                    severed = sever(self.gloo)
                    self.on_death(rank, severed, time.time())

    def disarm(self) -> None:
        """Membership is changing on purpose: a closing lifeline means nothing now."""
        self._armed.clear()

    def close(self, goodbye: bool = False) -> None:
        self._armed.clear()
        self._stop.set()
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=1)
        for sock in list(self.peers):
            try:
                if goodbye:
                    sock.sendall(BYE)
                sock.close()
            except OSError:
                pass
        os.close(self._wake_r)
        os.close(self._wake_w)


class FastRecovery:
    """Glue for the training loop: which sockets are Gloo's, and the current lifeline."""

    def __init__(self, events) -> None:
        self.events = events
        self.baseline = ConnectionBaseline()
        self.lifeline: Lifeline | None = None

    def before_init(self) -> None:
        """Call before anything (re)initialises Horovod: a restore, a planned reset."""
        if self.lifeline is not None:
            self.lifeline.disarm()
        self.baseline.mark()

    def enter(self, hvd, world) -> None:
        """Call on (re)entering the training loop, after ``hvd.init`` and sync."""
        if self.lifeline is not None:
            self.lifeline.close()
        gloo = self.baseline.gloo_connections(exclude_fds=set())
        self.lifeline = Lifeline(hvd, world, gloo, self._on_death)
        self.events.record("lifeline", None, peers=len(self.lifeline.peers), gloo_sockets=len(gloo))

    def _on_death(self, rank: int, severed: int, when: float) -> None:
        self.events.record("peer_lost", None, peer_rank=rank, severed=severed)

    def close(self) -> None:
        if self.lifeline is not None:
            self.lifeline.close(goodbye=True)
            self.lifeline = None
