"""The API through Flask's test client, on a store filled by a real short training run
(`python -m jobs.digits --steps 40 ...`) plus simulated elastic, pipeline, failed and lost
runs (tests/webui_fixtures.py), once on SQLite and once on PostgreSQL. Every assertion
compares with numbers read from the store."""
import csv
import io
import json
import statistics
from collections import defaultdict
from pathlib import Path

import pytest
from sqlalchemy import select

import webui_fixtures
from monitor.models import StepMetric
from monitor.store import Store
from webui import create_app


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def data(request, tmp_path_factory):
    pg = request.getfixturevalue("postgres") if request.param == "postgresql" else None
    return webui_fixtures.build_on(request.param, tmp_path_factory.getbasetemp() / "webui", pg)


@pytest.fixture(scope="module")
def client(data):
    app = create_app({"db": data["db"], "ingest_token": "t0ken",
                      "lost_after_s": webui_fixtures.LOST_AFTER_S})
    yield app.test_client()
    app.extensions["regatta_store"].close()


@pytest.fixture(scope="module")
def store(data):
    s = Store(data["db"])
    yield s
    s.close()


def get(client, url, status=200):
    response = client.get(url)
    assert response.status_code == status, (url, response.get_data(as_text=True)[:500])
    return response.get_json()


def stored_steps(store, run_id):
    """Every step row of a run, as stored."""
    with store.engine.connect() as conn:
        return [r._asdict() for r in conn.execute(
            select(StepMetric).where(StepMetric.run_id == run_id).order_by(StepMetric.id))]


def test_the_main_run_is_the_real_one_when_the_trainer_records_steps(data, store):
    if data["real"]:
        assert data["main"] == data["real"] and store.count("step", data["real"]) >= 40
    else:  # the trainer did not write step rows: the API tests use the simulated run
        assert data["main"] == data["elastic"]


def test_runs_list_summaries(client, data, store):
    runs = {r["id"]: r for r in get(client, "/api/v1/runs")["runs"]}
    assert set(runs) >= {data["main"], data["elastic"], data["pipeline"], data["failed"]}
    main = runs[data["main"]]
    rows = stored_steps(store, data["main"])
    assert main["last_step"] == max(r["step"] for r in rows)
    assert main["world_size_max"] == max(r["world_size"] for r in rows)
    span = max(r["wall_time"] for r in rows) - min(r["wall_time"] for r in rows)
    once = {(r["rank"], r["step"]): r["samples"] for r in rows}
    assert main["throughput"] == pytest.approx(sum(once.values()) / span)
    elastic = runs[data["elastic"]]
    assert (elastic["world_size"], elastic["world_size_min"], elastic["world_size_max"]) == (6, 4, 6)
    assert (elastic["failures"], elastic["failures_survived"]) == (1, 1)
    assert (elastic["status"], elastic["name"], elastic["tags"]) == ("running", "elastic demo",
                                                                     ["demo", "elastic"])
    failed = runs[data["failed"]]
    assert (failed["status"], failed["failures"], failed["failures_survived"]) == ("failed", 1, 0)
    assert failed["error"] == "CUDA out of memory"
    assert failed["duration_s"] == pytest.approx(failed["finished_at"] - failed["started_at"])
    assert runs[data["lost"]]["status"] == "lost"   # running, silent for three days


def test_one_run(client, data, store):
    run = get(client, f"/api/v1/runs/{data['elastic']}")
    assert run["step_rows"] == store.count("step", data["elastic"])
    assert run["hosts"] == ["host-a", "host-b", "host-c"]
    assert run["failures_survived"] == 1
    assert run["config"]["model"] == {"hidden": 512} and run["code_revision"] == "0123abc"
    # processes are host:slot; their rank now is the one of their newest step
    newest = {}
    for r in stored_steps(store, data["elastic"]):
        key = f"{r['host']}:{r['slot']}"
        if key not in newest or r["wall_time"] >= newest[key]["wall_time"]:
            newest[key] = r
    assert {p["key"]: p["rank"] for p in run["processes"]} == {k: r["rank"] for k, r in newest.items()}
    assert get(client, "/api/v1/runs/nope", 404)["error"] == "no run 'nope'"


def test_series_returns_the_stored_step_times_of_a_rank(client, data, store):
    rows = [r for r in stored_steps(store, data["main"]) if r["rank"] == 0]
    by_step = defaultdict(list)
    for r in rows:
        by_step[r["step"]].append(r)
    body = get(client, f"/api/v1/runs/{data['main']}/series?metric=step_time&by=rank"
                       f"&max_points=5000")
    rank0 = next(s for s in body["series"] if s["key"] == 0)
    assert body["bucket"] == 1
    assert rank0["step"] == sorted(by_step)
    assert rank0["value"] == pytest.approx(
        [statistics.fmean(r["step_time"] for r in by_step[s]) for s in sorted(by_step)], rel=1e-12)
    assert rank0["time"] == [max(r["wall_time"] for r in by_step[s]) for s in sorted(by_step)]


@pytest.mark.parametrize("metric, by, points", [("step_time", "rank", 500), ("step_time", "host", 7),
                                                ("samples_per_s", "host", 500), ("loss", "rank", 3)])
def test_series_agrees_with_the_store_helper(client, data, store, metric, by, points):
    run = data["pipeline"]  # ranks keep their numbers: both helpers fold replays alike
    body = get(client, f"/api/v1/runs/{run}/series?metric={metric}&by={by}&max_points={points}")
    expected = store.step_series(run, metric, by=by, max_points=points)
    assert body["bucket"] == expected["bucket"]
    assert [(s["key"], s["step"]) for s in body["series"]] == \
        [(s["key"], s["step"]) for s in expected["series"]]
    for got, want in zip(body["series"], expected["series"]):
        assert got["value"] == pytest.approx(want["value"], rel=1e-12)
        assert len(got["step"]) <= points


def test_series_whole_run_sums_additive_metrics_over_processes(client, data, store):
    rows = [r for r in stored_steps(store, data["elastic"]) if r["step"] > 45]
    expected = defaultdict(float)
    for r in rows:
        expected[r["step"]] += r["samples"] / r["step_time"]
    body = get(client, f"/api/v1/runs/{data['elastic']}/series?metric=samples_per_s&by=all&from=46")
    (whole,) = body["series"]
    assert whole["key"] == "all" and whole["step"] == sorted(expected)
    assert whole["value"] == pytest.approx([expected[s] for s in sorted(expected)], rel=1e-12)


def test_series_cursor_and_range(client, data, store):
    url = f"/api/v1/runs/{data['main']}/series?metric=loss&by=rank"
    last = max(r["step"] for r in stored_steps(store, data["main"]))
    assert get(client, url)["cursor"] == last
    tail = get(client, url + f"&since={last - 5}")
    assert tail["cursor"] == last
    assert all(s["step"] == list(range(last - 4, last + 1)) for s in tail["series"])
    window = get(client, url + "&from=3&to=9")
    assert all(s["step"] == list(range(3, 10)) for s in window["series"])
    assert get(client, url + f"&since={last}")["series"] == []


def test_events_imbalance_timeline(client, data, store):
    run = data["elastic"]
    events = get(client, f"/api/v1/runs/{run}/events")
    assert len(events["events"]) == store.count("event", run)
    resets = get(client, f"/api/v1/runs/{run}/events?kinds=reset,failure")["events"]
    assert {e["kind"] for e in resets} == {"reset", "failure"}
    after = get(client, f"/api/v1/runs/{run}/events?since={events['cursor']}")
    assert after == {"events": [], "cursor": events["cursor"]}
    imbalance = get(client, f"/api/v1/runs/{run}/imbalance")
    expected = store.imbalance(run)
    assert imbalance["step"] == expected["step"]
    assert imbalance["step_time"] == pytest.approx(expected["step_time"])
    assert len(imbalance["time"]) == len(imbalance["step"]) and None not in imbalance["time"]
    sizes = get(client, f"/api/v1/runs/{run}/timeline")["world_size"]
    changes = [b for a, b in zip(sizes, sizes[1:]) if a != b]
    assert (sizes[0], changes) == (6, [4, 6])


def test_recoveries_measure_each_phase_from_the_stored_events(client, data, store):
    run = data["elastic"]
    events = store.events(run)
    failure = next(e for e in events if e["kind"] == "failure")
    t = failure["wall_time"]
    first = lambda *kinds: min(e["wall_time"] for e in events  # noqa: E731
                               if e["kind"] in kinds and e["wall_time"] >= t) - t
    rows = get(client, f"/api/v1/runs/{run}/recoveries")["recoveries"]
    assert [r["kind"] for r in rows] == ["failure", "host_added"]
    row = rows[0]
    # recorded by rank 0 on host-a, about host-b: the row names the host that died
    assert (row["host"], row["step"], row["fault"]) == ("host-b", 28, "kill")
    # measured from the kill the worker recorded, not from when the failure was noticed
    kill = min(e["wall_time"] for e in events if e["kind"] == "kill_injected")
    assert row["wall_time"] == pytest.approx(kill) and kill < t
    t = kill
    assert row["detected_s"] == pytest.approx(first("peer_lost", "restore")) == pytest.approx(0.15)
    assert row["reset_done_s"] == pytest.approx(first("reset"))
    assert row["state_synced_s"] == pytest.approx(first("sync"))
    assert row["first_step_done_s"] == pytest.approx(first("resumed"))
    restore = next(e for e in events if e["kind"] == "restore")
    assert row["steps_redone"] == restore["detail"]["steps_redone"] == 3
    assert (row["size_before"], row["size_after"]) == (6, 4)
    assert (rows[1]["host"], rows[1]["size_after"]) == ("host-b", 6)


def test_pipeline_per_stage(client, data, store):
    body = get(client, f"/api/v1/runs/{data['pipeline']}/pipeline?max_points=1")["pipeline"]
    rows = stored_steps(store, data["pipeline"])
    for stage in body["stages"]:
        mine = [r for r in rows if r["stage"] == stage["stage"]]
        busy = statistics.fmean(r["compute_time"] + r["comm_time"] for r in mine)
        step = statistics.fmean(r["step_time"] for r in mine)
        assert stage["busy"] == pytest.approx([busy])
        assert stage["bubble"] == pytest.approx([1 - busy / step])
    assert [s["stage"] for s in body["stages"]] == [0, 1]
    assert get(client, f"/api/v1/runs/{data['main']}/pipeline")["pipeline"] is None


def test_csv_export_has_every_stored_row(client, data, store):
    response = client.get(f"/api/v1/runs/{data['main']}/export.csv")
    assert response.status_code == 200 and response.mimetype == "text/csv"
    assert "attachment" in response.headers["Content-Disposition"]
    table = list(csv.DictReader(io.StringIO(response.get_data(as_text=True))))
    assert len(table) == store.count("step", data["main"])
    first = stored_steps(store, data["main"])[0]
    assert float(table[0]["step_time"]) == first["step_time"]
    everything = list(csv.reader(io.StringIO(client.get("/api/v1/export.csv").get_data(as_text=True))))
    assert len(everything) - 1 == store.count("step")
    events = client.get(f"/api/v1/runs/{data['elastic']}/export.csv?kind=event").get_data(as_text=True)
    assert len(list(csv.DictReader(io.StringIO(events)))) == store.count("event", data["elastic"])


def test_json_export(client, data, store):
    body = json.loads(client.get(f"/api/v1/runs/{data['elastic']}/export.json").get_data())
    assert len(body["steps"]) == store.count("step", data["elastic"])
    assert len(body["events"]) == store.count("event", data["elastic"])
    assert [r["id"] for r in body["runs"]] == [data["elastic"]]
    assert next(e for e in body["events"] if e["kind"] == "restore")["detail"]["steps_redone"] == 3
    every = json.loads(client.get("/api/v1/export.json").get_data())
    assert (len(every["runs"]), len(every["steps"])) == (store.count("run"), store.count("step"))


@pytest.mark.parametrize("query, parameter", [
    ("series?metric=bogus", "metric"), ("series?by=node", "by"), ("series?from=x", "from"),
    ("series?from=9&to=3", "to"), ("series?since=-7", "since"), ("series?max_points=0", "max_points"),
    ("series?colour=red", "colour"), ("series?metric=loss&metric=lr", "metric"),
    ("events?kinds=Bad!", "kinds"), ("events?since=x", "since"),
    ("imbalance?max_points=99999", "max_points"),
    ("timeline?since=soon", "since"), ("export.csv?kind=bogus", "kind"), ("recoveries?x=1", "x"),
    ("hosts?since=soon", "since"), ("hosts?max_points=-3", "max_points"),
])
def test_bad_parameters_are_400_naming_the_parameter(client, data, query, parameter):
    body = get(client, f"/api/v1/runs/{data['main']}/{query}", 400)
    assert body["parameter"] == parameter and f"'{parameter}'" in body["error"]


@pytest.mark.parametrize("url", ["series", "events", "recoveries", "export.csv", "export.json",
                                 "hosts"])
def test_unknown_run_is_404(client, url):
    assert "no run 'ghost'" in get(client, f"/api/v1/runs/ghost/{url}", 404)["error"]


def test_read_endpoints_are_read_only(client, data, store):
    before = (store.count("run"), store.count("step"))
    for url in ("/api/v1/runs", f"/api/v1/runs/{data['main']}/series", "/api/v1/export.csv"):
        for method in (client.post, client.put, client.delete, client.patch):
            response = method(url, json={"rows": []})
            assert response.status_code == 405 and "not allowed" in response.get_json()["error"]
    for method in (client.delete, client.patch):   # edits need the token
        response = method(f"/api/v1/runs/{data['main']}", json={"notes": "x"})
        assert response.status_code == 401
    assert (store.count("run"), store.count("step")) == before


def test_pages_and_local_plotly(client, data):
    plotly = client.get("/vendor/plotly.min.js")
    from webui.pages import PLOTLY_JS
    assert plotly.status_code == 200 and plotly.get_data() == Path(PLOTLY_JS).read_bytes()
    for url in ("/", f"/runs/{data['main']}", f"/compare?runs={data['main']},{data['elastic']}"):
        html = client.get(url).get_data(as_text=True)
        assert '<script src="/vendor/plotly.min.js" defer></script>' in html
    assert client.get("/runs/ghost").status_code == 404


def test_custom_metrics_and_event_kinds(client, data, store):
    run = data["elastic"]
    names = get(client, f"/api/v1/runs/{run}/metrics/custom")["names"]
    assert names == [{"name": "eval/loss", "count": store.count("metric", run)}]
    body = get(client, f"/api/v1/runs/{run}/metrics/custom?name=eval/loss")
    rows = [e for e in store.export_rows("metric", run)[1]]
    assert body["value"] == [r.value for r in rows] and body["step"] == [r.step for r in rows]
    tail = get(client, f"/api/v1/runs/{run}/metrics/custom?name=eval/loss&since={rows[-2].id}")
    assert tail["value"] == [rows[-1].value] and tail["cursor"] == rows[-1].id
    from monitor import event_kinds
    assert get(client, "/api/v1/event-kinds") == event_kinds.as_json()
    script = client.get("/vendor/event-kinds.js").get_data(as_text=True)
    assert script.startswith("const EVENT_KINDS = ") and '"failure": {"klass": "major"' in script


@pytest.mark.parametrize("query, ids", [
    ("q=DEMO", ["elastic"]), ("tag=demo", ["elastic"]), ("status=lost", ["lost"]),
    ("status=failed", ["failed"]), ("job=charlm", ["pipeline"]), ("q=no-such-thing", []),
])
def test_runs_search_and_filters(client, data, query, ids):
    body = get(client, "/api/v1/runs?" + query)
    assert sorted(r["id"] for r in body["runs"]) == sorted(data[k] for k in ids)
    assert body["total"] == len(ids)


@pytest.mark.parametrize("url, parameter", [
    ("runs?status=paused", "status"), ("runs?limit=0", "limit"), ("runs?q=" + "x" * 300, "q"),
    (f"runs/ID/series?since={1 << 63}", "since"), (f"runs/ID/series?from={1 << 64}", "from"),
    (f"runs/ID/events?since={-(1 << 63) - 1}", "since"), ("runs/ID/metrics/custom?since=x", "since"),
])
def test_out_of_range_parameters_are_400(client, data, url, parameter):
    body = get(client, "/api/v1/" + url.replace("ID", data["main"]), 400)
    assert body["parameter"] == parameter


def test_unknown_routes_and_methods_answer_json(client):
    assert get(client, "/api/v1/nothing-here", 404)["error"]
    response = client.put("/api/v1/ingest", json={})
    assert response.status_code == 405 and response.get_json()["error"]
