"""Failures during a recovery: a second SIGKILL 100-150 ms after the first, from outside,
while the survivors re-form the world; a second death at the worst instant, while Gloo
connects the new world, which makes Gloo abort every survivor; and one the instant the new
world is up, as the sync starts; and one as the new world's lifelines are built. The job recovers on whoever is left and finishes in
seconds, never after Gloo's 30 s timeouts."""
import json
from collections import Counter

import pytest

from conftest import BIN, kinds, run
from outside import what_happened
from elastic.launch import netns
from elastic.runtime.events import read_events
from monitor.store import Store

UNAVAILABLE = netns.available()
# the module fixtures run whole jobs (the abort race up to ATTEMPTS of them) in a test's setup
pytestmark = [pytest.mark.skipif(bool(UNAVAILABLE), reason=UNAVAILABLE),
              pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def double_kills(tmp_path_factory):
    """5 hosts; two episodes of two kills each, the second during the first's recovery
    (0.1 s and 0.15 s after it, from outside; a recovery takes 0.16-0.32 s here alone).
    A run where a second kill came after the first's recovery had ended (the machine
    slow to strike, or the recovery quick) never reached the race: it is run again, up
    to ATTEMPTS_DURING times, and the test fails saying so if none did."""
    for attempt in range(ATTEMPTS_DURING):
        tmp = tmp_path_factory.mktemp("races")
        report = tmp / "report.json"
        done = run([str(BIN / "regatta"), "local", "digits", "--hosts", "5", "--steps", "360",
                    "--commit-every", "10", "--sigkill", "2@60", "--sigkill", "3@60+0.1",
                    "--sigkill", "4@200", "--sigkill", "5@200+0.15", "--run-dir", str(tmp / "run"),
                    "--report", str(report), "--timeout", "280", "--seed", "7"],
                   timeout=300, env={"REGATTA_AUDIT": "1"}, check=False)
        result = done, json.loads(report.read_text()), (tmp / "run" / "horovodrun.log").read_text()
        if done.returncode != 0 or all(during_recovery(result[1])):
            break
    print("attempts", attempt + 1, "second kills during the recovery", during_recovery(result[1]))
    return result


ATTEMPTS_DURING = 3


def during_recovery(report) -> list[bool]:
    """For each episode, whether its second kill struck before the first step at the new
    size (the recovery from the first kill still going on)."""
    struck = [e for e in report["events"] if e["kind"] in ("fault_injected", "fault_missed")
              and e["fault"] == "kill"]
    answers = []
    for first, second in (struck[0:2], struck[2:4]):
        resumed = [e["wall_time"] for e in kinds(report, "resumed") if e["wall_time"] > first["wall_time"]]
        answers.append(bool(resumed) and second["wall_time"] < min(resumed))
    return answers


def test_the_job_finishes_on_the_last_host(double_kills):
    done, report, log = double_kills
    assert done.returncode == 0 and report["exit_code"] == 0, log[-3000:]
    assert (report["final_step"], report["final_world_size"]) == (360, 1)
    assert "Wait timeout" not in log
    # Now and then Gloo aborts a survivor whose peer died mid-transfer (its transport
    # thread throws on the stray message: seen once in ~10 runs here); that costs the
    # survivor, at once, never a timeout
    strikes = [e["wall_time"] for e in kinds(report, "fault_injected")]
    for aborted in [e for e in kinds(report, "slot_failed") if e["code"] == -6]:
        assert any(0 <= aborted["wall_time"] - t < 2 for t in strikes), aborted
    assert log.count("status code 134") == len([e for e in kinds(report, "slot_failed")
                                                 if e["code"] == -6])


def test_each_double_failure_is_recovered_in_seconds(double_kills):
    _, report, _ = double_kills
    # a chained kill whose target Gloo aborted already is recorded as missed, in its place
    struck = [e for e in report["events"] if e["kind"] in ("fault_injected", "fault_missed")
              and e["fault"] == "kill"]
    assert [e["target"] for e in struck] == ["127.0.0.3", "127.0.0.4", "127.0.0.5", "127.0.0.6"]
    assert all(during_recovery(report)), (
        f"in {ATTEMPTS_DURING} runs a second kill came after the first's recovery had ended "
        f"({during_recovery(report)} in the last): the race this guards was never reached")
    for first, second in (struck[0:2], struck[2:4]):
        # chained to the strike before it (+0.1 s, +0.15 s); finding a host's processes
        # (a scan of every process) and a late timer on a busy machine add to that, while
        # the survivors recover on the same two cores
        assert 0.05 < second["wall_time"] - first["wall_time"] < 2.0
        # seconds, never Gloo's 30 s rendezvous timeout (loose: the bench has the figure)
        resumed = [e for e in kinds(report, "resumed") if e["wall_time"] > second["wall_time"]]
        assert resumed and resumed[0]["wall_time"] - first["wall_time"] < 20


def test_the_survivor_continues_from_its_live_state_or_its_last_commit(double_kills):
    """After each episode the survivor goes on from its live state, at the step the
    failure interrupted (restarted in place while the world re-formed, its live state
    handed over), or, with no live state left among the survivors (every one aborted by
    Gloo), exactly at a commit it made, with the same parameters; only when the two
    killed held both copies of a share of that commit, at the durable checkpoint's."""
    _, report, _ = double_kills
    survivor = [e for e in report["events"] if e["host"] == "127.0.0.2"]
    commits = {e["step"]: e["param_hash"] for e in survivor if e["kind"] == "commit"}
    syncs = [e for e in survivor if e["kind"] == "sync"][1:]   # after the first
    assert syncs
    for sync in syncs:
        if sync["source"] == "live":
            (restore, *_) = [e for e in reversed(survivor) if e["kind"] == "restore"
                             and e["wall_time"] < sync["wall_time"]]
            loaded = [e for e in survivor if e["kind"] == "handoff_loaded"
                      and restore["wall_time"] < e["wall_time"] < sync["wall_time"]]
            if loaded and not loaded[-1]["live"]:
                # Gloo aborted it and its replacement took over its commit alone (seen
                # 2026-12-07: two survivors a step ahead aborted, one of them then killed):
                # no live state of its own, it received the newest one a survivor kept,
                # between that commit and the step it had been in
                assert sync["rank"] not in sync["senders"], (sync, loaded)
                assert loaded[-1]["step"] <= sync["step"] <= restore["from_step"], (sync, restore, loaded)
                continue
            # the step it was in (a restart in place records the commit's as its restore
            # step), or the one after it, where the death came inside the step's last
            # collective and another survivor finished it: this rank was behind and took it
            behind = sync.get("recovery") == "adopted" and sync["rank"] in sync["behind"]
            assert sync["step"] == restore["from_step"] + behind, (sync, restore)
            assert restore.get("in_place") or restore["step"] + behind == sync["step"], (sync, restore)
            continue
        assert sync["source"] in ("memory", "checkpoint"), sync
        assert commits.get(sync["step"]) == sync["param_hash"], sync
        if sync["source"] == "checkpoint":
            lost = [e for e in survivor if e["kind"] == "state_lost" and e["wall_time"] < sync["wall_time"]]
            assert lost and sync["step"] < max(lost[-1]["steps_held"]), (sync, lost)
    for restarted in [e for e in survivor if e["kind"] == "restart_in_place"]:
        (loaded, *_) = [e for e in survivor if e["kind"] == "handoff_loaded"
                        and e["wall_time"] > restarted["wall_time"]]
        # its live state at the step it was in, or its commit
        assert loaded["live"] == restarted["live"], (restarted, loaded)
        assert loaded["step"] == restarted["step"] if loaded["live"] else loaded["step"] in commits


GLOO_ABORT = "terminate called after throwing an instance of 'gloo::IoException'"
ATTEMPTS = 10


@pytest.fixture(scope="module")
def killed_connecting(tmp_path_factory):
    """5 hosts; host 2 dies at step 60, host 4 in the recovery, as Gloo connects it. The
    instant is found by watching its sockets, a few ms apart, and each survivor may then be
    in one of three places: in Horovod's first collectives (Gloo aborts it), still in the
    rendezvous (it sees the restart mark and asks to be replaced) or already past Gloo's
    initialisation (its init, a collective or the lifelines fail: the ordinary path; now and
    then host 4 itself is past it before it counts its connections, and dies as its init
    returns).
    Measured here, Gloo aborted someone in 6 runs of 17 (and 5 of 11 on 2026-12-07, the
    kill at its first, its global mesh's last or its last connection alike: in the others
    every survivor was still in the rendezvous, saw the restart mark within 0.1 s and
    asked to be replaced), so the run is repeated until it does, up to ATTEMPTS times
    (about 18 s each; at 0.45 a run all of them miss 1 time in 400), and the abort test
    fails if none did. Every attempt must recover, whichever place each survivor was in.
    The agent's side of the abort path is tested without a race in test_agent.py.

    An attempt that lost a worker before either kill struck never reached the race (seen
    once on a loaded machine: horovodrun's rendezvous server dropped a starting worker's
    registration after its 3 s request timeout, and the host was gone before step 60); it is
    run again, at most twice."""
    attempts, lost_at_start = [], []
    while len(attempts) < ATTEMPTS:
        tmp = tmp_path_factory.mktemp("connecting")
        report = tmp / "report.json"
        done = run([str(BIN / "regatta"), "local", "digits", "--hosts", "5", "--steps", "120",
                    "--commit-every", "10", "--kill", "2@60", "--kill-connecting", "4@50",
                    "--run-dir", str(tmp / "run"), "--report", str(report), "--timeout", "150",
                    "--db", str(tmp / "m.db")],
                   timeout=170, env={"REGATTA_AUDIT": "1"}, check=False)
        log = (tmp / "run" / "horovodrun.log").read_text()
        attempt = (done, json.loads(report.read_text()), log, tmp)
        if failed_before_the_kills(attempt[1]):
            lost_at_start.append(failed_before_the_kills(attempt[1]))
            assert len(lost_at_start) <= 2, (lost_at_start, log[-3000:])
            continue
        attempts.append(attempt)
        if GLOO_ABORT in log or done.returncode != 0:
            break
    print("attempts", len(attempts), "aborted", [a[2].count(GLOO_ABORT) for a in attempts],
          "run again (a worker lost before the kills)", lost_at_start)
    return attempts


def failed_before_the_kills(report) -> list:
    """The launcher's record of workers that failed before the first planned kill."""
    first_kill = min((e["wall_time"] for e in kinds(report, "kill_injected")), default=float("inf"))
    return [(e["target"], e["code"]) for e in kinds(report, "slot_failed") if e["wall_time"] < first_kill]


def test_every_attempt_finishes_on_the_survivors(killed_connecting):
    """Not one healthy host lost: a survivor whose init, lifelines or collectives broke
    under it recovered instead of ending (exit 1) and having its host counted failed."""
    for done, report, log, tmp in killed_connecting:
        assert done.returncode == 0 and report["exit_code"] == 0, log[-3000:]
        killed = len(kinds(report, "kill_injected"))
        assert (report["final_step"], report["final_world_size"]) == (120, 5 - killed), \
            what_happened(tmp / "run", report["events"])
        assert "failure count" not in log and "Wait timeout" not in log
        assert "exit with status code 1." not in log, log[-3000:]
        # the memory-copy ceiling is measured once a run: a replacement that becomes rank 0
        # does not spend 0.2 s of the recovery measuring it again
        assert len(kinds(report, "calibration")) == 1


def test_survivors_aborted_by_gloo_are_replaced_with_their_commits(killed_connecting):
    reached = [a for a in killed_connecting if GLOO_ABORT in a[2]]
    assert reached, (f"Gloo aborted no survivor in {len(killed_connecting)} attempts: the race "
                     "this test guards was never reached")
    done, report, log, _ = reached[-1]
    # The second death came while survivors were in Horovod's first collectives: Gloo
    # aborted them (the race this guards; one already past them just fails a collective;
    # one still in the rendezvous sees the restart mark and asks to be replaced), and none
    # was counted failed for it: each was replaced with the commit it had.
    aborted = log.count(GLOO_ABORT)
    assert 1 <= aborted <= 3
    assert "failure count" not in log and "Wait timeout" not in log
    first, second = (e for e in kinds(report, "kill_injected"))
    assert (first["host"], second["host"], second["connecting"]) == ("127.0.0.3", "127.0.0.5", True)
    replaced = asked = 0
    for host in ("127.0.0.2", "127.0.0.4", "127.0.0.6"):
        mine = [e for e in report["events"] if e["host"] == host]
        commits = {e["step"]: e["param_hash"] for e in mine if e["kind"] == "commit"}
        for loaded in [e for e in mine if e["kind"] == "handoff_loaded"]:
            assert loaded["wall_time"] > second["wall_time"] and loaded["step"] == 60 in commits
            asked_before = [e for e in mine if e["kind"] == "restart_in_place"
                            and e["wall_time"] < loaded["wall_time"]]
            # A live state is loaded where its predecessor said it handed one over, or where
            # Gloo aborted it between writing the hand-off and recording that (no event then)
            if asked_before:
                assert loaded["live"] == any(e["live"] for e in asked_before)
            replaced += 1
        for restarted in [e for e in mine if e["kind"] == "restart_in_place"]:
            assert restarted["wall_time"] > second["wall_time"] and restarted["step"] == 60
            asked += 1
        # From the live state (kept, or handed over by a survivor replaced while the world
        # re-formed), else from the commits in memory, unless the two dead held both copies
        # of a share (they were buddies: Horovod orders hosts its own way); then from the
        # checkpoint.
        (sync,) = [e for e in mine if e["kind"] == "sync" and e["wall_time"] > second["wall_time"]]
        lost = [e for e in mine if e["kind"] == "state_lost"]
        if sync["source"] in ("live", "memory"):
            assert sync["from_step"] == 60 and not lost
        else:
            assert (sync["source"], sync["from_step"]) == ("checkpoint", 50)
            assert lost[0]["steps_held"] == [60]
    # Every one aborted or asked was replaced, and only those. One that asked can be
    # aborted by Gloo while it sends its last rows: counted in both, replaced once.
    replacements = Counter(e["host"] for e in kinds(report, "handoff_loaded"))
    askers = Counter(e["host"] for e in kinds(report, "restart_in_place"))
    assert replaced == replacements.total() and asked == askers.total()
    assert askers <= replacements and (replacements - askers).total() <= aborted <= replaced
    resumed = [e for e in kinds(report, "resumed") if e["wall_time"] > second["wall_time"]]
    assert resumed and resumed[0]["wall_time"] - first["wall_time"] < 20   # never Gloo's 30 s


def test_survivors_that_ended_mid_recovery_left_their_recovery_in_the_store(killed_connecting):
    """A survivor Gloo aborted, or one that asked to be replaced, ended at once, its sink's
    queue with it: the restore it recorded a few hundred ms before is in the store all the
    same (sent when recorded), and so is its replacement's hand-off. (What it recorded in
    the last milliseconds, the second death's peer_lost, can go with it.)"""
    for done, report, log, tmp in killed_connecting:
        store = Store(str(tmp / "m.db"))
        (run_row,) = store.runs()
        survivors = {e["host"] for e in kinds(report, "finish")}
        recorded = [(e["host"], e["kind"], e["wall_time"]) for e in read_events(tmp / "run")
                    if e["host"] in survivors and e["kind"] in ("restore", "handoff_loaded")]
        # A survivor whose step's collective outlived the sever is restarted from inside
        # the step, before any restore (1 survivor of 4 in a run here).
        from_the_step = {e["host"] for e in kinds(report, "restart_in_place")
                         if e["reason"] == "the step's collective still waited on Gloo after the sever"}
        assert {host for host, kind, _ in recorded if kind == "restore"} | from_the_step == survivors
        stored = {(e["host"], e["kind"], e["wall_time"]) for e in store.events(run_row["id"])}
        assert [event for event in recorded if event not in stored] == []


def short_race(tmp, *args: str) -> tuple:
    """One short digits run with ``args`` (hosts, steps, faults), commits every 10 steps,
    parameter hashes on: the finished command, its report and horovodrun's log."""
    report = tmp / "report.json"
    done = run([str(BIN / "regatta"), "local", "digits", *args, "--commit-every", "10",
                "--run-dir", str(tmp / "run"), "--report", str(report), "--timeout", "150"],
               timeout=170, env={"REGATTA_AUDIT": "1"}, check=False)
    return done, json.loads(report.read_text()), (tmp / "run" / "horovodrun.log").read_text()


@pytest.fixture(scope="module")
def killed_syncing(tmp_path_factory):
    """4 hosts; host 2 dies at step 60, host 4 in the recovery, the instant its ``hvd.init``
    of the new world returns: the survivors' meshes are complete, their sync starts, and
    Gloo has a connection to a dead peer in each of them. (Planned for the first recovery
    after step 50: a survivor whose step 60 had not begun would not count that one. After
    the durable checkpoint of step 50: two hosts lost may have held both copies of a share.)"""
    return short_race(tmp_path_factory.mktemp("syncing"),
                      "--hosts", "4", "--steps", "100", "--kill", "2@60", "--kill-syncing", "4@50")


def test_a_death_as_the_sync_starts_is_recovered_in_seconds(killed_syncing):
    """A survivor whose Gloo waits for the dead peer with nothing left to sever (seen once:
    30 s) is restarted in place with its commit; every other one fails its sync at once."""
    done, report, log = killed_syncing
    assert done.returncode == 0 and report["exit_code"] == 0, log[-3000:]
    assert (report["final_step"], report["final_world_size"]) == (100, 2)
    assert "Wait timeout" not in log and "failure count" not in log
    first, second = kinds(report, "kill_injected")
    assert (first["host"], second["host"], second.get("syncing")) == ("127.0.0.3", "127.0.0.5", True)
    resumed = [e for e in kinds(report, "resumed") if e["wall_time"] > second["wall_time"]]
    assert resumed and resumed[0]["wall_time"] - first["wall_time"] < 20   # never Gloo's 30 s
    for host in ("127.0.0.2", "127.0.0.4"):
        mine = [e for e in report["events"] if e["host"] == host]
        commits = {e["step"]: e["param_hash"] for e in mine if e["kind"] == "commit"}
        (sync,) = [e for e in mine if e["kind"] == "sync" and e["wall_time"] > second["wall_time"]]
        # live: the cut sync had moved nothing into them yet (or a survivor replaced in
        # place took the live state up again)
        if sync["source"] in ("live", "memory"):
            assert (sync["from_step"], sync["param_hash"]) == (60, commits[60])
        else:   # the two dead held both copies of a share (Horovod orders hosts its own way)
            assert (sync["source"], sync["from_step"], sync["param_hash"]) == \
                ("checkpoint", 50, commits[50])
        for restarted in [e for e in mine if e["kind"] == "restart_in_place"]:
            loaded = [e for e in mine if e["kind"] == "handoff_loaded"
                      and e["wall_time"] > restarted["wall_time"]]
            assert loaded and loaded[0]["step"] == 60 and loaded[0]["live"] == restarted["live"]
    after = [e for e in kinds(report, "sync") if e["wall_time"] > second["wall_time"]]
    assert len({e["param_hash"] for e in after}) == 1     # one state on both survivors


@pytest.fixture(scope="module")
def killed_entering(tmp_path_factory):
    """4 hosts; host 2 dies at step 60, host 4 in the recovery as it starts building the new
    world's lifelines (after the sync): the survivors are in the lifelines' address
    exchange, a Horovod collective, with no lifeline of this world to tell them. Before the
    re-forming's watch lasted until the lifelines were up, a survivor waited out Gloo's 30 s
    there in 1 run of 3 (and 1 kill in 20 of a chaos run): this test fails 1 time in 3 on
    that code, the runs above reproduce it."""
    return short_race(tmp_path_factory.mktemp("entering"),
                      "--hosts", "4", "--steps", "100", "--kill", "2@60", "--kill-entering", "4@50")


def test_a_death_as_the_lifelines_are_built_is_recovered_in_seconds(killed_entering):
    done, report, log = killed_entering
    assert done.returncode == 0 and report["exit_code"] == 0, log[-3000:]
    assert (report["final_step"], report["final_world_size"]) == (100, 2)
    assert "Wait timeout" not in log and "failure count" not in log
    first, second = kinds(report, "kill_injected")
    assert (first["host"], second["host"], second.get("entering")) == ("127.0.0.3", "127.0.0.5", True)
    resumed = [e for e in kinds(report, "resumed") if e["wall_time"] > second["wall_time"]]
    assert resumed and resumed[0]["wall_time"] - second["wall_time"] < 10   # never Gloo's 30 s
    # (Usually a survivor still in the address exchange saw the agent's mark and cut its
    # Gloo connections: 6 runs of 6 here; sometimes Gloo fails every survivor by itself.)
    commits = [e for e in kinds(report, "commit") if e["step"] == 100]
    assert {e["host"] for e in commits} == {"127.0.0.2", "127.0.0.4"}
    assert len({e["param_hash"] for e in commits}) == 1


@pytest.fixture(scope="module")
def killed_joining(tmp_path_factory):
    """3 hosts and one added at step 60; host 1 dies as Gloo connects the world that takes
    the added host in: that host's fresh worker is in its first rendezvous. It was left
    there for Gloo to abort (its host excluded, the job one host short) or to time out
    (30 s, seen in a chaos run with rank 0 killed).

    The instant is found by a thread polling the doomed worker's sockets; on a loaded
    machine it can go unscheduled while Gloo makes the last connections, and the kill
    comes as that worker's init returns instead (``after_init``: 9 runs in 12 beside two
    busy loops, none in 6 without). Such a run is run again, at most three times, for the
    instant itself; a run that failed is what the test reports."""
    for attempt in range(3):
        tmp = tmp_path_factory.mktemp("joining")
        done, report, log = short_race(tmp, "--hosts", "3", "--steps", "200", "--add", "@60",
                                       "--kill-connecting", "1@55")
        if done.returncode != 0 or not any(e.get("after_init") for e in kinds(report, "kill_injected")):
            break
    print("attempts", attempt + 1)
    return done, report, log, tmp / "run"


@pytest.fixture(scope="module")
def killed_joined(tmp_path_factory):
    """The same join, host 1 killed the instant its init of the new world returns: the
    others are in their first collectives, the added host's fresh worker often still in
    its rendezvous, which fails; its next one is a re-forming like any survivor's. (Taken
    for a first one, it asked to be replaced on the old death's mark while its own
    re-initialisation registered its slot: its replacement waited for the world after,
    Gloo's 30 s, in 4 runs of 5 here.)"""
    tmp = tmp_path_factory.mktemp("joined")
    return (*short_race(tmp, "--hosts", "3", "--steps", "200", "--add", "@60",
                        "--kill-syncing", "1@55"), tmp / "run")


@pytest.mark.parametrize("race", ["killed_joining", "killed_joined"])
def test_a_death_while_a_host_joins_keeps_the_added_host(race, request):
    """The added host's fresh worker is replaced like any other (stateless: the sync gives
    it the state), so the job goes on with every live host."""
    done, report, log, run_dir = request.getfixturevalue(race)
    assert done.returncode == 0 and report["exit_code"] == 0, what_happened(run_dir, report["events"])
    assert "Wait timeout" not in log
    (kill,) = kinds(report, "kill_injected")
    assert (kill["host"], kill.get("connecting") or kill.get("syncing")) == ("127.0.0.2", True)
    # the watch caught Gloo connecting in one of the attempts, else the race was not reached
    assert race == "killed_joined" or not kill.get("after_init"), \
        "in 3 attempts the kill came as the init returned, never as Gloo connected"
    # Failed twice in a fresh clone's full suite, never alone (8 of 8 here, 4 of them beside
    # two busy loops): once in world 2, once with no commit covered among the ranks left
    # ("steps held: [40]", no checkpoint yet) on 2026-12-06. What left the world, and the
    # events, are in the messages.
    lost = [{k: e.get(k) for k in ("kind", "host", "target", "code", "action", "reason")}
            for e in report["events"] if e["kind"] in ("slot_failed", "restart_in_place",
                                                       "no_place", "host_removed", "cut_off")]
    assert (report["final_step"], report["final_world_size"]) == (200, 3), lost
    assert not [e for e in kinds(report, "slot_failed") if e["target"] == "127.0.0.5"
                and e["action"] == "host_excluded"]
    commits = [e for e in kinds(report, "commit") if e["step"] == 200]
    assert {e["host"] for e in commits} == {"127.0.0.3", "127.0.0.4", "127.0.0.5"}
    assert len({e["param_hash"] for e in commits}) == 1
    resumed = [e for e in kinds(report, "resumed") if e["wall_time"] > kill["wall_time"]]
    assert resumed and resumed[0]["wall_time"] - kill["wall_time"] < 10   # never Gloo's 30 s
