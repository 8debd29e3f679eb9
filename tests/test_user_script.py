"""A user's own script (examples/files_cnn.py: file-backed Dataset, DataLoader with two
workers, AdamW + cosine schedule, clipping, two accumulation microsteps) under horovodrun
on three simulated hosts, one SIGKILLed: nothing of jobs/ involved."""
import json
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from sqlalchemy import select

import browsing
from browsing import layout, trace, trace_names
from conftest import PYTHON, ROOT, kinds, regatta_local, run
from elastic.launch.loopback import host_name
from monitor.models import StepMetric
from monitor.store import Store

WORKER = ROOT / "tests" / "workers" / "files_cnn_worker.py"
STEPS, KILL_AT, BATCH, FILES, EVAL_EVERY = 60, 33, 32, 600, 20


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return tmp_path_factory.mktemp("digit-files")


@contextmanager
def watching():
    """The last wall time each process of a nested PID namespace (the launch's, from
    `unshare --pid`) was seen alive, by its pid in that namespace (the pid the workers
    record), polled every 20 ms from outside."""
    alive: dict[int, float] = {}
    done = threading.Event()

    def poll() -> None:
        while not done.wait(0.02):
            now = time.time()
            for proc in Path("/proc").glob("[0-9]*"):
                try:
                    status = dict(line.split(":", 1) for line in (proc / "status").read_text().splitlines())
                except (OSError, ValueError):   # gone between the listing and the read
                    continue
                pids = status.get("NSpid", "").split()
                if len(pids) > 1 and not status["State"].strip().startswith("Z"):
                    alive[int(pids[-1])] = now
    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield alive
    finally:
        done.set()
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def watched_run(tmp_path_factory, files):
    """The run's directory, its report, when each of its processes was last seen alive
    and when the launcher returned."""
    tmp = tmp_path_factory.mktemp("user-script")
    with watching() as seen:
        report = regatta_local(tmp, str(WORKER), "--hosts", "3", "--steps", str(STEPS),
                               "--commit-every", "10", "--kill", f"2@{KILL_AT}", timeout=300,
                               job_args=["--db", str(tmp / "m.db"), "--eval-every", str(EVAL_EVERY),
                                         "--set", f"data.folder={files}",
                                         "--set", f"probe.out={tmp / 'probe'}"])
        ended = time.time()
        time.sleep(0.2)   # polls after the run: what is still alive then outlived it
    return tmp, report, seen, ended


@pytest.fixture(scope="module")
def kill_run(watched_run):
    return watched_run[:2]


def test_finishes_on_the_survivors(kill_run):
    tmp, report = kill_run
    assert report["exit_code"] == 0 and report["final_step"] == STEPS
    assert report["final_world_size"] == 2 and report["metrics"]["accuracy"] > 0.5
    # a script of its own on the CPU, no cycle named: Regatta's 20 ms, woken by every
    # queued tensor (tools/horovod-wake-on-enqueue.patch), Horovod's fusion off, in every worker
    assert {(e["horovod_cycle_ms"], e["horovod_wakes"], e["horovod_fusion_bytes"])
            for e in kinds(report, "start")} == {(20.0, True, 0)}
    assert all(e["keeps_freed_memory"] for e in kinds(report, "start"))   # runtime/memory.py
    # the survivors go on from their live state at the kill's step: nothing redone (a
    # survivor restarted in place, seen on a loaded machine, takes it from the other)
    (restore,) = {(e["step"], e["steps_redone"]) for e in kinds(report, "restore") if not e.get("in_place")}
    assert restore == (KILL_AT, 0)
    # Loader workers cost the recovery nothing: 0.2-0.4 s here, bench_recovery --data
    # loader holds the figure (a dead rank's workers held its pipes open 5 s before).
    (change,) = report["changes"]
    assert change["first_step_done_s"] < 2.5


def test_loader_workers_go_with_their_rank_and_survive_a_reset(watched_run):
    """Each rank's two DataLoader workers (as the user's worker_init_fn recorded them):
    the killed rank's gone with it (not 5 s later, when torch's own watchdog looks), the
    survivors' the same processes before and after the reset, none outliving the run."""
    tmp, report, alive, ended = watched_run
    trainers = {int(path.stem.split("-")[1]) for path in (tmp / "probe").glob("ids-*.jsonl")}
    workers = defaultdict(list)
    for line in (tmp / "probe" / "loader-workers.jsonl").read_text().splitlines():
        started = json.loads(line)
        workers[started["rank_pid"]].append(started["pid"])
    assert len(trainers) == 3
    assert {t: len(set(w)) for t, w in workers.items()} == {t: 2 for t in trainers}   # never restarted
    (kill,) = kinds(report, "kill_injected")
    (change,) = report["changes"]
    resumed = change["wall_time"] + change["first_step_done_s"]
    assert kill["pid"] in trainers and all(w in alive for ws in workers.values() for w in ws)
    assert max(alive[w] for w in workers[kill["pid"]]) < kill["wall_time"] + 2.0
    assert min(alive[w] for t, ws in workers.items() if t != kill["pid"] for w in ws) > resumed
    assert [p for p, seen in alive.items() if seen > ended] == []     # nothing outlived the run


def test_every_sample_of_every_epoch_is_consumed_exactly_once(kill_run):
    tmp, report = kill_run
    records = [json.loads(line) for path in (tmp / "probe").glob("ids-*.jsonl")
               for line in path.read_text().splitlines()]
    latest = defaultdict(int)           # a step redone after the restore counts as redone
    for r in records:
        latest[r["step"]] = max(latest[r["step"]], r["generation"])
    taken = defaultdict(list)
    for r in records:
        if r["generation"] == latest[r["step"]]:
            taken[r["step"]] += r["ids"]
    assert sorted(taken) == list(range(STEPS))
    # the step the kill interrupted is done again on the new world, and none before it
    assert min(r["step"] for r in records if r["generation"] == 1) == KILL_AT
    order = [i for step in range(STEPS) for i in sorted(taken[step])]
    epochs = len(order) // FILES
    assert epochs >= 3
    for epoch in range(epochs):
        assert sorted(order[epoch * FILES:(epoch + 1) * FILES]) == list(range(FILES)), epoch


def test_survivors_go_on_with_one_optimizer_and_scheduler_state(kill_run):
    tmp, report = kill_run
    failed = report["changes"][0]["wall_time"]
    commits = {e["host"]: e for e in kinds(report, "commit") if e["wall_time"] < failed and e["step"] == 30}
    restores = kinds(report, "restore")
    assert len(restores) == 2
    # The survivors agree in the sync after the reset that their live states are one: the
    # state digest covers model, AdamW moments, cosine schedule, cursor.
    synced = [e for e in kinds(report, "sync") if e["wall_time"] > failed]
    assert {e["host"] for e in synced} == {e["host"] for e in restores}
    assert {(e["source"], e["from_step"]) for e in synced} == {("live", KILL_AT)}
    (state,) = {e["state_hash"] for e in synced}
    assert state not in {e["state_hash"] for e in commits.values()}   # three steps on from it


def test_first_steps_gradients_equal_one_process(kill_run, files, tmp_path):
    tmp, report = kill_run
    run([PYTHON, str(WORKER), "--steps", "2", "--run-dir", str(tmp_path / "run"),
         "--db", str(tmp_path / "m.db"), "--no-progress", "--eval-every", "0",
         "--set", f"data.folder={files}", "--set", f"probe.out={tmp_path / 'probe'}"], timeout=120)
    for step in (0, 1):
        reference = torch.load(tmp_path / "probe" / f"grads-step{step}.pt")
        distributed = torch.load(tmp / "probe" / f"grads-step{step}.pt")
        assert reference.keys() == distributed.keys()
        for name, grad in reference.items():
            # Summation order differs (3 ranks x 2 microsteps vs one batch) and AdamW's
            # normalised step amplifies that in step 1: 1e-4 of each tensor's scale. A wrong
            # share, divisor or missing microstep is off by far more.
            floor = 1e-4 * grad.abs().max().item()
            torch.testing.assert_close(distributed[name], grad, rtol=1e-4, atol=floor,
                                       msg=lambda m: f"step {step} {name}: {m}")


# -- the same run in a browser: its id comes from a script path (issue 42) -----------------
TOKEN = "user-script-t0ken"


@pytest.fixture(scope="module")
def server(kill_run, tmp_path_factory):
    tmp, _ = kill_run
    with browsing.serving(str(tmp / "m.db"), str(tmp_path_factory.mktemp("spool")),
                          ingest_token=TOKEN) as url:
        yield url


def test_run_page_of_a_script_launched_by_path(page, server, kill_run, tmp_path):
    """Runs list -> the run's page (step rows, the failure marker, the evaluation chart),
    its JSON export, an edit and, last, its deletion: all by clicks, for the id a script
    path gave. (This deletes the run: it is the module's last test.)"""
    tmp, report = kill_run
    store = Store(str(tmp / "m.db"))
    try:
        (run_id,) = [r["id"] for r in store.runs()]
        assert run_id.startswith("files_cnn_worker-local-") and "/" not in run_id
        page.goto(server + "/")
        page.locator("#runs a", has_text=run_id).click()
        page.wait_for_url("**/runs/" + run_id)
        hosts = [host_name(i) for i in range(3)]
        trace(page, "chart-steptime", f"{hosts[0]}:0")
        assert {n.split(":")[0] for n in trace_names(page, "chart-steptime") if n != "events"} == set(hosts)
        labels = [a["text"] for a in layout(page, "chart-steptime")["annotations"]]
        assert f"✖ {hosts[1]}" in labels                      # --kill 2@..: the second host
        page.locator('[data-metric="eval/accuracy"]').wait_for()
        evaluated = page.evaluate("() => Array.from(document.querySelector("
                                  "'[data-metric=\"eval/accuracy\"]').data[0].x)")
        assert evaluated == list(range(EVAL_EVERY, STEPS, EVAL_EVERY))
        # The loader's re-warm after the reset, apart from compute, in the store and drawn.
        with store.engine.connect() as conn:
            rows = conn.execute(select(StepMetric).order_by(StepMetric.wall_time)).all()
        first = {}
        for row in rows:
            if row.world_size == 2:
                first.setdefault(row.host, row)
        assert sorted(first) == sorted(h for h in hosts if h != hosts[1])
        for host, row in first.items():
            assert 0 < row.data_time and row.data_time + row.compute_time <= row.step_time * 1.0001
            # the first step at 2 is the one the kill interrupted, done once: the survivors
            # went on from their live state, so no step before it was redone
            runs = [r.data_time for r in rows if (r.host, r.step) == (host, row.step)]
            assert row.step == KILL_AT + 1 and len(runs) == 1
            drawn = trace(page, "chart-datatime", f"{host}:0")
            assert drawn["y"][drawn["x"].index(row.step)] == pytest.approx(runs[0], rel=1e-9)
        browsing.shot(page, "user-script-run")

        with page.expect_download() as download:
            page.click("#export-json")
        exported = json.loads(Path(download.value.path()).read_text())
        assert {r["id"] for r in exported["runs"]} == {run_id}
        assert {s["run_id"] for s in exported["steps"]} == {run_id} and len(exported["steps"]) > STEPS

        page.evaluate(f"() => sessionStorage.setItem('regatta.token', '{TOKEN}')")
        page.fill("#manage textarea[name=notes]", "killed on purpose")
        page.click("#save-run")
        page.wait_for_function("() => document.getElementById('manage-status').textContent === 'saved'")
        assert store.run(run_id)["notes"] == "killed on purpose"

        page.once("dialog", lambda dialog: dialog.accept())
        page.click("#delete-run")
        page.wait_for_url(server + "/")
        assert store.runs() == [] and store.run(run_id) is None
    finally:
        store.close()
