"""Run ids in URLs (webui/run_paths.py, issue 42): new ids are one path segment as they
stand, and every route answers for any id the store can hold (ids with ``/``, ``%``,
spaces, unicode, dot segments, and the escape character itself, as an older Regatta
stored them): the run's own data, or a 4xx, never a 5xx and never another run's rows.
The store is a real SQLite file written through the worker's sink."""
from __future__ import annotations

import json
import random
import string
import urllib.parse

import pytest

import webui_fixtures
from elastic.runtime.env import Env
from elastic.runtime.runs import new_run_id, run_name
from webui import create_app
from webui.run_paths import from_segment, to_segment

IDS = ["examples/files_cnn.py-local-20261205-155243-485394", "a%2Fb", "50% done",
       "with space", "ünïcödé-ラン", "..", ".", "../sim", "a/../b", "/lead", "trail/",
       "~tilde", "x~2Fy", "~2E", "q?x=1#frag", "back\\slash", "plain-run"]
ROUTES = ["", "/series", "/imbalance", "/timeline", "/events", "/recoveries", "/pipeline",
          "/hosts", "/metrics/custom", "/export.json"]
TOKEN = "t0ken"


def _rows(run_id: str, n: int) -> list[dict]:
    """Run ``n`` has n + 2 steps, each with loss n + step/100: every answer says whose."""
    rows = [{"type": "run", "id": run_id, "job": "files_cnn", "status": "finished",
             "started_at": 1000.0 + n}]
    for step in range(1, n + 3):
        rows.append({"type": "step", "run_id": run_id, "step": step, "wall_time": 1000.0 + n + step,
                     "rank": 0, "world_size": 1, "host": "h", "slot": 0, "stage": 0,
                     "step_time": 0.1, "compute_time": 0.08, "comm_time": 0.0, "wait_time": 0.0,
                     "data_time": 0.01, "samples": 8, "bytes_sent": 0, "loss": n + step / 100,
                     "lr": 0.1, "uid": f"{n}:{step}"})
    rows.append({"type": "event", "run_id": run_id, "wall_time": 1000.5 + n, "step": 1,
                 "kind": "commit", "host": "h", "rank": 0, "detail": {"n": n}, "uid": f"{n}:ev"})
    return rows


@pytest.fixture
def client(tmp_path):
    db = str(tmp_path / "m.db")
    webui_fixtures.write(db, [r for n, i in enumerate(IDS) for r in _rows(i, n)], str(tmp_path))
    app = create_app({"db": db, "ingest_token": TOKEN})
    yield app.test_client()
    app.extensions["regatta_store"].close()


def _path(run_id: str) -> str:
    return urllib.parse.quote(to_segment(run_id), safe="")


def test_segments_round_trip_and_stay_one_segment():
    rng = random.Random(0)
    alphabet = string.printable + "~/.%ü"
    samples = IDS + ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12)))
                     for _ in range(2000)]
    for run_id in samples:
        segment = to_segment(run_id)
        assert "/" not in segment and segment not in (".", "..") and not segment.startswith(".")
        assert from_segment(segment) == run_id
    assert to_segment("plain-run_1.2") == "plain-run_1.2"   # new ids: the path is the id
    for bad in ("~", "~2G", "a~2Eb", ".x", "~7e"):
        with pytest.raises(ValueError):
            from_segment(bad)


def test_new_run_ids_are_path_safe():
    assert run_name("examples/files_cnn.py") == "files_cnn"
    assert run_name("/abs/path/train.py") == "train"
    assert run_name("mypkg.train") == "mypkg.train" and run_name("digits") == "digits"
    assert run_name("../../") == "run" and run_name("a b/ü c.py") == "c"
    assert run_name("my model!") == "my-model"
    run_id = new_run_id("examples/files_cnn.py", Env(launch_key="k"))
    assert run_id.startswith("files_cnn-") and to_segment(run_id) == run_id


@pytest.mark.parametrize("n", range(len(IDS)))
def test_every_route_answers_for_its_own_run(client, n):
    run_id, base = IDS[n], f"/api/v1/runs/{_path(IDS[n])}"
    summary = client.get(base).get_json()
    assert summary["id"] == run_id and summary["last_step"] == n + 2
    for route in ROUTES:
        response = client.get(base + route)
        assert response.status_code == 200, (run_id, route, response.get_data(as_text=True)[:300])
    (loss,) = client.get(base + "/series?metric=loss&by=all").get_json()["series"]
    assert loss["value"] == pytest.approx([n + s / 100 for s in range(1, n + 3)])
    (event,) = client.get(base + "/events").get_json()["events"]
    assert event["detail"] == {"n": n}
    steps = client.get(base + "/export.csv").get_data(as_text=True).splitlines()
    assert len(steps) == 1 + n + 2
    exported = json.loads(client.get(base + "/export.json").get_data())
    assert {r["run_id"] for r in exported["steps"]} == {run_id}
    page = client.get(f"/runs/{_path(run_id)}")
    assert page.status_code == 200 and f'data-run="' in page.get_data(as_text=True)


@pytest.mark.parametrize("n", range(len(IDS)))
def test_edit_and_delete_reach_only_their_run(client, n):
    run_id, base = IDS[n], f"/api/v1/runs/{_path(IDS[n])}"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    edited = client.patch(base, json={"name": "renamed", "tags": ["x"]}, headers=auth)
    assert edited.status_code == 200 and edited.get_json()["id"] == run_id
    names = {r["id"]: r.get("name") for r in client.get("/api/v1/runs").get_json()["runs"]}
    assert {i for i, name in names.items() if name == "renamed"} == {run_id}
    assert client.delete(base, headers=auth).get_json() == {"deleted": run_id}
    assert set(IDS) - {r["id"] for r in client.get("/api/v1/runs").get_json()["runs"]} == {run_id}
    assert client.get(base).status_code == 404


@pytest.mark.parametrize("n", range(len(IDS)))
def test_other_spellings_are_4xx_or_the_same_run(client, n):
    """The raw id, its percent-encoding and a malformed escape: never a 5xx, and any run
    that answers is the one the spelling names."""
    run_id = IDS[n]
    spellings = {run_id, urllib.parse.quote(run_id, safe=""), urllib.parse.quote(run_id),
                 to_segment(run_id) + "~", "~" + to_segment(run_id)}
    for spelling in spellings:
        for route in ["", *ROUTES[1:], "/export.csv"]:
            response = client.get(f"/api/v1/runs/{spelling}{route}")
            assert response.status_code < 500, (spelling, route)
            body = response.get_json(silent=True)
            if response.status_code == 200 and route == "":
                assert body["id"] == from_segment(urllib.parse.unquote(spelling))
        page = client.get(f"/runs/{spelling}")
        assert page.status_code < 500
