"""monitor.recovery on both event shapes: the store's (detail under "detail") and the
workers' JSONL files' (detail keys flat), which the launcher's report reads."""
import pytest

from monitor.recovery import recoveries


def flat(kind, t, host, step=None, rank=0, **detail):
    """An event as elastic/events.py writes it to a JSONL file."""
    return {"kind": kind, "wall_time": t, "step": step, "host": host, "slot": 0, "rank": rank,
            "pid": 1, **detail}


def nested(event):
    """The same event as the store returns it."""
    keys = ("kind", "wall_time", "step", "host", "rank")
    return {**{k: event[k] for k in keys},
            "detail": {k: v for k, v in event.items() if k not in keys + ("slot", "pid")}}


# A launcher cuts host c off (vanish) at t=100; survivors notice at 100.9 (peer_lost, with
# the dead host as target), rank 0 records the failure at 101.0, reset 101.5, sync 101.7,
# first step 102.0. Later a worker on host b SIGKILLs itself at 200 (kill_injected) and no
# failure event is recorded at all (a pipeline run, say): the kill is the trigger.
EVENTS = [
    flat("fault_injected", 100.0, "launcher", fault="vanish", target="c", slot=0, pid=77),
    flat("peer_lost", 100.9, "a", peer_rank=2, target="c"),
    flat("peer_lost", 100.95, "b", rank=1, peer_rank=2, target="c"),
    flat("restore", 101.2, "a", step=40, from_step=43, steps_redone=3),
    flat("failure", 101.0, "a", step=43, target="c", size_before=3, size_after=2),
    flat("reset", 101.5, "a", step=40, size_before=3, size_after=2),
    flat("sync", 101.7, "a", step=40, size=2),
    flat("resumed", 102.0, "a", step=41, size=2),
    flat("commit", 150.0, "a", step=60),
    flat("kill_injected", 200.0, "b", step=80, rank=1, size=2),
    flat("peer_lost", 200.1, "a", peer_rank=1, target="b"),
    flat("restore", 200.3, "a", step=80, steps_redone=0),
    flat("reset", 201.0, "a", step=80, size_before=2, size_after=1),
    flat("resumed", 201.4, "a", step=81, size=1),
]


@pytest.mark.parametrize("shape", [lambda e: e, nested], ids=["jsonl", "store"])
def test_phases_are_measured_from_the_fault(shape):
    rows = recoveries([shape(e) for e in reversed(EVENTS)])   # any order
    assert [(r["kind"], r["host"], r["fault"], r["step"]) for r in rows] == [
        ("failure", "c", "vanish", 43), ("failure", "b", "kill", 80)]
    first, second = rows
    assert first["wall_time"] == 100.0
    assert first["detected_s"] == pytest.approx(0.9)
    assert (first["reset_done_s"], first["state_synced_s"], first["first_step_done_s"]) == \
        pytest.approx((1.5, 1.7, 2.0))
    assert (first["steps_redone"], first["restored_to"], first["size_before"],
            first["size_after"]) == (3, 40, 3, 2)
    assert second["detected_s"] == pytest.approx(0.1)
    assert second["state_synced_s"] is None   # no sync recorded: not reached
    assert (second["first_step_done_s"], second["size_after"]) == (pytest.approx(1.4), 1)


def test_without_a_fault_the_failure_is_the_start():
    events = [e for e in EVENTS if e["kind"] != "fault_injected" and e["wall_time"] < 150]
    (row,) = recoveries(events)
    # peer_lost came 0.1 s before the failure was recorded: within the burst, not after it
    assert (row["wall_time"], row["fault"], row["host"]) == (101.0, None, "c")
    assert row["detected_s"] == pytest.approx(0.2)   # the restore is the first thing after


def test_unannounced_peer_loss_is_a_failure_and_bad_events_are_skipped():
    events = [flat("peer_lost", 10.0, "a", peer_rank=3, target="d"),
              flat("peer_lost", 10.1, "b", peer_rank=3, target="d"),
              flat("reset", 11.0, "a", size_before=4, size_after=3),
              {"kind": "failure"}, {"wall_time": "soon"}, "not an event",
              flat("restore", 10.5, "a", steps_redone="many")]
    (row,) = recoveries(events)
    assert (row["host"], row["ranks"], row["reset_done_s"], row["steps_redone"]) == ("d", 2, 1.0, 0)


@pytest.mark.parametrize("shape", [lambda e: e, nested], ids=["jsonl", "store"])
def test_hosts_added_at_one_instant_share_one_re_forming(shape):
    """Two hosts added at one step are recorded at one instant; each row is measured over
    the re-forming that took them both in (a window ending at the other would be empty)."""
    events = [flat("host_added", 50.0, "launcher", step=10, target="c"),
              flat("host_added", 50.0, "launcher", step=10, target="d"),
              flat("reset", 52.0, "a", step=30, size_before=2, size_after=4),
              flat("sync", 52.3, "a", step=30, size=4),
              flat("resumed", 52.5, "a", step=31, size=4),
              flat("host_added", 90.0, "launcher", step=80, target="e"),
              flat("reset", 91.0, "a", step=90, size_before=4, size_after=5)]
    rows = recoveries([shape(e) for e in events])
    assert [(r["host"], r["size_after"]) for r in rows] == [("c", 4), ("d", 4), ("e", 5)]
    assert [r["first_step_done_s"] for r in rows] == [pytest.approx(2.5), pytest.approx(2.5), None]
