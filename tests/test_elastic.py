"""Elastic data parallel under a real `horovodrun` on simulated hosts: workers killed,
hosts added, a whole job killed and restarted, a rank stalled."""
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import PYTHON, ROOT, kill_tree, kinds, regatta_local
from elastic.runtime.events import read_events
from monitor.sink import destination_of
from monitor.spool import spool_tag
from monitor.store import Store

K = 10   # commit interval used below


@pytest.fixture(scope="module")
def kill_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kill")
    report = regatta_local(tmp, "digits", "--hosts", "3", "--steps", "240", "--commit-every", str(K),
                           "--kill", "2@75", "--db", str(tmp / "m.db"))
    return tmp, report


def worker_events(report, kind, host):
    return [e for e in kinds(report, kind) if e["host"] == host]


def test_kill_one_of_three_finishes_on_two(kill_run):
    tmp, report = kill_run
    assert report["exit_code"] == 0
    assert (report["final_step"], report["final_world_size"]) == (240, 2)
    (failure,) = report["changes"]
    assert failure["kind"] == "failure" and failure["host"] == "127.0.0.3"
    assert failure["size_after"] == 2
    # killed at 75, last commit at 70: the survivors go on from their live state at 75
    assert failure["steps_redone"] == 0 and failure["recovered_from"] == "recovered_live"
    assert failure["moved_bytes"] == 0
    assert failure["first_step_done_s"] is not None
    assert report["metrics"]["accuracy"] >= 0.9


def test_loss_keeps_falling_after_the_failure(kill_run):
    _, report = kill_run
    root_commits = [e for e in kinds(report, "commit") if e["rank"] == 0 and e["loss"] is not None]
    failure_time = report["changes"][0]["wall_time"]
    before = [e["loss"] for e in root_commits if e["wall_time"] < failure_time]
    after = [e["loss"] for e in root_commits if e["wall_time"] > failure_time]
    assert len(before) >= 3 and len(after) >= 3
    assert sum(after[-3:]) / 3 < sum(before[:3]) / 3
    assert min(after) < min(before)


def test_survivors_end_with_identical_parameters(kill_run):
    tmp, _ = kill_run
    finals = [json.loads(p.read_text()) for p in (tmp / "run" / "final").glob("*.json")]
    assert len(finals) == 2 and {f["world_size"] for f in finals} == {2}
    assert finals[0]["param_hash"] == finals[1]["param_hash"]


def test_survivors_go_on_from_their_live_state(kill_run):
    """The failed step applied nothing, so the survivors stand at step 75 with one state
    (model, optimizer, step and cursor: digests equal), five steps past the commit at 70:
    they agree on it and go on from there, restoring nothing."""
    _, report = kill_run
    restores = kinds(report, "restore")
    assert {e["host"] for e in restores} == {"127.0.0.2", "127.0.0.4"}
    assert {(e["step"], e["from_step"], e["steps_redone"]) for e in restores} == {(75, 75, 0)}
    commits = [e for e in kinds(report, "commit") if e["step"] == 70]
    assert len(commits) == 3 and all(len(e["held"]) == 2 for e in commits)
    assert all(abs(e["held_bytes"] - 2 * e["state_bytes"] / 3) <= 128 for e in commits)
    (committed,) = {(e["param_hash"], e["optimizer_hash"]) for e in commits}
    synced = [e for e in kinds(report, "sync") if e["wall_time"] > restores[0]["wall_time"]]
    assert {e["host"] for e in synced} == {"127.0.0.2", "127.0.0.4"}
    assert all((e["source"], e["from_step"], e["moved_bytes"]) == ("live", 75, 0) for e in synced)
    (live,) = {(e["param_hash"], e["optimizer_hash"], e["state_hash"]) for e in synced}
    assert live[:2] != committed    # five steps on from the commit, not rolled back to it
    went_on = kinds(report, "recovered_live")
    assert {(e["host"], e["step"], e["moved_bytes"], e["steps_redone"]) for e in went_on} == {
        ("127.0.0.2", 75, 0, 0), ("127.0.0.4", 75, 0, 0)}


def test_final_checkpoint_is_written_in_the_background_and_complete(kill_run):
    tmp, report = kill_run
    written = kinds(report, "checkpoint")
    assert written and all(e["background"] and e["bytes"] > 0 and e["write_s"] > 0 for e in written)
    assert written[-1]["step"] == 240
    saved = torch.load(tmp / "run" / "checkpoint" / "state.pt", weights_only=True)
    assert saved["step"] == 240 and saved["format"] == "regatta-dataparallel/1"


def test_store_holds_failure_and_world_size_change(kill_run):
    tmp, report = kill_run
    store = Store(str(tmp / "m.db"))
    (run,) = store.runs()
    failures = store.events(run["id"], kinds=["failure"])
    assert len(failures) == 1 and failures[0]["detail"]["target"] == "127.0.0.3"
    assert failures[0]["step"] == 75 and failures[0]["detail"]["size_after"] == 2
    assert failures[0]["wall_time"] >= report["changes"][0]["wall_time"]
    (blacklist,) = store.events(run["id"], kinds=["blacklist"])
    assert blacklist["detail"]["target"] == "127.0.0.3"
    resets = store.events(run["id"], kinds=["reset"])
    assert {(e["detail"]["size_before"], e["detail"]["size_after"]) for e in resets} == {(3, 2)}
    sizes = store.step_series(run["id"], "world_size", by="rank", max_points=10_000)
    assert sizes  # the series exists; exact sizes checked through the rows below
    with store.engine.connect() as conn:
        from sqlalchemy import text
        rows = conn.execute(text("select step, world_size, count(*) from step_metric "
                                 "group by step, world_size")).fetchall()
    per_size = {}
    for step, size, count in rows:
        per_size.setdefault(size, set()).add(step)
    # step rows count steps done: 75 at 3, then from the failed step on at 2 (none redone)
    assert max(per_size[3]) == 75 and min(per_size[2]) == 76 and max(per_size[2]) == 240
    assert run["status"] == "finished"
    # The killed worker's spool (an empty file: it had delivered everything) was replayed
    # and removed by the launcher, not left for a later run on this store to adopt.
    tag = spool_tag(destination_of(db=str(tmp / "m.db")))
    assert list(Path(os.environ["REGATTA_SPOOL_DIR"]).glob(f"{tag}.*")) == []
    assert report["replayed_rows"] == 0


@pytest.fixture(scope="module")
def add_run(tmp_path_factory):
    """A host added, drained, then added again (a drained node coming back)."""
    tmp = tmp_path_factory.mktemp("add")
    # 1000 steps: each addition joins within a second (about 60 steps of an idle run);
    # a busy machine must not reach the end before the second one has
    # point to point forced: digits' state is too small for auto to choose it
    report = regatta_local(tmp, "digits", "--hosts", "2", "--steps", "1000", "--commit-every", str(K),
                           "--add", "@100", "--remove", "127.0.0.4@400", "--add", "127.0.0.4@700",
                           job_args=["--set", "train.state_transfer=point_to_point"])
    return tmp, report


def test_added_host_joins_with_committed_state(add_run):
    tmp, report = add_run
    assert report["exit_code"] == 0
    assert (report["final_step"], report["final_world_size"]) == (1000, 3)
    added, removed, _ = report["changes"]
    assert added["kind"] == "host_added" and added["host"] == "127.0.0.4"
    assert added["size_after"] == 3 and added["steps_redone"] == 0
    # detected: rank 0 noticed the edit (its own host_added), before the new world formed
    assert 0 <= added["detected_s"] <= added["reset_done_s"] <= added["first_step_done_s"]
    after = [e for e in kinds(report, "sync") if added["wall_time"] < e["wall_time"] < removed["wall_time"]]
    assert {e["host"] for e in after} == {"127.0.0.2", "127.0.0.3", "127.0.0.4"}
    assert len({e["param_hash"] for e in after}) == 1 and len({e["step"] for e in after}) == 1
    # striped over both survivors, point to point: the new worker received every byte of
    # the state and the survivors none (a broadcast also gave each the other's stripe)
    assert {e["transport"] for e in after} == {"point_to_point"}
    assert sorted(e["senders"] for e in after) == [[0, 1]] * 3
    received = {e["host"]: e["received_bytes"] for e in after}
    moved = {e["moved_bytes"] for e in after}
    assert len(moved) == 1 and received == {"127.0.0.2": 0, "127.0.0.3": 0, "127.0.0.4": moved.pop()}
    finals = [json.loads(p.read_text()) for p in (tmp / "run" / "final").glob("*.json")]
    assert len(finals) == 3 and len({f["param_hash"] for f in finals}) == 1


def test_every_worker_registers_with_the_driver_while_it_initialises(add_run):
    """Each worker, the added ones included, registered its notification service before
    training (elastic/runtime/registration.py), and the driver's notices reached rank 0
    through it: every addition and removal above was noticed."""
    _, report = add_run
    ready = kinds(report, "ready")
    assert len(ready) == len(kinds(report, "start")) >= 4    # 2 first workers, 2 added
    # a queued tensor wakes Horovod's loop (our patch): its cycle, 20 ms, only spaces idle
    # rounds; Horovod's fusion is off, the buckets are fused already
    assert {(e["horovod_cycle_ms"], e["horovod_wakes"], e["horovod_fusion_bytes"])
            for e in kinds(report, "start")} == {(20.0, True, 0)}
    # digits' few kilobytes are one bucket, which cannot queue: Horovod sums it (gloo_sums.py)
    assert {e["gradient_sums"] for e in ready} == {"horovod"}
    assert all(isinstance(e["registration_s"], float) and 0 <= e["registration_s"] < 10
               for e in ready)
    assert [c["kind"] for c in report["changes"]] == ["host_added", "host_removed", "host_added"]


def test_a_host_removed_then_added_again_joins_at_once(add_run):
    """Horovod aborts the removed host's worker; its agent used to replace it as if Gloo
    had aborted it, the replacement asked the driver for a place and was counted in the
    next rendezvous, one survivor missed it, and the next addition stalled 30 s (Gloo's
    timeout) and lost the added host."""
    _, report = add_run
    assert [(c["kind"], c["host"], c["size_after"]) for c in report["changes"]] == [
        ("host_added", "127.0.0.4", 3), ("host_removed", "127.0.0.4", 2), ("host_added", "127.0.0.4", 3)]
    again = report["changes"][2]
    assert again["first_step_done_s"] < 25 and again["steps_redone"] == 0
    assert kinds(report, "slot_failed") == [] and kinds(report, "no_place") == []


def test_stalled_rank_is_not_declared_dead_and_healthy_run_never_resets(tmp_path):
    report = regatta_local(tmp_path, "digits", "--hosts", "2", "--steps", "600",
                           "--commit-every", str(K), "--pause", "2@300:10", timeout=300)
    assert report["exit_code"] == 0
    assert (report["final_step"], report["final_world_size"]) == (600, 2)
    for kind in ("failure", "peer_lost", "restore", "reset"):
        assert kinds(report, kind) == [], kind
    assert len(kinds(report, "sync")) == 2     # the initial sync of each worker only
    commits = [e for e in kinds(report, "commit") if e["rank"] == 0]
    gaps = [b["wall_time"] - a["wall_time"] for a, b in zip(commits, commits[1:])]
    assert max(gaps) >= 10     # the stall really happened
    # ...and was reported as a stall of that host, once, then cleared when it moved on.
    (stall,) = kinds(report, "stall")
    (cleared,) = kinds(report, "stall_cleared")
    assert stall["target"] == cleared["target"] == "127.0.0.3"
    assert stall["reason"] == "no progress" and stall["silent_s"] >= 5
    # Paused 10 s right after its commit at step 300, declared after 5 s silent (its last
    # heartbeat came a step before that commit), cleared once it moved on.
    (paused,) = [e["wall_time"] for e in kinds(report, "commit")
                 if e["host"] == "127.0.0.3" and e["step"] == 300]
    assert stall["step"] == 300
    assert paused + 4.5 <= stall["wall_time"] < paused + 10 <= cleared["wall_time"] < paused + 16


def _progress(run_dir):
    try:
        return int((run_dir / "progress").read_text().split()[0])
    except (FileNotFoundError, ValueError, IndexError):
        return 0


def test_whole_job_restart_resumes_from_disk_checkpoint(tmp_path):
    """A launch is a new run; ``--resume auto`` continues the one whose checkpoint is in
    the run's folder, under its run id."""
    run_dir = tmp_path / "run"
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", PYTHON, "-m", "jobs.digits",
           "--run-dir", str(run_dir), "--steps", "300", "--commit-every", "10",
           "--checkpoint-every", "2", "--db", str(tmp_path / "m.db"), "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    try:
        while _progress(run_dir) < 150:
            assert job.poll() is None and time.monotonic() < deadline, "job ended or stalled early"
            time.sleep(0.05)
    finally:
        kill_tree(job.pid)      # the whole job, every rank, at once
        job.wait()
    saved = torch.load(run_dir / "checkpoint" / "state.pt", weights_only=False)
    # every 20 steps, written in the background: killed at 150, the one of step 140 may
    # still have been in flight
    assert saved["step"] % 20 == 0 and 120 <= saved["step"] < 300
    done = subprocess.run(cmd + ["--resume", "auto"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    resumes = [e for e in read_events(run_dir) if e["kind"] == "resume"]
    assert len(resumes) == 1 and resumes[0]["step"] == saved["step"]
    assert resumes[0]["run_id"] == saved["run_id"]
    store = Store(str(tmp_path / "m.db"))
    runs = store.runs()
    store.close()
    assert [(r["id"], r["status"]) for r in runs] == [(saved["run_id"], "finished")]
    result = json.loads((run_dir / "result.json").read_text())
    assert result["step"] == 300
    first_after = min(e["step"] for e in read_events(run_dir)
                      if e["kind"] == "commit" and e["wall_time"] > resumes[0]["wall_time"])
    assert first_after == saved["step"] + 10
    again = subprocess.run(cmd[:10] + ["--steps", "20", "--db", str(tmp_path / "m.db"), "--no-progress"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    store = Store(str(tmp_path / "m.db"))
    runs = {r["id"]: r for r in store.runs()}
    store.close()
    assert len(runs) == 2 and all(r["status"] == "finished" for r in runs.values())
    new = next(r for i, r in runs.items() if i != saved["run_id"])
    assert new["last_step"] == 20       # a new launch starts at step 0, not from the checkpoint


def test_auto_commit_interval_is_chosen_and_shared(tmp_path):
    report = regatta_local(tmp_path, "digits", "--hosts", "2", "--steps", "400",
                           "--commit-every", "auto", "--kill", "1@250")
    assert report["exit_code"] == 0 and report["final_step"] == 400
    choices = kinds(report, "commit_interval")
    assert choices and all(c["rank"] == 0 for c in choices)
    first = choices[0]
    expected = max(round((2 * first["commit_cost_s"] * first["mtbr_s"]) ** 0.5 / first["step_time_s"]),
                   -(-first["commit_cost_s"] // (0.01 * first["step_time_s"])))
    assert first["interval"] == min(10_000, int(expected))
    # Both ranks committed at exactly the same steps until the failure (bounded by the
    # restore: the survivor records a commit the victim made just before dying a little
    # after the victim's kill) ...
    (restore,) = kinds(report, "restore")
    steps = {}
    for e in kinds(report, "commit"):
        if e["wall_time"] < restore["wall_time"]:
            steps.setdefault(e["host"], []).append(e["step"])
    assert len(steps) == 2 and len({tuple(v) for v in steps.values()}) == 1
    # ... and the survivor went on from its live state at the kill's step, past the last
    # of them (a failure no longer costs the steps since the commit).
    assert (restore["step"], restore["steps_redone"]) == (250, 0)
    assert restore["step"] >= max(next(iter(steps.values())))
