"""Regatta on a real Slurm cluster (tests/slurm_cluster.py: munged, slurmctld, a slurmd
per simulated node, each node its own network namespace), with Slurm's own commands:
examples/slurm/elastic.sbatch trains through a drained node and a SIGKILLed worker; a
scancel stops it with a checkpoint, and the job submitted again goes on from it;
examples/slurm/fixed.sbatch runs a fixed world under mpirun inside the allocation."""
import json
import sqlite3

import pytest

import capabilities
from conftest import PYTHON, ROOT, run

UNAVAILABLE = capabilities.CHECKS["slurm"][0]() or capabilities.CHECKS["netns"][0]()
pytestmark = pytest.mark.skipif(bool(UNAVAILABLE), reason=UNAVAILABLE)
HUB = ["unshare", "--net", "--pid", "--mount", "--fork", "--mount-proc", "--kill-child",
       "env", "REGATTA_PRIVATE_NETWORK=1"]


def scenario(name: str, workdir) -> dict:
    run([*HUB, PYTHON, str(ROOT / "tests" / "slurm_cluster.py"), name, str(workdir)], timeout=420)
    observed = json.loads((workdir / "observed.json").read_text())
    assert "error" not in observed, observed.get("error")
    return observed


def events(db, *kinds) -> list[tuple]:
    marks = ",".join("?" * len(kinds))
    return sqlite3.connect(db).execute(
        f"select kind, step, host, wall_time, detail from event where kind in ({marks}) "
        f"order by wall_time", kinds).fetchall()


@pytest.fixture(scope="module")
def drained(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("slurm-drain")
    return workdir, scenario("drain_and_kill", workdir)


@pytest.fixture(scope="module")
def cancelled(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("slurm-cancel")
    return workdir, scenario("scancel_and_resume", workdir)


def test_sbatch_trains_to_the_end_through_a_drain_and_a_kill(drained):
    workdir, seen = drained
    assert seen["state"] == {"JobState": "COMPLETED", "ExitCode": "0:0"}
    # the worker was started by its shim's own agent (a fork of the shim): its death is
    # marked for the survivors, whatever instant it strikes
    assert seen["started_by"][1:3] == ["-m", "elastic.launch.shim"], seen["started_by"]
    result = json.loads((workdir / "run" / "result.json").read_text())
    assert result["step"] == 360 and result["world_size"] == 1 and result["metrics"]["accuracy"] > 0.9
    db = workdir / "m.db"
    assert sqlite3.connect(db).execute("select status from run").fetchall() == [("finished",)]
    changes = events(db, "host_removed", "failure")
    # the drain: sim-host2 leaves as a removed host, no failure, nothing redone
    (kind, step, _, when, detail), *rest = changes
    assert kind == "host_removed" and json.loads(detail)["target"] == "sim-host2"
    assert seen["drained_at"] < when < seen["drained_at"] + 5
    # the SIGKILL: a failure of sim-host1, recovered from the survivor's live state
    (kind, step, _, when, detail), = rest
    assert kind == "failure" and json.loads(detail)["target"] == "sim-host1"
    assert when < seen["killed_at"] + 2
    recovered = [e for e in events(db, "recovered_live", "restored_commit", "restored_checkpoint")
                 if e[3] > seen["killed_at"]]
    assert [e[0] for e in recovered] == ["recovered_live"]
    resumed = [e for e in events(db, "resumed") if e[3] > seen["killed_at"]]
    assert resumed and resumed[0][3] - seen["killed_at"] < 3.0


def test_scancel_stops_every_process_with_a_checkpoint_and_a_resubmission_goes_on(cancelled):
    workdir, seen = cancelled
    assert seen["gone_s"] < 10 and seen["left"] == []
    db = workdir / "m.db"
    stopped = events(db, "run_stopped")
    assert len({e[1] for e in stopped}) == 1 and len(stopped) == 3   # every rank, one step
    step = stopped[0][1]
    checkpoints = [e for e in events(db, "checkpoint") if e[3] <= stopped[-1][3]]
    assert checkpoints[-1][1] == step
    assert seen["status_after_cancel"] == "stopped"
    (resume,) = events(db, "resume")
    assert resume[1] == step
    assert seen["state"] == {"JobState": "COMPLETED", "ExitCode": "0:0"}
    result = json.loads((workdir / "run" / "result.json").read_text())
    assert result["step"] == seen["stopped_progress"] + 30
    assert sqlite3.connect(db).execute("select status from run").fetchall() == [("finished",)]


def test_the_fixed_world_script_runs_one_rank_per_node_under_mpirun(tmp_path):
    seen = scenario("fixed_world", tmp_path)
    assert seen["state"] == {"JobState": "COMPLETED", "ExitCode": "0:0"}
    finals = [json.loads(p.read_text()) for p in (tmp_path / "run" / "final").glob("*.json")]
    assert sorted(f["host"] for f in finals) == ["sim-host0", "sim-host1"]
    assert {f["world_size"] for f in finals} == {2} and {f["step"] for f in finals} == {60}
    assert len({f["param_hash"] for f in finals}) == 1
