"""Lifelines: a sparse mesh of idle TCP connections over which ranks learn of deaths.

Every rank keeps a lifeline to the ranks ``rank +- 2**k`` (a ring with skip links): about
``2 log2 n`` connections each, 18 at 512 ranks, read with one epoll selector. When a
process dies, SIGKILL included, its kernel closes its sockets, so its neighbours read EOF
at once and flood the news over the mesh; every rank knows within a few hops, each hop a
wake-up of one thread. A death is learned positively, never guessed from silence.

A host that vanishes (powered off, cable pulled) closes nothing. The heartbeats every
lifeline already carries then go unacknowledged, and ``TCP_USER_TIMEOUT`` turns that into
an error after :data:`USER_TIMEOUT_S`. A stopped process (SIGSTOP, a debugger) is still
answered by its kernel, so it is never declared dead, only a stall (liveness.py).

This module knows nothing of Horovod: the owner passes an ``allgather`` to exchange
addresses and callbacks to act on deaths and stalls (see recovery.py).
"""
from __future__ import annotations

import os
import selectors
import socket
import struct
import threading
import time

from .liveness import Heartbeat, StallWatch, first_healthy

MESSAGE = struct.Struct("!cBxxiI")   # kind, flag (waiting; recorded), subject rank, step
PROGRESS, BYE, DEAD, STALL, CLEAR = b"P", b"B", b"D", b"S", b"C"
HEARTBEAT_S = 0.25
USER_TIMEOUT_S = 1.5   # heartbeats unacknowledged this long: the peer is gone (a stopped
                       # process's kernel would have acknowledged them)
CONNECT_TIMEOUT_S = 30.0
GIVE_UP_POLL_S = 0.05   # how often a rank waiting for a peer's lifeline asks whether to stop
TCP_USER_TIMEOUT = getattr(socket, "TCP_USER_TIMEOUT", 18)


class BuildFailed(ConnectionError):
    """A peer died, or never came, while the lifelines were being built: the world they
    were for is gone too (the owner turns this into its framework's recoverable error)."""


def neighbours(rank: int, size: int) -> list[int]:
    """The ranks ``rank`` holds a lifeline to: ``rank +- 2**k`` around the ring."""
    steps = [1 << k for k in range(max(size - 1, 1).bit_length()) if (1 << k) < size]
    return sorted({(rank + s) % size for s in steps} | {(rank - s) % size for s in steps} - {rank})


def watchers(rank: int, size: int) -> list[int]:
    """The ranks that see ``rank``'s heartbeats, in the order they take turns to report its
    stalls: nearest predecessor first (rank-1, rank-2, rank-4, ...), then successors."""
    steps = [1 << k for k in range(max(size - 1, 1).bit_length()) if (1 << k) < size]
    order = [(rank - s) % size for s in steps] + [(rank + s) % size for s in steps]
    return list(dict.fromkeys(r for r in order if r != rank))


def tune(sock: socket.socket, user_timeout_s: float) -> None:
    """Keepalive for idle spells, and a bound on unacknowledged data for vanished hosts."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 1), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 2)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    sock.setsockopt(socket.IPPROTO_TCP, TCP_USER_TIMEOUT, int(user_timeout_s * 1000))


class Lifeline:
    """One generation's lifelines and the watchdog thread that reads them.

    ``on_death(rank, host, how, when)`` is called once per dead rank (how: ``eof``,
    ``timeout`` or ``told`` when a neighbour spread the news); ``on_stall(kind, rank,
    host, **detail)`` once per stall and its end, by exactly one rank. Building raises
    :class:`BuildFailed` when a peer cannot be reached, or when ``given_up()`` (asked while
    waiting for a peer to dial) says a member of this world is known dead.
    """

    def __init__(self, rank: int, size: int, host: str, address: str, allgather,
                 heartbeat: Heartbeat, on_death, on_stall=None, stall_after: float = 5.0,
                 user_timeout_s: float = USER_TIMEOUT_S, given_up=lambda: False) -> None:
        self.rank, self.size, self.heartbeat = rank, size, heartbeat
        self.on_death, self.on_stall = on_death, on_stall
        self.watch = StallWatch(stall_after)
        self.peers: dict[socket.socket, int] = {}
        self.dead: set[int] = set()
        self.departed: set[int] = set()
        self.stalled_anywhere: set[int] = set()   # stalls any rank saw, spread like deaths
        self.recorded: set[int] = set()           # stalls some rank has recorded
        self._reported: set[int] = set()
        self._buffers: dict[socket.socket, bytes] = {}
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()   # sends come from the watchdog and from close()
        self._closing = threading.Lock()   # close() comes from the owner and from a restart in place
        listener = socket.create_server((address, 0), backlog=max(size, 16))
        everyone = allgather((address, listener.getsockname()[1], host), "regatta.lifeline")
        self.hosts = [entry[2] for entry in everyone]
        try:
            self._connect(listener, everyone, given_up)
        except BaseException:
            for sock in [listener, *self.peers]:
                sock.close()
            self._selector.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
            raise
        self._listen(user_timeout_s)
        self._thread = threading.Thread(target=self._watch, name="regatta-lifeline", daemon=True)
        self._thread.start()

    def _connect(self, listener: socket.socket, everyone: list, given_up) -> None:
        """The lower rank of each pair dials, the higher accepts; a 4-byte hello says who."""
        mine = neighbours(self.rank, self.size)
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        for peer in (p for p in mine if p > self.rank):
            address, port, _ = everyone[peer]
            try:
                sock = socket.create_connection((address, port), timeout=CONNECT_TIMEOUT_S)
                self.peers[sock] = peer
                sock.sendall(self.rank.to_bytes(4, "big"))
            except OSError as err:
                raise BuildFailed(f"rank {self.rank} cannot reach rank {peer}'s lifeline at "
                                  f"{address}:{port}: {err}") from None
        for _ in (p for p in mine if p < self.rank):
            sock = self._accept(listener, deadline, given_up)
            self.peers[sock] = -1
            try:
                sock.settimeout(max(0.1, deadline - time.monotonic()))
                hello = sock.recv(4, socket.MSG_WAITALL)
            except OSError as err:
                raise BuildFailed(f"rank {self.rank}: a peer's lifeline hello failed: {err}") from None
            if len(hello) != 4:
                raise BuildFailed(f"rank {self.rank}: a peer closed its lifeline before saying who")
            self.peers[sock] = int.from_bytes(hello, "big")
        listener.close()

    def _accept(self, listener: socket.socket, deadline: float, given_up) -> socket.socket:
        """The next peer's connection. Waiting for one that died after the address exchange
        would last the whole timeout: between short waits, ask whether to give up."""
        while True:
            listener.settimeout(max(0.01, min(GIVE_UP_POLL_S, deadline - time.monotonic())))
            try:
                return listener.accept()[0]
            except TimeoutError:
                pass
            if given_up():
                raise BuildFailed(f"rank {self.rank}: a member of this world died while "
                                  "the lifelines were being built")
            if time.monotonic() >= deadline:
                raise BuildFailed(f"rank {self.rank}: peers did not dial its lifeline "
                                  f"within {CONNECT_TIMEOUT_S:.0f} s")

    def _listen(self, user_timeout_s: float) -> None:
        now = time.time()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        for sock, peer in self.peers.items():
            tune(sock, user_timeout_s)
            sock.setblocking(False)
            self._selector.register(sock, selectors.EVENT_READ)
            self.watch.heard(peer, 0, False, now)

    # -- the watchdog thread -------------------------------------------------------------
    def _watch(self) -> None:
        next_beat = last_turn = time.time()
        while not self._stop.is_set():
            self._drain(HEARTBEAT_S / 2)
            if self._stop.is_set():
                return
            now = time.time()
            if now - last_turn > self.watch.stall_after / 2:
                # This thread itself was stopped or starved: silence it saw is its own.
                self._drain(0)
                self.watch.forgive(now)
            last_turn = now
            if now >= next_beat:
                beat = self.heartbeat
                self._send_all(MESSAGE.pack(PROGRESS, beat.waiting, self.rank, beat.step))
                next_beat = now + HEARTBEAT_S
                self._check_stalls(now)

    def _drain(self, timeout: float) -> None:
        for key, _ in self._selector.select(timeout=timeout):
            if key.fileobj is not self._wake_r:
                self._read(key.fileobj)

    def _read(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(4096)
            how = "eof"
        except BlockingIOError:
            return
        except TimeoutError:      # ETIMEDOUT: TCP_USER_TIMEOUT or keepalive gave up
            data, how = b"", "timeout"
        except OSError:
            data, how = b"", "eof"
        if not data:
            return self._lost(sock, how)
        buffer = self._buffers.get(sock, b"") + data
        usable = len(buffer) - len(buffer) % MESSAGE.size
        self._buffers[sock] = buffer[usable:]
        for offset in range(0, usable, MESSAGE.size):
            kind, waiting, subject, step = MESSAGE.unpack_from(buffer, offset)
            if not self._handle(sock, kind, waiting, subject, step):
                return

    def _handle(self, sock, kind: bytes, waiting: int, subject: int, step: int) -> bool:
        """Act on one message; False once ``sock`` is gone."""
        if kind == PROGRESS:
            self.watch.heard(self.peers[sock], step, bool(waiting), time.time())
        elif kind == BYE:
            self.departed.add(self.peers[sock])
            self._drop(sock)
            return False
        elif kind == DEAD:
            self._declare_dead(subject, "told", via=sock)
        elif kind == STALL and (subject not in self.stalled_anywhere
                                or (waiting and subject not in self.recorded)):
            self.stalled_anywhere.add(subject)
            if waiting:
                self.recorded.add(subject)
            self._send_all(MESSAGE.pack(STALL, waiting, subject, 0), skip=sock)
        elif kind == CLEAR and subject in self.stalled_anywhere | self.recorded:
            self.stalled_anywhere.discard(subject)
            self.recorded.discard(subject)
            self._send_all(MESSAGE.pack(CLEAR, 0, subject, 0), skip=sock)
        return True

    def _lost(self, sock: socket.socket, how: str) -> None:
        rank = self.peers.get(sock)
        self._drop(sock)
        if rank is not None and rank not in self.departed:
            self._declare_dead(rank, how)

    def _drop(self, sock: socket.socket) -> None:
        rank = self.peers.pop(sock, None)
        self._buffers.pop(sock, None)
        self.watch.peers.pop(rank, None)
        self.watch.stalled.pop(rank, None)
        try:
            self._selector.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()

    def _declare_dead(self, rank: int, how: str, via: socket.socket | None = None) -> None:
        if rank in self.dead or rank == self.rank:
            return
        self.dead.add(rank)
        self._send_all(MESSAGE.pack(DEAD, 0, rank, 0), skip=via)
        self._call(self.on_death, rank, self.hosts[rank], how, time.time())

    @staticmethod
    def _call(callback, *args, **kwargs) -> None:
        """The owner's callback; a bug there must not stop failure detection."""
        try:
            callback(*args, **kwargs)
        except Exception:   # noqa: BLE001
            import traceback
            traceback.print_exc()

    def _send_all(self, message: bytes, skip: socket.socket | None = None) -> None:
        broken = []
        with self._lock:
            for sock in list(self.peers):
                if sock is skip:
                    continue
                try:
                    sock.send(message)
                except (BlockingIOError, InterruptedError):
                    pass   # a peer this far behind is stopped; a heartbeat less is harmless
                except TimeoutError:   # the kernel gave up on this peer: it vanished
                    broken.append(sock)
                except OSError:
                    pass   # a closed lifeline shows up as EOF on the read side
        for sock in broken:
            if sock in self.peers and not self._stop.is_set():
                self._lost(sock, "timeout")

    def _check_stalls(self, now: float) -> None:
        """Spread what this rank sees, then record the stalls that are this rank's to
        record (re-checked every beat: the watcher before it may have stalled since)."""
        new, cleared = self.watch.check(self.heartbeat, now)
        for rank, _, _ in new:
            self.stalled_anywhere.add(rank)
            self._send_all(MESSAGE.pack(STALL, 0, rank, 0))
        for rank in cleared:
            self.stalled_anywhere.discard(rank)
            self.recorded.discard(rank)
            self._send_all(MESSAGE.pack(CLEAR, 0, rank, 0))
            if rank in self._reported:   # whoever recorded a stall records its end
                self._reported.discard(rank)
                self._call(self.on_stall, "stall_cleared", rank, self.hosts[rank])
        if self.on_stall is None:
            return
        for rank, reason in list(self.watch.stalled.items()):
            if rank in self.recorded or not self._reports(rank):
                continue
            self.recorded.add(rank)
            self._reported.add(rank)
            self._send_all(MESSAGE.pack(STALL, 1, rank, 0))
            peer = self.watch.peers[rank]
            self._call(self.on_stall, "stall", rank, self.hosts[rank], reason=reason,
                       silent_s=now - min(peer.heard_at, peer.changed_at))

    def _reports(self, rank: int) -> bool:
        unable = self.stalled_anywhere | self.dead | self.departed
        return first_healthy(watchers(rank, self.size), unable) == self.rank

    # -- the owner's side ----------------------------------------------------------------
    def close(self, goodbye: bool = False) -> None:
        """Stop watching; ``goodbye`` tells the neighbours this rank leaves on purpose.
        Once: a second call must not touch fds that were this one's."""
        with self._closing:
            if self._stop.is_set():
                return
            self._stop.set()
        os.write(self._wake_w, b"x")
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=2)
        if goodbye:
            self._send_all(MESSAGE.pack(BYE, 0, self.rank, 0))
        for sock in list(self.peers):
            sock.close()
        self.peers.clear()
        self._selector.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
