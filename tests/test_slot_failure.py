"""A failed slot costs one slot: 2 hosts of 2 slots each, `regatta local` with real
horovodrun. Host 2's slot-1 process SIGKILLed from outside is refilled (the world stays at
4, its neighbour keeps its process); its slot-0 process killed soon after gets the host
excluded (4 -> 2); after the cooldown the host comes back (4 again)."""
import json
import re
from pathlib import Path

import pytest

from conftest import BIN, kinds, run
from elastic.launch.agent import verdict
from elastic.launch.local import horovodrun_command
from elastic.launch.plan import PlanError, parse_plan
from monitor.store import Store

HOST = "127.0.0.3"


@pytest.fixture(scope="module")
def slots_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("slots")
    # 1500 steps: the host excluded at step 301 came back at step 446, 2.1 s later, in an
    # idle run (cooldown 1-2 s, discovery, new workers); its return takes time, not steps,
    # so a slower machine sees it at an earlier step, a faster one later (with Horovod's
    # loop woken by queued tensors, a fresh clone's 800 steps ended before it came back).
    done = run([str(BIN / "regatta"), "local", "digits", "--hosts", "2", "--slots", "2",
                "--steps", "1500", "--commit-every", "10", "--sigkill", "2/1@100",
                "--sigkill", "2/0@300", "--cooldown", "1:2", "--run-dir", str(tmp / "run"),
                "--report", str(tmp / "report.json"), "--db", str(tmp / "m.db"),
                "--timeout", "280", "--seed", "5"], timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:]
    return tmp, json.loads((tmp / "report.json").read_text())


def pids(report, slot, since=0.0, until=float("inf")):
    return {e["pid"] for e in report["events"] if e["host"] == HOST and e["slot"] == slot
            and e["kind"] in ("sync", "resumed", "commit") and since <= e["wall_time"] < until}


def test_one_crashed_slot_is_refilled_and_its_neighbour_keeps_training(slots_run):
    _, report = slots_run
    refill, exclusion = report["changes"]
    kill = kinds(report, "fault_injected")[0]
    assert (refill["host"], refill["slot"], refill["kind"]) == (HOST, 1, "failure")
    assert refill["slot_action"] == "refilled" and refill["size_after"] == 4   # not 2
    # the three survivors go on from their live state
    assert refill["first_step_done_s"] is not None and refill["steps_redone"] == 0
    # the neighbour (slot 0) is one process from the start until its own kill
    assert len(pids(report, 0, until=exclusion["wall_time"])) == 1
    # slot 1: the killed process, then a fresh one that synced into the world of 4
    before, after = pids(report, 1, until=kill["wall_time"]), \
        pids(report, 1, kill["wall_time"], exclusion["wall_time"])
    assert before == {kill["pid"]} and len(after) == 1 and after != before
    (synced,) = [e for e in kinds(report, "sync") if e["pid"] in after]
    # the fresh worker receives the live state, a stripe from each of the three survivors
    assert synced["size"] == 4 and synced["source"] == "live" and synced["moved_bytes"] > 0
    # (less any survivor Gloo aborted while the world re-formed: replaced in place, it
    # came back with its commit, no live state, and received the live state too)
    others = [r for r in range(4) if r != synced["rank"]]
    same_sync = [e for e in kinds(report, "sync") if e["size"] == 4
                 and abs(e["wall_time"] - synced["wall_time"]) < 1]
    without_live = {e["rank"] for e in same_sync for h in kinds(report, "handoff_loaded")
                    if h["pid"] == e["pid"] and not h["live"]}
    # (and less a survivor one step behind, whose step's sums had not reached it when the
    # kill struck: it takes the others' state too, and the recovery is "adopted")
    behind = set(synced["behind"])
    assert synced["recovery"] == ("adopted" if behind else "recovered_live"), synced
    assert len(behind) < 3 and set(synced["disagreeing"]) == set(), synced
    assert sorted(synced["senders"]) == [r for r in others if r not in without_live | behind], \
        (synced, same_sync)
    assert len(without_live) < 3
    assert not [e for e in kinds(report, "blacklist") if e["wall_time"] < exclusion["wall_time"]]


def test_a_second_failure_within_the_window_excludes_the_host_and_it_returns(slots_run):
    _, report = slots_run
    _, exclusion = report["changes"]
    assert (exclusion["host"], exclusion["slot"]) == (HOST, 0)
    assert exclusion["slot_action"] == "host_excluded" and exclusion["size_after"] == 2
    # horovodrun excluded the host (its refilled worker too): the survivors recorded it,
    # or, restarted in place while re-forming, simply trained on without it
    (back, *_) = [e for e in kinds(report, "host_added") if e["target"] == HOST]
    without = [e for e in kinds(report, "resumed") if exclusion["wall_time"] < e["wall_time"] < back["wall_time"]]
    assert without and {(e["host"], e["size"]) for e in without} == {("127.0.0.2", 2)}
    assert all(e["target"] == HOST for e in kinds(report, "blacklist"))
    # after the cooldown (1-2 s) the host returns, both of its slots started afresh
    again = [e for e in kinds(report, "resumed") if e["wall_time"] > back["wall_time"]]
    assert {e["size"] for e in again} == {4} and {e["host"] for e in again} == {"127.0.0.2", HOST}
    assert (report["final_step"], report["final_world_size"]) == (1500, 4)


def test_slot_failures_are_events_in_the_store(slots_run):
    tmp, report = slots_run
    events = Store(f"sqlite:///{tmp / 'm.db'}").events(report["run_id"], kinds=["slot_failed"])
    failed = [(e["detail"]["target"], e["detail"]["slot"], e["detail"]["code"], e["detail"]["action"])
              for e in events]
    assert [f for f in failed if f[0] == HOST] == [(HOST, 1, -9, "refilled"), (HOST, 0, -9, "host_excluded")]
    # Seen once (a fresh clone's suite, 2026-12-04): a survivor on the other host aborted
    # in Gloo's own thread during the first recovery ("op.preamble.length <= op.nbytes":
    # likely a failing peer's Horovod sending a message of another protocol step); recorded
    # as its own slot's failure (SIGABRT) and refilled. At most that, never an exclusion:
    collateral = [f for f in failed if f[0] != HOST]
    print("collateral slot failures:", collateral)
    assert len(collateral) <= 1 and all(f[2] == -6 and f[3] == "refilled" for f in collateral)


@pytest.mark.parametrize("code, siblings, since, expected", [
    (-9, 1, 61.0, "refilled"),          # killed beside a live neighbour
    (-11, 3, 1e9, "refilled"),          # a segfault
    (-9, 0, 1e9, "host_excluded"),      # the host's only worker: nothing says the host is up
    (1, 1, 1e9, "host_excluded"),       # an exception would happen again
    (-9, 1, 59.0, "host_excluded"),     # the host failed within the window
])
def test_verdict(code, siblings, since, expected):
    assert verdict(code, siblings, since, 60.0) == expected


@pytest.mark.parametrize("args, message", [
    (["--cooldown", "5"], "MIN:MAX"),
    (["--cooldown", "0:5"], "1 <= MIN <= MAX <= 3600"),
    (["--cooldown", "9:3"], "1 <= MIN <= MAX <= 3600"),
    (["--refill-window", "-1"], "--refill-window"),
])
def test_bad_slot_options_name_the_problem(args, message):
    with pytest.raises(PlanError, match=re.escape(message)):
        parse_plan(["digits", *args])


def test_slot_options_reach_horovodrun_and_the_agents():
    plan = parse_plan(["digits", "--cooldown", "2:30", "--refill-window", "5"])
    command = horovodrun_command(plan, Path("hosts.txt"), "lo")
    at = command.index("--blacklist-cooldown-range")
    assert command[at + 1:at + 3] == ["2", "30"] and plan.refill_window == 5.0
    assert "--blacklist-cooldown-range" not in horovodrun_command(parse_plan(["digits"]),
                                                                  Path("hosts.txt"), "lo")
