"""Lifelines between real processes (light ones: the lifeline code only): every survivor
learns of every death, stalls are not deaths and are recorded once, and the mesh stays
sparse."""
import math
import signal
import time

import pytest

from bench.bench_lifelines import LightCluster
from elastic.failures.lifeline import neighbours, watchers


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 13, 64, 100, 512])
def test_mesh_is_symmetric_sparse_and_connected(size):
    links = {r: set(neighbours(r, size)) for r in range(size)}
    for rank, peers in links.items():
        assert rank not in peers
        assert all(rank in links[p] for p in peers)            # one connection per pair
        assert len(peers) <= 2 * max(1, math.ceil(math.log2(size)))
        assert watchers(rank, size)[:1] == ([(rank - 1) % size] if size > 1 else [])
        assert set(watchers(rank, size)) == peers              # whoever watches, reports
    reached, frontier = {0}, [0]
    while frontier:                                            # a death spreads to all
        frontier = [p for r in frontier for p in links[r] if p not in reached]
        reached |= set(frontier)
    assert reached == set(range(size))


@pytest.fixture(scope="module")
def cluster():
    """16 light ranks, shared by the tests below (each leaves the others running)."""
    # 2 s: a watcher starved of the cores for longer than this lets the next watcher
    # record the stall too (16 processes on two busy cores)
    cluster = LightCluster(16, stall_after=2.0)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def test_every_survivor_learns_of_a_kill_from_outside(cluster):
    killed_at = cluster.kill(0)
    seconds = cluster.detections(0, killed_at, survivors=set(range(1, 16)))
    assert len(seconds) == 15 and max(seconds) < 3.0
    told = {int(f[1]): f[3] for f in cluster.find("D", f2=0)}
    saw_it = {r for r, how in told.items() if how == "eof"}
    assert saw_it and saw_it <= set(neighbours(0, 16))       # only neighbours read the EOF
    assert {how for r, how in told.items() if r not in neighbours(0, 16)} == {"told"}


def test_two_deaths_at_once_reach_everyone(cluster):
    first, second = cluster.kill(5), cluster.kill(9)
    survivors = set(range(16)) - {0, 5, 9}
    for victim, killed_at in ((5, first), (9, second)):
        seconds = cluster.detections(victim, killed_at, survivors)
        told = {int(f[1]) for f in cluster.find("D", f2=victim)}
        # the other victim may have heard before it died
        assert survivors <= told <= survivors | {5, 9}
        assert len(seconds) == 13 and max(seconds) < 3.0


def test_stopped_ranks_are_stalls_recorded_once_not_deaths(cluster):
    """SIGSTOP two neighbours at once: their kernels still answer, so no death; each
    stall is recorded by exactly one rank, and its end by the same one."""
    stopped = [3, 4]    # 4's first watcher is 3, itself stopped: the next one records it

    def recorded(kind: str, until: float = float("inf")) -> list[tuple[int, int]]:
        """(target, recorder) of this test's records of the stopped ranks: a rank starved
        of the cores for a second, earlier in the module or after SIGCONT, is recorded too."""
        return [(int(f[3]), int(f[1])) for f in cluster.find("S", since=since, until=until, f2=kind)
                if int(f[3]) in stopped]

    since = time.time()
    for rank in stopped:
        cluster.kill(rank, signal.SIGSTOP)
    try:
        assert cluster.wait_for(lambda: {t for t, _ in recorded("stall")} == {3, 4}, timeout=10)
        time.sleep(1.5)    # room for a duplicate, if there were one
    finally:
        cluster.poll()
        resumed = time.time()
        for rank in stopped:
            cluster.kill(rank, signal.SIGCONT)
    assert cluster.wait_for(lambda: {t for t, _ in recorded("stall_cleared")} == {3, 4},
                            timeout=10)
    time.sleep(1.0)
    assert sorted(recorded("stall", until=resumed)) == [(3, 2), (4, 2)]   # once each, by rank 2
    # cleared by the same rank, never more often than stalled (a resumed rank starved
    # again is a stall of its own)
    cleared = recorded("stall_cleared")
    assert set(cleared) == {(3, 2), (4, 2)} and len(cleared) <= len(recorded("stall"))
    assert not [f for f in cluster.find("D") if int(f[2]) in stopped]


def test_file_descriptors_stay_logarithmic(cluster):
    assert max(cluster.peers) == len(neighbours(0, 16)) == 7
    assert max(cluster.fd_counts()) <= 7 + 7   # lifelines; stdio, report pipe, epoll, wake pipe


def test_a_death_while_the_lifelines_are_built_fails_the_build_at_once():
    """Rank 1 of 3 is dead right after the address exchange (nothing listens on its port):
    rank 0, dialling it, is refused; rank 2, waiting for its call, gives up as soon as
    ``given_up`` says a member died (the agent's mark), not after the 30 s connect timeout.
    Both raise BuildFailed and leave no descriptor open."""
    import os
    import socket
    import threading

    from elastic.failures.lifeline import BuildFailed, Lifeline
    from elastic.failures.liveness import Heartbeat

    addresses, exchanged = [None] * 3, threading.Barrier(3, timeout=10)
    marked, outcome = threading.Event(), {}

    def allgather_as(rank):
        def allgather(mine, _name):
            addresses[rank] = mine
            exchanged.wait()
            return list(addresses)
        return allgather

    def live(rank):
        started = time.monotonic()
        try:
            Lifeline(rank, 3, f"h{rank}", "127.0.0.1", allgather_as(rank), Heartbeat(),
                     lambda *_: None, given_up=marked.is_set)
            outcome[rank] = ("built", time.monotonic() - started)
        except BuildFailed as err:
            outcome[rank] = (str(err), time.monotonic() - started)

    def open_fds() -> set[tuple[str, str]]:
        """(fd, what it is): comparing sets, not counts, so that a socket of an earlier
        test collected meanwhile cannot hide a leak."""
        found = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                found.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
            except FileNotFoundError:       # the listing's own descriptor, now closed
                pass
        return found

    fds_before = open_fds()
    threads = [threading.Thread(target=live, args=(r,)) for r in (0, 2)]
    for thread in threads:
        thread.start()
    # Rank 1 is dead by the time anyone dials: its port is bound (so nobody else takes it)
    # but not listening, so the kernel refuses. A listening socket closed after the
    # exchange would race rank 0's dial, which a backlog can accept.
    doomed = socket.socket()
    doomed.bind(("127.0.0.1", 0))
    allgather_as(1)(("127.0.0.1", doomed.getsockname()[1], "h1"), "x")
    time.sleep(0.5)
    died_at = time.monotonic()
    marked.set()                         # ...and its agent marks the rendezvous
    for thread in threads:
        thread.join(timeout=10)
    assert "cannot reach rank 1" in outcome[0][0] and outcome[0][1] < 5
    assert "died while the lifelines were being built" in outcome[2][0]
    assert time.monotonic() - died_at < 2.0 and 0.4 < outcome[2][1] < 5
    doomed.close()
    assert open_fds() <= fds_before
