"""How fast every rank learns of a death, with hundreds of ranks: lifelines only.

    .venv/bin/python bench/bench_lifelines.py [--sizes 64,256,512] [--kills 3]

Starts SIZE light processes (forked; each runs elastic.failures.lifeline's mesh and nothing else:
no torch, no Horovod; their all-gather is a small TCP server in this process), SIGKILLs
one from outside (rank 0 first, then random ranks), and prints the time from the kill
to the moment each survivor learned of it (p50, p99, max over every survivor of every
kill), with the file descriptors and lifelines each process holds.
"""
from __future__ import annotations

import argparse
import os
import pickle
import random
import signal
import socket
import statistics
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.percentiles import percentile   # noqa: E402
from elastic.launch import netns   # noqa: E402
from elastic.failures.lifeline import Lifeline   # noqa: E402
from elastic.failures.liveness import Heartbeat   # noqa: E402

LENGTH = struct.Struct("!I")


def _send(sock: socket.socket, obj) -> None:
    data = pickle.dumps(obj)
    sock.sendall(LENGTH.pack(len(data)) + data)


def _receive(sock: socket.socket):
    (size,) = LENGTH.unpack(sock.recv(LENGTH.size, socket.MSG_WAITALL))
    return pickle.loads(sock.recv(size, socket.MSG_WAITALL))


def _child(rank: int, size: int, gather: tuple, report: int, address: str, host: str,
           stall_after: float, step_every: float) -> None:
    """A light rank: lifelines, a heartbeat that advances, and a line per event."""
    def allgather(obj, name):
        with socket.create_connection(gather, timeout=60) as sock:
            _send(sock, (rank, obj))
            return _receive(sock)

    def say(line: str) -> None:
        os.write(report, (line + "\n").encode())

    heartbeat = Heartbeat()
    lifeline = Lifeline(rank, size, host, address, allgather, heartbeat,
                        on_death=lambda r, h, how, when: say(f"D {rank} {r} {how} {when:.6f}"),
                        on_stall=lambda kind, r, h, **d: say(f"S {rank} {kind} {r} {time.time():.6f}"),
                        stall_after=stall_after)
    say(f"R {rank} {os.getpid()} {len(lifeline.peers)}")
    while True:   # a training loop's rhythm: steps, each ending in a "collective"
        time.sleep(step_every)
        heartbeat.leave_collective(heartbeat.step + 1)


@dataclass
class LightCluster:
    """SIZE forked ranks with lifelines between them; always ``stop()`` it. Ranks listen
    on ``address``, or each in the network namespace and at the address ``places`` gives
    (netns.SimHost); their all-gather is served at ``address``."""
    size: int
    address: str = "127.0.0.1"
    places: list = field(default_factory=list)
    stall_after: float = 5.0
    step_every: float = 0.1
    pids: list = field(default_factory=list)
    peers: list = field(default_factory=list)
    lines: list = field(default_factory=list)   # (received at, fields)

    def start(self, timeout: float = 60.0) -> float:
        """Fork the ranks, serve their all-gather; seconds until every rank is watching."""
        started = time.time()
        server = socket.create_server((self.address, 0), backlog=self.size)
        gather = server.getsockname()
        server.set_inheritable(False)
        self._read_fd, write_fd = os.pipe()
        for rank in range(self.size):
            pid = os.fork()
            if pid == 0:
                try:
                    # Nothing inherited but stdio and the report pipe: the fds counted
                    # below are the rank's own.
                    os.closerange(3, write_fd)
                    os.closerange(write_fd + 1, os.sysconf("SC_OPEN_MAX"))
                    address = self.address
                    if self.places:
                        netns.join(self.places[rank].holder.pid)
                        address = self.places[rank].address
                    _child(rank, self.size, gather, write_fd, address,
                           f"light-{rank}", self.stall_after, self.step_every)
                except BaseException:
                    import traceback
                    traceback.print_exc()
                finally:
                    os._exit(1)
            self.pids.append(pid)
        os.close(write_fd)
        server.settimeout(timeout)
        connections = []
        for _ in range(self.size):
            conn, _ = server.accept()
            connections.append((conn, *_receive(conn)))
        everyone = [obj for _, _, obj in sorted(connections, key=lambda c: c[1])]
        for conn, _, _ in connections:
            _send(conn, everyone)
            conn.close()
        server.close()
        self._buffer = b""
        ready = self.wait_for(lambda: len(self.find("R")) == self.size, timeout)
        if not ready:
            raise RuntimeError(f"only {len(self.find('R'))} of {self.size} ranks got ready")
        self.peers = [int(f[3]) for f in sorted(self.find("R"), key=lambda f: int(f[1]))]
        return time.time() - started

    def poll(self, wait: float = 0.05) -> None:
        import select
        readable, _, _ = select.select([self._read_fd], [], [], wait)
        if readable:
            chunk = os.read(self._read_fd, 1 << 16)
            now = time.time()
            self._buffer += chunk
            *complete, self._buffer = self._buffer.split(b"\n")
            self.lines += [(now, line.decode().split()) for line in complete]

    def find(self, kind: str, since: float = 0.0, until: float = float("inf"),
             **match) -> list[list[str]]:
        """Report lines of ``kind`` read from ``since`` until before ``until`` whose field N
        equals fN."""
        return [f for at, f in self.lines if f[0] == kind and since <= at < until
                and all(f[int(k[1:])] == str(v) for k, v in match.items())]

    def wait_for(self, condition, timeout: float) -> bool:
        deadline = time.time() + timeout
        while not condition():
            if time.time() > deadline:
                return False
            self.poll()
        return True

    def kill(self, rank: int, signum: int = signal.SIGKILL) -> float:
        """Signal one rank from outside; returns the wall time just before the signal."""
        now = time.time()
        os.kill(self.pids[rank], signum)
        return now

    def detections(self, victim: int, killed_at: float, survivors: set[int],
                   timeout: float = 10.0) -> list[float]:
        """Seconds from the kill until each survivor learned of it. Waits for these ranks
        by name, not for a count: another victim's report, sent before it died, would
        make a count come true while a survivor has not heard yet."""
        def told() -> set[int]:
            return {int(f[1]) for f in self.find("D", f2=victim)}
        self.wait_for(lambda: survivors <= told(), timeout)
        return [float(f[4]) - killed_at for f in self.find("D", f2=victim)
                if int(f[1]) in survivors]

    def fd_counts(self) -> list[int]:
        counts = []
        for pid in self.pids:
            try:
                counts.append(len(os.listdir(f"/proc/{pid}/fd")))
            except (FileNotFoundError, PermissionError):
                pass
        return [count for count in counts if count]   # dead ranks (zombies) hold none

    def stop(self) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in self.pids:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        if hasattr(self, "_read_fd"):
            os.close(self._read_fd)
            del self._read_fd


def measure(size: int, kills: int, rng: random.Random) -> dict:
    cluster = LightCluster(size)
    try:
        setup = cluster.start()
        time.sleep(1.0)          # every rank past its first heartbeat
        fds = cluster.fd_counts()
        times = []
        victims = [0] + rng.sample(range(1, size), kills - 1)
        for done, victim in enumerate(victims, 1):
            killed_at = cluster.kill(victim)
            expected = set(range(size)) - set(victims[:done])
            found = cluster.detections(victim, killed_at, expected)
            if len(found) != len(expected):
                raise RuntimeError(f"size {size}: {len(found)} of {len(expected)} survivors "
                                   f"learned of rank {victim}'s death")
            times += found
            time.sleep(0.3)
        return {"size": size, "setup_s": setup, "times": times, "fds": fds,
                "lifelines": cluster.peers}
    finally:
        cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,256,512")
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"load average before: {open('/proc/loadavg').read().strip()}  ({os.cpu_count()} cores)")
    rng = random.Random(args.seed)
    print(f"{'ranks':>6} {'setup s':>8} {'detections':>10} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'max ms':>8} {'fds/proc':>9} {'lifelines/proc':>15}")
    for size in (int(s) for s in args.sizes.split(",")):
        result = measure(size, args.kills, rng)
        times, fds, links = result["times"], result["fds"], result["lifelines"]
        print(f"{size:6d} {result['setup_s']:8.2f} {len(times):10d} "
              f"{statistics.median(times) * 1e3:8.1f} {percentile(times, 0.99) * 1e3:8.1f} "
              f"{max(times) * 1e3:8.1f} {f'{statistics.mean(fds):.0f} (max {max(fds)})':>9} "
              f"{f'{statistics.mean(links):.1f} (max {max(links)})':>15}", flush=True)
    print(f"load average after: {open('/proc/loadavg').read().strip()}")


if __name__ == "__main__":
    main()
