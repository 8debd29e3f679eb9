"""Elastic pipeline (dp x pp) under a real `horovodrun` on simulated hosts: a SIGKILLed
worker leaves the survivors under a new plan with the committed model reassembled bit
for bit from memory (replicas, or buddy copies with dp = 1), and added hosts grow the
grid; two simultaneous failures recover from memory whenever every stage keeps a copy
among the survivors, from disk when one does not. Also the pure pieces of shards.py
(placement and covering, shared with data parallelism, are in test_shards.py)."""
from __future__ import annotations

import json
import random
import threading
import time
from collections import defaultdict

import pytest
import torch

from conftest import committed, kinds, regatta_local, whole_model_digest
from outside import LocalRun, held_at, pair_to_kill
from elastic.pipeline.shards import exchange, model_digest, tensor_digests
from elastic.runtime.shards import buddies, kept_by

SMALL = ["--global-batch", "24", "--microbatches", "2", "--set", "model.dim=32",
         "--set", "model.layers=2", "--set", "model.context=16"]     # 4 children


# -- pure pieces ---------------------------------------------------------------------------
def test_a_replacement_takes_over_every_commit_its_predecessor_held(tmp_path):
    """A pipeline rank restarted in place (its Gloo stuck or aborted while the world
    re-forms) hands its commits to the worker that replaces it: both generations, every
    range it held (its stage, its buddy's copy), bit for bit, with the plan and layer costs."""
    from elastic.pipeline.elastic_state import ElasticPipeline
    from elastic.pipeline.planner import LayerCosts
    from elastic.pipeline.rebalance import export_stage
    torch.manual_seed(0)
    stages = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)]
    shards = []
    for stage in stages:
        optimizer = torch.optim.Adam(stage.parameters())
        stage(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        shards.append(export_stage(stage, optimizer))
    leaving = ElasticPipeline(runtime=None, engine=None)
    leaving.gens = [{"step": 40, "epoch": 1, "consumed": 96, "extent": 2, "held": {(0, 1): shards[0], (1, 2): shards[1]}},
                    {"step": 35, "epoch": 1, "consumed": 72, "extent": 2, "held": {(0, 1): shards[0]}}]
    leaving.buddy, leaving.last_plan = [1, 0], {"pp": 2, "dp": 1, "stages": [[0, 1], [1, 2]]}
    leaving.costs = LayerCosts(seconds=(0.1, 0.2), param_bytes=(80, 40), out_bytes=(48, 24), batch=3,
                               names=("a", "b"))
    leaving.write_handoff(tmp_path / "handoff.pt")
    replacement = ElasticPipeline(runtime=None, engine=None)
    replacement.load_handoff(tmp_path / "handoff.pt")
    assert replacement.step == 40 and replacement.run is None
    assert (replacement.buddy, replacement.last_plan, replacement.costs) == \
        (leaving.buddy, leaving.last_plan, leaving.costs)
    for mine, theirs in zip(replacement.gens, leaving.gens, strict=True):
        assert {k: mine[k] for k in ("step", "epoch", "consumed", "extent")} == \
            {k: theirs[k] for k in ("step", "epoch", "consumed", "extent")}
        assert mine["held"].keys() == theirs["held"].keys()
        for rng, shard in theirs["held"].items():
            assert tensor_digests(mine["held"][rng]["model"]) == tensor_digests(shard["model"])
            for name, moments in shard["optimizer"].items():
                assert tensor_digests(mine["held"][rng]["optimizer"][name]) == tensor_digests(moments)


def test_model_digest_does_not_depend_on_the_stage_split():
    torch.manual_seed(0)
    state = {f"{i}.weight": torch.randn(3, 3) for i in range(4)}
    whole = model_digest(tensor_digests(state))
    halves = {**tensor_digests({k: state[k] for k in ("0.weight", "1.weight")}),
              **tensor_digests({k: state[k] for k in ("2.weight", "3.weight")})}
    assert model_digest(halves) == whole
    state["3.weight"][0, 0] += 1e-7
    assert model_digest(tensor_digests(state)) != whole


class Mailbox:
    """An in-process transport for a few threads: tagged point-to-point messages."""

    def __init__(self):
        self.boxes, self.ready = defaultdict(list), threading.Condition()

    def view(self, rank):
        box = self

        class Handle:
            def __init__(self, fn):
                self.fn = fn

            def wait(self):
                return self.fn()

        class View:
            def isend(self, tensor, peer, tag):
                with box.ready:
                    box.boxes[rank, peer, tag].append(tensor.clone())
                    box.ready.notify_all()
                return Handle(lambda: tensor)

            def irecv(self, tensor, peer, tag):
                def take():
                    with box.ready:
                        box.ready.wait_for(lambda: box.boxes[peer, rank, tag], timeout=10)
                        tensor.copy_(box.boxes[peer, rank, tag].pop(0))
                    return tensor
                return Handle(take)
        return View()


def test_buddy_exchange_in_a_cycle_does_not_deadlock():
    box, got = Mailbox(), {}
    ring = buddies(["a", "b", "c"])

    def rank(r):
        senders = kept_by(ring, r)[1:]
        got[r] = exchange(box.view(r), {"stage": r, "w": torch.full((2,), float(r))}, ring[r], senders)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert {r: [g["stage"] for g in got[r]] for r in range(3)} == {0: [2], 1: [0], 2: [1]}
    assert torch.equal(got[0][0]["w"], torch.full((2,), 2.0))


# -- real horovodrun runs --------------------------------------------------------------------
def run_local(tmp, *args, job_args):
    return regatta_local(tmp, "charlm", *args, timeout=360,
                         job_args=[*job_args, "--db", str(tmp / "m.db")])


def finals(tmp):
    return [json.loads(p.read_text()) for p in (tmp / "run" / "final").glob("*.json")]


KILL_RUN = ["--pp", "2", "--boundaries", "0,2", *SMALL]   # configured: left to the planner,
# measured layer costs on a busy machine could pick [0, 3] instead


@pytest.fixture(scope="module")
def kill_run(tmp_path_factory, unfailed_run):
    """pp 2 x dp 2, a worker killed at step 27 (commits every 5); and the same training
    without the failure, committed at every step, to compare the survivors' state with."""
    tmp = tmp_path_factory.mktemp("pipe_kill")
    report = run_local(tmp, "--hosts", "4", "--steps", "60", "--commit-every", "5",
                       "--kill", "2@27", job_args=KILL_RUN)
    return tmp, report, unfailed_run


@pytest.fixture(scope="module")
def unfailed_run(tmp_path_factory):
    reference = tmp_path_factory.mktemp("pipe_reference")
    return run_local(reference, "--hosts", "4", "--steps", "34", "--commit-every", "1",
                     job_args=KILL_RUN)


def test_kill_one_of_four_continues_on_three_under_a_new_plan(kill_run):
    tmp, report, _ = kill_run
    assert report["exit_code"] == 0
    assert (report["final_step"], report["final_world_size"]) == (60, 3)
    (failure,) = report["changes"]
    # every stage kept a live replica: no step since the commit at 25 is redone
    assert failure["size_after"] == 3 and failure["steps_redone"] == 0
    (replan,) = {json.dumps({k: e[k] for k in ("old", "new", "from_memory")})
                 for e in kinds(report, "replan")}
    replan = json.loads(replan)
    assert replan["old"] == {"pp": 2, "dp": 2, "stages": [[0, 2], [2, 4]]}
    assert replan["new"]["pp"] * replan["new"]["dp"] == 3 and replan["from_memory"]
    assert [s[0] for s in replan["new"]["stages"]][0] == 0 and replan["new"]["stages"][-1][1] == 4
    # Before the failure each rank held only its own stage (its replica holds the copy).
    held = {tuple(map(tuple, e["held"])) for e in kinds(report, "commit")
            if e["step"] == 25 and e["wall_time"] < failure["wall_time"]}
    assert held == {((0, 2),), ((2, 4),)}


def test_survivors_go_on_from_their_live_stages_bit_for_bit(kill_run):
    """No rollback: the survivors' live stages at step 27 make the model the run without
    the failure had at 27, and each survivor received only the children it lacked."""
    tmp, report, unfailed = kill_run
    failed = report["changes"][0]["wall_time"]
    synced = [e for e in kinds(report, "sync") if e["wall_time"] > failed]
    assert len(synced) == 3 and {e["step"] for e in synced} == {27}
    assert {(e["source"], e["recovery"]) for e in synced} == {("live", "recovered_live")}
    assert {e["param_hash"] for e in synced} == {committed(unfailed, 27, float("inf"))}
    assert len(kinds(report, "recovered_live")) == 3 and not kinds(report, "restored_commit")
    received = {e["host"]: e["received_bytes"] for e in synced}
    assert {e["host"]: e["moved_bytes"] for e in kinds(report, "recovered_live")} == received
    # What each survivor held live (its old stage) against what it builds now.
    old = {e["host"]: e["children"] for e in kinds(report, "sync") if e["wall_time"] < failed}
    for sync in synced:
        kept = old[sync["host"]][0] <= sync["children"][0] and sync["children"][1] <= old[sync["host"]][1]
        assert (sync["received_bytes"] == 0) == kept, (sync, old)
    assert any(e["received_bytes"] > 0 for e in synced)
    replans = kinds(report, "replan")
    assert len(replans) == 3 and all(e["from_memory"] and e["step"] == 27 for e in replans)
    resumed = [e for e in kinds(report, "resumed") if e["wall_time"] > failed]
    assert {e["step"] for e in resumed} == {28} and {e["size"] for e in resumed} == {3}


def test_a_kill_from_outside_mid_step_goes_on_from_the_most_advanced_live_stages(tmp_path, unfailed_run):
    """SIGKILL at a random instant of step 28 or 29: the survivors may have applied that
    step or not, some one and some the other (the update follows the step's last
    collective). They go on from the newest step whose live stages make a whole model,
    bit for bit the model the run without a failure had at that step."""
    report = run_local(tmp_path, "--hosts", "4", "--steps", "40", "--commit-every", "5",
                       "--sigkill", "2@27", job_args=KILL_RUN)
    assert report["exit_code"] == 0 and report["final_step"] == 40
    (strike,) = kinds(report, "fault_injected")
    synced = [e for e in kinds(report, "sync") if e["wall_time"] > strike["wall_time"]]
    assert len(synced) == 3
    (step,) = {e["step"] for e in synced}
    assert 27 <= step <= 31 and {e["source"] for e in synced} == {"live"}
    assert {e["recovery"] for e in synced} <= {"recovered_live", "adopted"}
    assert {e["param_hash"] for e in synced} == {committed(unfailed_run, step, float("inf"))}
    (failure,) = report["changes"]
    assert failure["steps_redone"] == 0


def test_training_continues_and_survivors_agree(kill_run):
    tmp, report, _ = kill_run
    failed = report["changes"][0]["wall_time"]
    losses = [(e["wall_time"] > failed, e["loss"]) for e in kinds(report, "commit")
              if e.get("loss") is not None and e["reason"] == "periodic"]
    before = [loss for after, loss in losses if not after]
    after = [loss for after, loss in losses if after]
    assert before and after and max(after) < before[0]
    assert report["metrics"]["test_loss"] < report["metrics"]["unigram_loss"]
    by_stage = defaultdict(set)
    for final in finals(tmp):
        by_stage[tuple(final["children"])].add(final["param_hash"])
    assert all(len(h) == 1 for h in by_stage.values()) and len(finals(tmp)) == 3


def test_dp1_pipeline_recovers_from_buddy_copies(tmp_path):
    report = run_local(tmp_path, "--hosts", "3", "--steps", "40", "--commit-every", "5",
                       "--kill", "2@17", job_args=["--pp", "3", *SMALL])
    assert report["exit_code"] == 0
    assert (report["final_step"], report["final_world_size"]) == (40, 2)
    failed = report["changes"][0]["wall_time"]
    # Each rank held its own stage and its buddy's: 2 of 3 stages, never the whole model.
    held = [e["held"] for e in kinds(report, "commit") if e["step"] == 15 and e["wall_time"] < failed]
    assert held and all(len(h) == 2 for h in held)
    replans = kinds(report, "replan")
    assert replans and all(e["from_memory"] and e["old"]["pp"] == 3 for e in replans)
    # Stage 1's only live copy died: back to the commit, whose copy of it a buddy held.
    synced = [e for e in kinds(report, "sync") if e["wall_time"] > failed]
    assert {(e["recovery"], e["from_step"]) for e in synced} == {("restored_commit", 15)}
    assert {e["param_hash"] for e in synced} == {committed(report, 15, failed)}


def test_added_hosts_grow_the_grid_and_replicas_agree(tmp_path):
    # Training goes on while the added hosts start: they joined at step ~50 on an idle
    # machine, so 240 steps leave room for a busy one.
    report = run_local(tmp_path, "--hosts", "2", "--steps", "240", "--commit-every", "5",
                       "--add", "@10", "--add", "@10",
                       job_args=["--pp", "2", "--boundaries", "0,2", *SMALL])
    assert report["exit_code"] == 0
    assert (report["final_step"], report["final_world_size"]) == (240, 4)
    # two additions at one step, one re-forming: each change's world after is 4
    assert [(c["kind"], c["size_after"]) for c in report["changes"]] == [("host_added", 4)] * 2
    grown = [e for e in kinds(report, "replan") if e["size"] == 4]
    assert grown and grown[0]["old"]["dp"] == 1 and grown[0]["new"] == \
        {"pp": 2, "dp": 2, "stages": [[0, 2], [2, 4]]}
    membership = [e for e in kinds(report, "commit") if e["reason"] == "membership"]
    step = membership[0]["step"]
    synced = [e for e in kinds(report, "sync") if e["size"] == 4]
    assert len(synced) == 4 and {e["step"] for e in synced} == {step}
    assert {e["param_hash"] for e in synced} == {membership[0]["param_hash"]}
    # The two first hosts keep their stages and receive nothing; each new one receives one.
    first = {e["host"] for e in kinds(report, "sync") if e["size"] == 2}
    assert len(first) == 2
    assert sorted((e["host"] in first, e["received_bytes"] > 0) for e in synced) == \
        [(False, True), (False, True), (True, False), (True, False)]
    by_stage = defaultdict(set)
    for final in finals(tmp_path):
        by_stage[tuple(final["children"])].add(final["param_hash"])
    assert by_stage.keys() == {(0, 2), (2, 4)} and all(len(h) == 1 for h in by_stage.values())


# -- two failures at once, from outside ------------------------------------------------------
TWO_LOST_STEPS = 100    # the kill comes from outside after step 15: room for a slow reaction


def lose_two_stages(tmp, leaves_a_copy: bool):
    """pp = 4, dp = 1 on 4 hosts: each rank holds its stage and its buddy's. Two workers
    SIGKILLed together, chosen from what each host held so that every stage keeps a copy
    (or one does not); a durable checkpoint exists either way."""
    with LocalRun(tmp, "charlm", "--hosts", "4", "--steps", str(TWO_LOST_STEPS),
                  "--commit-every", "5",
                  job_args=["--pp", "4", *SMALL, "--checkpoint-every", "1", "--db", str(tmp / "m.db")],
                  timeout=360) as run:
        held = run.wait_for(lambda ev: h if len(h := held_at(ev, 15)) == 4 else None,
                            "commit at step 15 on 4 hosts")
        victims = pair_to_kill(held, 4, leaves_a_copy)
        time.sleep(random.uniform(0, 0.2))
        killed_at = run.kill(victims)
        report = run.finish()
    return report, held, set(victims), killed_at


def test_two_failures_leaving_a_copy_of_every_stage_recover_from_memory(tmp_path):
    report, held, victims, killed_at = lose_two_stages(tmp_path, leaves_a_copy=True)
    assert (report["final_step"], report["final_world_size"]) == (TWO_LOST_STEPS, 2)
    survivors = set(held) - victims
    assert any(held[v][0] in [r for s in survivors for r in held[s][1:]] for v in victims)
    replans = [e for e in kinds(report, "replan") if e["wall_time"] > killed_at]
    assert {e["host"] for e in replans} == survivors and all(e["from_memory"] for e in replans)
    synced = [e for e in kinds(report, "sync") if e["wall_time"] > killed_at]
    assert synced and all(e["source"] == "memory" for e in synced)
    (step,) = {e["from_step"] for e in synced}
    first = min(e["wall_time"] for e in replans)
    assert {e["param_hash"] for e in synced} == {committed(report, step, first)}
    assert not kinds(report, "state_lost") and not kinds(report, "resume")
    # The tensors the ranks held make the model the audit's collective hashed (the check
    # committed() falls back on when a kill cut that collective short everywhere).
    at_15 = [e for e in kinds(report, "commit") if e["step"] == 15]
    assert len(at_15) == 4 and whole_model_digest(at_15) == at_15[0]["param_hash"]


def test_two_failures_taking_every_copy_of_a_stage_recover_from_disk(tmp_path):
    report, held, victims, killed_at = lose_two_stages(tmp_path, leaves_a_copy=False)
    assert (report["final_step"], report["final_world_size"]) == (TWO_LOST_STEPS, 2)
    survivors = set(held) - victims
    lost = [e for e in kinds(report, "state_lost") if e["wall_time"] > killed_at]
    assert {e["host"] for e in lost} == survivors
    resumed = [e for e in kinds(report, "resume") if e["wall_time"] > killed_at]
    assert {e["host"] for e in resumed} == survivors
    synced = [e for e in kinds(report, "sync") if e["wall_time"] > killed_at]
    assert synced and all(e["source"] == "checkpoint" for e in synced)
    (step,) = {e["from_step"] for e in synced}
    assert {e["step"] for e in resumed} == {step}
    first = min(e["wall_time"] for e in lost)
    assert {e["param_hash"] for e in synced} == {committed(report, step, first)}


def test_a_stage_with_buffers_is_not_gone_on_from_live():
    """A failed step's forward may have written BatchNorm's running statistics, and the
    pipeline does not take that back: such a stage recovers from its commit instead."""
    from types import SimpleNamespace
    from elastic.data.sampler import Cursor
    from elastic.pipeline.elastic_state import ElasticPipeline

    def live_of(module, recover_from="live"):
        state = ElasticPipeline.__new__(ElasticPipeline)
        state.runtime = SimpleNamespace(cfg=SimpleNamespace(recover_from=recover_from))
        state.run = SimpleNamespace(step=7, cursor=Cursor(0, 70), children=(0, 2),
                                    plan=SimpleNamespace(stages=[(0, 2), (2, 4)]),
                                    stage=SimpleNamespace(module=module),
                                    optimizer=torch.optim.SGD(module.parameters(), lr=0.1))
        return state._live_gen()

    plain = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    live = live_of(plain)
    assert (live["step"], live["extent"], list(live["held"])) == (7, 4, [(0, 2)])
    assert torch.equal(live["held"][(0, 2)]["model"]["0.weight"], plain[0].weight)
    assert live_of(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))) is None
    assert live_of(plain, recover_from="commit") is None
