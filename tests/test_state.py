"""Sharded data-parallel commits and background checkpoints with real processes.

Under a real `horovodrun` on 4 simulated hosts, two workers are SIGKILLed together from
outside at an instant of the test's choosing, the survivors told to go back to the commit
(``train.recover_from = "commit"``: what happens wherever no survivor holds a live state,
dataparallel/live.py; test_live_recovery.py covers the live path): when every share of the commit still has a
copy among the survivors (the victims' own shares only as their buddies' copies) the
state is reassembled from memory, parameters and optimizer state bit for bit the last
commit's; when one share has none, from the durable checkpoint. Under `mpirun`, the
final checkpoint is on disk when the job ends, and resuming from a corrupt one stops with
an error naming it while the previous checkpoint stays intact."""
from __future__ import annotations

import hashlib
import os
import random
import subprocess
import time

import pytest
import torch

from conftest import PYTHON, ROOT, committed, kinds
from outside import LocalRun, held_at, pair_to_kill

KILL_AFTER = 60     # the victims die some time after every host committed this step
STEPS = 400         # room for the kill to land long before the end on a busy machine


def lose_two(tmp, leaves_a_copy: bool, checkpoint_every: int):
    with LocalRun(tmp, "digits", "--hosts", "4", "--steps", str(STEPS), "--commit-every", "10",
                  job_args=["--db", str(tmp / "m.db"), "--checkpoint-every", str(checkpoint_every),
                            "--set", "train.recover_from=commit"],
                  timeout=300) as run:
        held = run.wait_for(lambda ev: h if len(h := held_at(ev, KILL_AFTER)) == 4 else None,
                            f"commit at step {KILL_AFTER} on 4 hosts")
        extent = next(e["state_bytes"] for e in run.events() if e["kind"] == "commit")
        victims = pair_to_kill(held, extent, leaves_a_copy)
        time.sleep(random.uniform(0, 0.3))
        killed_at = run.kill(victims)
        report = run.finish()
    return report, held, set(victims), killed_at


def hashes(event: dict) -> tuple:
    return event["param_hash"], event["optimizer_hash"]


@pytest.fixture(scope="module")
def from_memory(tmp_path_factory):
    # No durable checkpoint at all: a restore can only come from memory.
    return lose_two(tmp_path_factory.mktemp("two_lost"), leaves_a_copy=True, checkpoint_every=0)


def test_each_rank_commits_two_of_four_shares(from_memory):
    report, held, _, killed_at = from_memory
    commits = [e for e in kinds(report, "commit") if e["step"] == KILL_AFTER]
    assert len(commits) == 4 and {e["state_bytes"] for e in commits} == {commits[0]["state_bytes"]}
    total = commits[0]["state_bytes"]
    for e in commits:
        assert len(e["held"]) == 2 and abs(e["held_bytes"] - total / 2) <= 128
    own = {host: ranges[0] for host, ranges in held.items()}
    copies = {host: ranges[1] for host, ranges in held.items()}
    assert sorted(own.values()) == sorted(copies.values())      # every share twice, on two hosts
    assert all(own[h] != copies[h] for h in held)


def test_two_replicas_lost_restore_from_buddy_copies_bit_for_bit(from_memory):
    report, held, victims, killed_at = from_memory
    assert report["exit_code"] == 0
    assert (report["final_step"], report["final_world_size"]) == (STEPS, 2)
    survivors = set(held) - victims
    # The victims' own shares survived only as their buddies' copies.
    for victim in victims:
        assert held[victim][0] in [r for s in survivors for r in held[s][1:]]
    restores = [e for e in kinds(report, "restore") if e["wall_time"] > killed_at]
    assert {e["host"] for e in restores} == survivors and len({e["step"] for e in restores}) == 1
    step = restores[0]["step"]
    last = max(e["step"] for e in kinds(report, "commit")
               if e["host"] in survivors and e["wall_time"] < min(r["wall_time"] for r in restores))
    assert step == last and step >= KILL_AFTER
    synced = [e for e in kinds(report, "sync") if e["wall_time"] > killed_at]
    assert {e["host"] for e in synced} == survivors and {e["size"] for e in synced[-2:]} == {2}
    assert all(e["source"] == "memory" and e["from_step"] == step for e in synced)
    first = min(e["wall_time"] for e in restores)
    assert {hashes(e) for e in synced} == {committed(report, step, first, hashes)}
    assert not kinds(report, "state_lost") and not kinds(report, "resume")


def test_a_share_with_no_copy_left_comes_from_the_checkpoint(tmp_path):
    report, held, victims, killed_at = lose_two(tmp_path, leaves_a_copy=False, checkpoint_every=1)
    assert (report["final_step"], report["final_world_size"]) == (STEPS, 2)
    lost = [e for e in kinds(report, "state_lost") if e["wall_time"] > killed_at]
    assert {e["host"] for e in lost} == set(held) - victims
    synced = [e for e in kinds(report, "sync") if e["wall_time"] > killed_at]
    assert synced and all(e["source"] == "checkpoint" for e in synced)
    (step,) = {e["from_step"] for e in synced}
    # The newest checkpoint on disk when the new rank 0 reloaded it. The writer waits for
    # its own write in flight (recorded as it ends); another rank reads what is there: if
    # the writer was killed, maybe a checkpoint it finished but never recorded, the next
    # commit's; if not, maybe not yet the one it was writing.
    first = min(e["wall_time"] for e in synced)
    before = [e for e in kinds(report, "checkpoint") if e["wall_time"] < first]
    newest, (writer,) = max(e["step"] for e in before), {e["host"] for e in before}
    (reloader,) = {e["host"] for e in lost if e["rank"] == 0}
    if reloader == writer:
        assert step == newest
    else:
        assert step in ((newest, newest + 10) if writer in victims else (newest - 10, newest))
    assert {hashes(e) for e in synced} == {committed(report, step, first, hashes)}


def mpirun_digits(run_dir, *args):
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", PYTHON, "-m", "jobs.digits",
           "--run-dir", str(run_dir), "--commit-every", "10", "--checkpoint-every", "1",
           "--db", str(run_dir.parent / "m.db"), "--no-progress", *args]
    return subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=180)


def test_resume_from_a_corrupt_checkpoint_names_it_and_keeps_the_previous(tmp_path):
    run_dir = tmp_path / "run"
    done = mpirun_digits(run_dir, "--steps", "40")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    path, previous = run_dir / "checkpoint" / "state.pt", run_dir / "checkpoint" / "state.previous.pt"
    # The final checkpoint was written in the background and is complete at exit.
    assert torch.load(path, weights_only=True)["step"] == 40
    assert torch.load(previous, weights_only=True)["step"] == 30
    kept = hashlib.sha256(previous.read_bytes()).hexdigest()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(data)
    failed = mpirun_digits(run_dir, "--steps", "60", "--resume", "auto")
    assert failed.returncode != 0
    output = failed.stdout + failed.stderr
    assert f"checkpoint {path} is corrupt" in output and "CRC-32" in output
    assert f"the checkpoint before it is kept as {previous}" in output
    assert hashlib.sha256(previous.read_bytes()).hexdigest() == kept
    assert path.read_bytes() == bytes(data)
