"""Stall detection logic: silent or stuck ranks are stalls, ranks waiting behind them or
merely slow are not."""
from elastic.failures.liveness import Heartbeat, StallWatch, first_healthy


def watch_at(now, peers):
    watch = StallWatch(stall_after=5.0)
    for rank, (step, waiting, heard, changed) in peers.items():
        watch.heard(rank, step, waiting, changed)
        watch.peers[rank].heard_at = heard
    return watch


def test_silent_peer_is_a_stall_and_clears_when_heard_again():
    watch = watch_at(0, {1: (10, False, 0.0, 0.0), 2: (10, True, 6.0, 6.0)})
    me = Heartbeat(step=10, waiting=True, waiting_since=0.0)
    new, cleared = watch.check(me, now=6.0)
    assert [(r, reason) for r, reason, _ in new] == [(1, "silent")] and cleared == []
    assert watch.check(me, now=6.5) == ([], [])          # reported once
    watch.heard(1, 11, True, 7.0)
    assert watch.check(me, now=7.0) == ([], [1])


def test_hung_peer_that_still_talks_is_a_stall_but_waiting_peers_are_not():
    watch = watch_at(0, {1: (10, False, 6.0, 0.0), 2: (11, True, 6.0, 0.5)})
    me = Heartbeat(step=11, waiting=True, waiting_since=0.5)
    new, _ = watch.check(me, now=6.0)
    assert [(r, reason) for r, reason, _ in new] == [(1, "no progress")]


def test_long_computation_everywhere_is_not_a_stall():
    watch = watch_at(0, {1: (10, False, 9.0, 0.0)})
    me = Heartbeat(step=10, waiting=False)
    assert watch.check(me, now=9.0) == ([], [])


def test_first_healthy_watcher_reports():
    watch = watch_at(0, {0: (3, False, 0.0, 0.0), 2: (3, True, 9.0, 9.0)})
    watch.check(Heartbeat(step=3, waiting=True, waiting_since=0.0), now=9.0)
    assert watch.stalled == {0: "silent"}
    assert first_healthy([0, 2, 1], set(watch.stalled)) == 2   # rank 0 stalled: the next speaks
    assert first_healthy([0], {0}) is None


def test_a_rank_that_was_stopped_itself_blames_no_one():
    watch = watch_at(0, {1: (10, False, 0.0, 0.0)})
    watch.forgive(now=20.0)          # this rank's own watchdog was frozen until 20.0
    assert watch.check(Heartbeat(step=10, waiting=True, waiting_since=0.0), now=21.0) == ([], [])
