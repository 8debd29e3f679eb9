"""Real runs through the store to a real browser (SQLite; the PostgreSQL matrix is
tests/test_browser.py's): the waitress server over the store two real trainings wrote,
Debian's chromium reading the run pages.

* A pp=2 x dp=2 charlm pipeline under horovodrun on 4 simulated hosts (`regatta local`),
  one host's stage 1.5x slower, another host SIGKILLed (issue 9): step rows per stage,
  host samples, the failure with its recovery phases, the re-plan with its old and new
  plan, and the straggler on the slowed host, in the store, the API and on the page.
* A single-process user script (tests/workers/log_worker.py) logging its own scalars with
  ``regatta.log`` from a callback, and its evaluation every 10 steps (issue 10): the
  values through the API and as one chart per name.

    .venv/bin/python -m pytest -q tests/test_browser_real_runs.py
"""
from __future__ import annotations

import json
import math
import urllib.parse
import urllib.request

import pytest

import browsing
from browsing import layout, trace, trace_names
from conftest import PYTHON, ROOT, run, regatta_local
from elastic.launch.loopback import host_name
from monitor.store import Store

HOSTS = [host_name(i) for i in range(4)]
KILLED, SLOWED = HOSTS[1], HOSTS[3]          # --kill 2@.. and --slow 4:..
# Late enough that the killed host's first samples reached the store (sampled 0.2 s after
# its start, sent within the sink's 1 s): here 50 steps took under 2 s.
KILL_STEP, STEPS, COMMIT_EVERY = 57, 80, 5
SMALL = ["--global-batch", "24", "--microbatches", "2", "--set", "model.dim=32",
         "--set", "model.layers=2", "--set", "model.context=16"]   # as test_pipeline_elastic


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    return str(tmp_path_factory.mktemp("real-runs") / "m.db")


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory, store_path):
    """The pipeline run's id and the launcher's report."""
    tmp = tmp_path_factory.mktemp("pipe")
    report = regatta_local(tmp, "charlm", "--hosts", "4", "--steps", str(STEPS),
                           "--commit-every", str(COMMIT_EVERY), "--kill", f"2@{KILL_STEP}",
                           "--slow", "4:1.5", timeout=360,
                           job_args=["--pp", "2", "--boundaries", "0,2", *SMALL, "--db", store_path])
    assert report["exit_code"] == 0 and report["final_step"] == STEPS
    return _run_of(store_path, "charlm"), report


@pytest.fixture(scope="module")
def log_run(tmp_path_factory, store_path):
    """The logging script's run id and what it says it logged and evaluated."""
    tmp = tmp_path_factory.mktemp("log")
    out = tmp / "logged.json"
    run([PYTHON, str(ROOT / "tests" / "workers" / "log_worker.py"), str(out), "--steps", "30",
         "--db", store_path, "--run-dir", str(tmp / "run"), "--no-progress"], timeout=180)
    return _run_of(store_path, "log_worker"), json.loads(out.read_text())


def _run_of(db: str, job: str) -> str:
    store = Store(db)
    try:
        (found,) = [r["id"] for r in store.runs() if r["job"] == job]
    finally:
        store.close()
    return found


@pytest.fixture(scope="module")
def server(store_path, tmp_path_factory, pipeline_run, log_run):
    with browsing.serving(store_path, str(tmp_path_factory.mktemp("spool"))) as url:
        yield url


def api(server: str, path: str, **params) -> dict:
    query = "?" + urllib.parse.urlencode(params) if params else ""
    with urllib.request.urlopen(f"{server}/api/v1/{path}{query}", timeout=30) as response:
        return json.loads(response.read())


# -- the pipeline run: the store and the API ------------------------------------------------
def test_pipeline_run_in_the_store_and_the_api(server, pipeline_run):
    run_id, report = pipeline_run
    base = f"runs/{urllib.parse.quote(run_id)}"
    summary = api(server, base)
    assert (summary["status"], summary["launcher"], summary["last_step"]) == ("finished", "horovodrun", STEPS)
    assert summary["hosts"] == sorted(HOSTS)
    # Step rows per stage: both stages, each with its own busy time and bubble.
    stages = api(server, base + "/pipeline", max_points=1)["pipeline"]["stages"]
    assert [s["stage"] for s in stages] == [0, 1]
    assert all(s["busy"][0] > 0 and 0 <= s["bubble"][0] < 1 for s in stages)
    # The re-plan: from the configured 2 x 2 to a plan for the 3 survivors.
    replans = api(server, base + "/events", kinds="replan")["events"]
    # (at the killed step: a replica of every stage survived, and the survivors went on
    # from their live stages, not from the commit at 55)
    assert len(replans) == 3 and {e["step"] for e in replans} == {KILL_STEP}
    (plans,) = {json.dumps([e["detail"]["old"], e["detail"]["new"]]) for e in replans}
    old, new = json.loads(plans)
    assert old == {"pp": 2, "dp": 2, "stages": [[0, 2], [2, 4]]}
    assert new != old and new["pp"] * new["dp"] == 3
    # The failure: the killed host, measured from the kill, each phase a number, in order,
    # and the same numbers as the launcher's report (one definition, one code).
    (failure,) = api(server, base + "/recoveries")["recoveries"]
    assert (failure["kind"], failure["host"], failure["fault"]) == ("failure", KILLED, "kill")
    phases = [failure[k] for k in ("detected_s", "reset_done_s", "state_synced_s", "first_step_done_s")]
    assert all(isinstance(p, float) and math.isfinite(p) for p in phases)
    assert 0 < phases[0] <= phases[1] <= phases[2] <= phases[3] < 60
    (change,) = report["changes"]
    assert phases == pytest.approx([change[k] for k in ("detected_s", "reset_done_s",
                                                        "state_synced_s", "first_step_done_s")])
    assert (failure["size_before"], failure["size_after"], failure["steps_redone"]) == (4, 3, 0)
    # Stragglers are flagged per stage: the slowed host's stage 1 replica.
    stragglers = api(server, base + "/events", kinds="straggler")["events"]
    assert SLOWED in {e["detail"]["straggler_host"] for e in stragglers}


def test_host_samples_of_the_pipeline_run(server, pipeline_run):
    run_id, _ = pipeline_run
    base = f"runs/{urllib.parse.quote(run_id)}"
    hosts = {h["host"]: h for h in api(server, base + "/hosts")["hosts"]}
    assert sorted(hosts) == sorted(HOSTS)
    killed_at = api(server, base + "/recoveries")["recoveries"][0]["wall_time"]
    last = {name: max(h["time"]) for name, h in hosts.items()}
    # The killed host's sampling stopped with it (its last bucket began before the kill,
    # or in the instant between the recorded kill and the signal); the survivors sampled
    # on through the recovery. Asked for the samples after the kill: the whole series'
    # 2 s buckets are stamped with their first sample, so a survivor's last bucket may
    # begin just before the kill.
    assert last[KILLED] < killed_at + 1.0
    later = {h["host"]: h for h in api(server, base + "/hosts", since=killed_at)["hosts"]}
    assert set(HOSTS) - {KILLED} <= set(later)
    assert KILLED not in later or max(later[KILLED]["time"]) < killed_at + 1.0
    for h in hosts.values():   # one process per host: its own RSS, a torch process's worth
        assert set(h["processes"]) == {1}
        assert all(50 * 2**20 < m < 4 * 2**30 for m in h["rss_bytes"])
        assert all(0 <= c <= 100 for c in h["cpu_percent"])


# -- the pipeline run on the run page -------------------------------------------------------
def test_pipeline_run_page(page, server, pipeline_run):
    run_id, _ = pipeline_run
    base = f"runs/{urllib.parse.quote(run_id)}"
    page.goto(f"{server}/runs/{run_id}")
    # The pipeline view: both stages.
    trace(page, "chart-bubble", "stage 1")
    assert trace_names(page, "chart-bubble") == ["stage 0", "stage 1"]
    assert trace(page, "chart-stage-busy", "busy")["x"] == ["stage 0", "stage 1"]
    assert page.locator("#pipeline-section").is_visible()
    # Host samples: a CPU and a memory line per simulated host.
    for div in ("chart-host-cpu", "chart-host-mem"):
        trace(page, div, KILLED)
        assert sorted(n for n in trace_names(page, div) if n != "events") == sorted(HOSTS)
    # The failure in the recoveries table: the killed host, the kill, every phase a number.
    row = page.locator("#recoveries tr.recovery.failure")
    cells = row.locator("td").all_inner_texts()
    assert cells[:4] == ["failure", KILLED, "kill (injected)", str(KILL_STEP)]
    recovery = api(server, base + "/recoveries")["recoveries"][0]
    for cell, key in zip(cells[5:9], ("detected_s", "reset_done_s", "state_synced_s",
                                      "first_step_done_s")):
        assert cell.endswith(" s") and float(cell[:-2]) == pytest.approx(recovery[key], abs=0.051)
    # Major lines: the failure naming the dead host, the re-plan naming both plans.
    replan = api(server, base + "/events", kinds="replan")["events"][0]["detail"]
    plan = lambda p: f"pp{p['pp']}×dp{p['dp']}"  # noqa: E731
    lay = layout(page, "chart-steptime")
    labels = [a["text"] for a in lay["annotations"]]
    assert f"✖ {KILLED}" in labels
    assert labels.count(f"re-plan {plan(replan['old'])} → {plan(replan['new'])}") == 1   # not one per rank
    # Stragglers: the rug's markers name the slowed host.
    rug = page.evaluate("() => document.getElementById('chart-steptime').data"
                        ".find(t => t.name === 'events').text")
    assert any("straggler" in text and SLOWED in text for text in rug)
    counts = page.locator("#event-counts").inner_text()
    assert "straggler" in counts and "replan" in counts and "failure" in counts
    browsing.shot(page, "real-pipeline-run")


# -- the logging script -------------------------------------------------------------------
def test_logged_values_through_the_api(server, log_run):
    run_id, said = log_run
    base = f"runs/{urllib.parse.quote(run_id)}"
    names = api(server, base + "/metrics/custom")["names"]
    assert names == [{"name": "eval/accuracy", "count": 2}, {"name": "eval/loss", "count": 2},
                     {"name": "train/double_loss", "count": 30}]
    double = api(server, base + "/metrics/custom", name="train/double_loss")
    assert double["step"] == [x["step"] for x in said["logged"]] == list(range(1, 31))
    assert double["value"] == [x["value"] for x in said["logged"]]
    # twice the loss of the step rows of the same steps
    (loss,) = api(server, base + "/series", metric="loss", by="all", max_points=5000)["series"]
    assert loss["step"] == double["step"]
    assert double["value"] == pytest.approx([2 * v for v in loss["value"]], rel=1e-12)
    # every 10 steps; the evaluation at the end is fit()'s result, not a logged value
    during = [e for e in said["evaluated"] if e["step"] < 30]
    for metric in ("accuracy", "loss"):
        got = api(server, base + "/metrics/custom", name=f"eval/{metric}")
        assert got["step"] == [e["step"] for e in during] == [10, 20]
        assert got["value"] == [e[metric] for e in during]


def test_logged_values_as_charts(page, server, log_run):
    run_id, said = log_run
    page.goto(f"{server}/runs/{run_id}")
    page.locator('[data-metric="train/double_loss"]').wait_for()
    page.wait_for_function("() => document.querySelectorAll('#custom-charts [data-metric]').length === 3")
    charts = page.evaluate("() => [...document.querySelectorAll('#custom-charts [data-metric]')]"
                           ".map(d => ({name: d.dataset.metric, x: Array.from(d.data[0].x),"
                           " y: Array.from(d.data[0].y), title: d.layout.title.text}))")
    by_name = {c["name"]: c for c in charts}
    assert sorted(by_name) == ["eval/accuracy", "eval/loss", "train/double_loss"]
    assert all(c["title"] == c["name"] for c in charts)
    assert by_name["train/double_loss"]["x"] == [x["step"] for x in said["logged"]]
    assert by_name["train/double_loss"]["y"] == [x["value"] for x in said["logged"]]
    during = [e for e in said["evaluated"] if e["step"] < 30]
    for metric in ("accuracy", "loss"):
        assert by_name[f"eval/{metric}"]["x"] == [10, 20]
        assert by_name[f"eval/{metric}"]["y"] == [e[metric] for e in during]
    browsing.shot(page, "real-logged-metrics")
