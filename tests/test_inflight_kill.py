"""A worker SIGKILLed from outside while its gradient buckets are on the wire: a real
`horovodrun` elastic run (regatta local, 3 simulated hosts) of a communication-heavy MLP
(bench/mlp.py). The test watches the victim's socket writes (/proc/PID/io ``wchar``: Gloo
writes every byte it sends) and kills it once, within a step, more than one bucket's
worth has left it, a few random milliseconds later. The survivors then hold a step half
reduced (buckets launched, not all summed), which none of them applied: they go on from
their live state (dataparallel/live.py), moving nothing and redoing only the failed
step, and end where a run without the failure ends."""
import json
import os
import random
import signal
import subprocess
import time

import pytest
import torch

from conftest import BIN, ROOT, kill_tree, kinds, outside_pid, regatta_local
from elastic.dataparallel.state import FORMAT
from elastic.runtime import checkpoint
from elastic.launch.report import build_report
from elastic.runtime.events import read_events, read_progress

STEPS, EVERY, VICTIM = 24, 5, "127.0.0.4"
# 7 buckets of one 1536 x 1536 layer (9.4 MB) each and the head's; with 3 ranks a rank
# writes 4/3 of a bucket per bucket, so 16 MiB written means the first bucket has left.
MODEL = ["--global-batch", "6", "--set", "model.width=1536", "--set", "train.bucket_mb=4"]
FIRST_BUCKET_SENT = 16 << 20


def events_of(run_dir, host):
    """``host``'s events so far (read_events skips a line still being written)."""
    return [e for e in read_events(run_dir) if e["host"] == host]


def written(pid: int) -> int:
    with open(f"/proc/{pid}/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("wchar:"))


def kill_while_sending(run_dir, proc, rng) -> dict:
    """Once the run is steady, SIGKILL the victim a random 0-10 ms after, within one step
    (counted from rank 0's progress), it has written ``FIRST_BUCKET_SENT`` bytes."""
    deadline, step, start = time.monotonic() + 150, None, None
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "run ended or stalled early"
        progress = read_progress(run_dir)
        if progress and progress[0] >= 8 and progress[0] != step:
            if start is None:
                (start,) = [e for e in events_of(run_dir, VICTIM) if e["kind"] == "start"]
                pid = outside_pid(VICTIM, start["pid"])
            step, base = progress[0], written(pid)
        if step is not None and written(pid) - base >= FIRST_BUCKET_SENT:
            time.sleep(rng.uniform(0, 0.01))
            now = read_progress(run_dir)
            if now and now[0] != step:   # a late look: those bytes were the next step's
                step = None
                continue
            os.kill(pid, signal.SIGKILL)
            return {"after_step": step, "wall_time": time.time()}
        time.sleep(0.0005)


def mlp_args(tmp, sums: str) -> list[str]:
    return ["--db", str(tmp / "m.db"), *MODEL, "--set", f"train.gradient_sums={sums}"]


@pytest.fixture(scope="module", params=["horovod", "auto"])
def inflight(request, tmp_path_factory):
    """The buckets summed by Horovod, or as ``train.gradient_sums = "auto"`` sums this
    model's 8 buckets: over a torch.distributed Gloo group, whose sockets the survivors must
    shut too (dataparallel/gloo_sums.py)."""
    tmp = tmp_path_factory.mktemp("inflight")
    run_dir = tmp / "run"
    cmd = [str(BIN / "regatta"), "local", "mlp", "--module", "bench.mlp", "--hosts", "3",
           "--steps", str(STEPS), "--commit-every", str(EVERY), "--run-dir", str(run_dir),
           "--timeout", "240", "--", *mlp_args(tmp, request.param)]
    env = {**os.environ, "REGATTA_AUDIT": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        kill = kill_while_sending(run_dir, proc, random.Random())
        proc.wait(timeout=240)
    finally:
        kill_tree(proc.pid)
    return kill, build_report(run_dir, exit_code=proc.returncode), run_dir, request.param


def test_survivors_failed_with_buckets_in_flight(inflight):
    kill, report, _, setting = inflight
    sums = {"horovod": "horovod", "auto": "gloo"}[setting]
    assert {e["gradient_sums"] for e in kinds(report, "ready")} == {sums}
    print(f"killed {VICTIM} while sending in the step after {kill['after_step']}")
    failed = [e for e in kinds(report, "reduce_failed") if e["host"] != VICTIM]
    # A survivor whose reduction outlived the sever (Horovod's loop waiting on a connection
    # Gloo had closed: CI saw one of the two) is restarted in place from the step instead,
    # recording its restore as it leaves; at least one survivor's step raised.
    in_place = {e["host"] for e in kinds(report, "restore") if e.get("in_place")}
    assert failed and {e["host"] for e in failed} | in_place == {"127.0.0.2", "127.0.0.3"}
    for event in failed:
        print(f"{event['host']}: step {event['step']}, {event['launched']} of {event['buckets']} "
              f"buckets sent, {event['summed']} summed")
        assert event["buckets"] >= 7
        assert event["step"] == kill["after_step"]    # rank 0's progress: steps done
        assert event["launched"] >= 1 and event["summed"] < event["buckets"]
        # The sum that raised was the one configured (torch's Gloo group, or Horovod's), or
        # the lifeline's news of the death came first and backward stopped at the next
        # gradient, with buckets still unsent.
        if event["error"].startswith("a peer of this world died during the step"):
            assert event["launched"] < event["buckets"], event
        else:
            assert event["error"].startswith("gradient sums: ") == (sums == "gloo"), event["error"]
    # How many buckets the survivors had summed is printed, not asserted: 16 MiB written by
    # the victim is its share of the first bucket sent, but whether the survivors finish
    # summing it depends on what was still in the sockets when it died (a process killed
    # with unread input resets its connections). CI saw 0 on a loaded machine.


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same job without the failure: its final state."""
    tmp = tmp_path_factory.mktemp("inflight-reference")
    report = regatta_local(tmp, "mlp", "--module", "bench.mlp", "--hosts", "3", "--steps", str(STEPS),
                           "--commit-every", str(EVERY), job_args=mlp_args(tmp, "horovod"),
                           env={"OMP_NUM_THREADS": "1"})
    assert report["exit_code"] == 0 and not report["changes"]
    return checkpoint.load(tmp / "run" / "checkpoint" / "state.pt", expect=FORMAT)


def test_survivors_go_on_from_their_live_state(inflight):
    kill, report, _, _ = inflight
    restores = kinds(report, "restore")
    assert {e["host"] for e in restores} == {"127.0.0.2", "127.0.0.3"}
    # No rollback: each survivor stays at the step the kill interrupted (nothing redone
    # but the half-reduced step, which was never counted), even between commits.
    # (A survivor stuck in the step's collective is restarted in place with its commit only;
    # its replacement's restore rolls back, and its sync takes the others' live state.)
    assert {(e["step"], e["from_step"], e["steps_redone"]) for e in restores if not e.get("in_place")} == {
        (kill["after_step"], kill["after_step"], 0)}
    synced = [e for e in kinds(report, "sync") if e["wall_time"] > restores[0]["wall_time"]]
    assert {e["host"] for e in synced} >= {"127.0.0.2", "127.0.0.3"}
    for event in synced:   # (a survivor restarted in place syncs as a newcomer, from the other)
        assert event["source"] == "live" and event["step"] == kill["after_step"]
    # the two survivors' whole states (model, Adam's moments, step, cursor) are one
    assert len({(e["param_hash"], e["optimizer_hash"], e["state_hash"]) for e in synced}) == 1
    went_on = [e for e in kinds(report, "recovered_live") if e["wall_time"] > restores[0]["wall_time"]]
    in_place = {e["host"] for e in restores if e.get("in_place")}
    assert went_on and all(e["steps_redone"] == 0 for e in went_on)
    if not in_place:   # the common case: not a byte moved between the survivors
        assert {e["moved_bytes"] for e in went_on} == {0}
    assert not kinds(report, "restored_commit") and not kinds(report, "state_lost")


def test_the_failure_changed_nothing_the_run_computes(inflight, reference):
    """The survivors' final state against the run without a failure: the same global
    batches summed over 2 ranks instead of 3, so equal up to float rounding (a relative
    1e-9 to 3e-8 per tensor, 2026-12-06). A step skipped or applied twice moves every
    weight by about Adam's learning rate, some 7 % of its size at this width."""
    _, _, run_dir, _ = inflight
    final = checkpoint.load(run_dir / "checkpoint" / "state.pt", expect=FORMAT)
    assert (final["step"], final["epoch"], final["consumed"]) == (
        reference["step"], reference["epoch"], reference["consumed"])
    for name, want in reference["objects"]["model"].items():
        got = final["objects"]["model"][name]
        assert torch.linalg.norm(got - want) <= 1e-4 * torch.linalg.norm(want), name


def test_run_finishes_on_the_survivors_with_one_model(inflight):
    _, report, run_dir, _ = inflight
    assert report["exit_code"] == 0
    assert (report["final_step"], report["final_world_size"]) == (STEPS, 2)
    finals = [json.loads(p.read_text()) for p in (run_dir / "final").glob("*.json")]
    assert len(finals) == 2 and len({f["param_hash"] for f in finals}) == 1
