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
import struct
import threading
import time

import psutil

from .liveness import Heartbeat, StallWatch

MESSAGE = struct.Struct("!cB2xI")   # kind, waiting flag, step: fixed size, easy framing
PROGRESS, BYE = b"P", b"B"
HEARTBEAT_S = 0.5


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

    def __init__(self, hvd, world, gloo: list, on_death, heartbeat: Heartbeat,
                 on_stall=None, stall_after: float = 5.0) -> None:
        self.world, self.gloo, self.on_death, self.on_stall = world, gloo, on_death, on_stall
        self.heartbeat, self.watch = heartbeat, StallWatch(stall_after)
        self._armed = threading.Event()
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self.peers: dict[socket.socket, int] = {}
        self.hosts: list[str] = []
        self._buffers: dict[socket.socket, bytes] = {}
        self._reported: set[int] = set()
        self.address = host_address(world.host)
        self._connect(hvd)
        self._armed.set()
        self._thread = threading.Thread(target=self._watch, name="regatta-lifeline", daemon=True)
        self._thread.start()

    def _connect(self, hvd) -> None:
        listener = socket.create_server((self.address, 0), backlog=self.world.size)
        mine = (self.address, listener.getsockname()[1], self.world.host)
        everyone = hvd.allgather_object(mine, name="regatta.lifeline")
        self.hosts = [host for _, _, host in everyone]
        for rank, (address, port, _) in enumerate(everyone):   # lower rank dials higher
            if rank > self.world.rank:
                sock = socket.create_connection((address, port), timeout=30)
                sock.sendall(self.world.rank.to_bytes(4, "big"))
                self.peers[sock] = rank
        listener.settimeout(30)
        for _ in range(self.world.rank):
            sock, _ = listener.accept()
            self.peers[sock] = int.from_bytes(sock.recv(4, socket.MSG_WAITALL), "big")
        listener.close()
        now = time.time()
        for sock, rank in self.peers.items():
            sock.settimeout(None)
            _keepalive(sock)
            self.watch.heard(rank, 0, False, now)

    def _watch(self) -> None:
        next_beat = 0.0
        while not self._stop.is_set() and self.peers:
            readable, _, _ = select.select([self._wake_r, *self.peers], [], [], HEARTBEAT_S / 2)
            if self._stop.is_set():
                return
            for sock in readable:
                if sock != self._wake_r:
                    self._read(sock)
            now = time.time()
            if now >= next_beat:
                self._send(PROGRESS)
                next_beat = now + HEARTBEAT_S
                self._check_stalls(now)

    def _read(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(4096)
        except OSError:
            data = b""
        if not data:
            return self._lost(sock, goodbye=False)
        buffer = self._buffers.get(sock, b"") + data
        while len(buffer) >= MESSAGE.size:
            kind, waiting, step = MESSAGE.unpack(buffer[:MESSAGE.size])
            buffer = buffer[MESSAGE.size:]
            if kind == BYE:
                return self._lost(sock, goodbye=True)
            self.watch.heard(self.peers[sock], step, bool(waiting), time.time())
        self._buffers[sock] = buffer

    def _lost(self, sock: socket.socket, goodbye: bool) -> None:
        rank = self.peers.pop(sock)
        self._buffers.pop(sock, None)
        self.watch.peers.pop(rank, None)
        sock.close()
        if not goodbye and self._armed.is_set():
            self._armed.clear()
            severed = sever(self.gloo)
            self.on_death(rank, self.hosts[rank], severed, time.time())

    def _send(self, kind: bytes) -> None:
        beat = self.heartbeat
        message = MESSAGE.pack(kind, beat.waiting, beat.step)
        for sock in list(self.peers):
            try:
                sock.sendall(message)
            except OSError:
                pass   # a dead peer shows up as EOF on the read side

    def _check_stalls(self, now: float) -> None:
        new, cleared = self.watch.check(self.heartbeat, now)
        if self.on_stall is None or not self._armed.is_set():
            return
        if self.watch.i_report(self.world.rank):
            for rank, reason, seconds in new:
                self._reported.add(rank)
                self.on_stall("stall", rank, self.hosts[rank], reason=reason, silent_s=seconds)
        for rank in set(cleared) & self._reported:   # whoever reported a stall clears it
            self._reported.discard(rank)
            self.on_stall("stall_cleared", rank, self.hosts[rank])

    def disarm(self) -> None:
        """Membership is changing on purpose: a closing lifeline means nothing now."""
        self._armed.clear()

    def close(self, goodbye: bool = False) -> None:
        self._armed.clear()
        self._stop.set()
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=1)
        if goodbye:
            self._send(BYE)
        for sock in list(self.peers):
            sock.close()
        os.close(self._wake_r)
        os.close(self._wake_w)


class FastRecovery:
    """Glue for the training loop: which sockets are Gloo's, and the current lifeline."""

    def __init__(self, events, heartbeat: Heartbeat, stall_after: float = 5.0) -> None:
        self.events, self.heartbeat, self.stall_after = events, heartbeat, stall_after
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
        self.lifeline = Lifeline(hvd, world, gloo, self._on_death, self.heartbeat,
                                 self._on_stall, self.stall_after)
        self.events.record("lifeline", None, peers=len(self.lifeline.peers), gloo_sockets=len(gloo))

    def _on_death(self, rank: int, host: str, severed: int, when: float) -> None:
        self.events.record("peer_lost", self.heartbeat.step, peer_rank=rank, target=host,
                           severed=severed)

    def _on_stall(self, kind: str, rank: int, host: str, **detail) -> None:
        self.events.record(kind, self.heartbeat.step, stalled_rank=rank, target=host, **detail)

    def close(self) -> None:
        if self.lifeline is not None:
            self.lifeline.close(goodbye=True)
            self.lifeline = None
