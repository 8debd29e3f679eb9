"""The API when it is attacked or misused, on SQLite and PostgreSQL: writes need the
token, derived values never leave as NaN/Infinity, the read token and the Host
allow-list guard every read, run edits and deletes, Prometheus' /metrics, and waitress
refusing a huge body before reading it."""
import json
import socket
import threading
import time

import pytest

from webui import create_app
from webui.serve import make_server, stop

TOKEN, READ = "write-t0ken", "read-t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def rows(run="r1", t=None):
    t = time.time() if t is None else t
    return [{"type": "run", "id": run, "job": "digits", "status": "running", "started_at": t,
             "config": {"lr": 0.1}},
            {"type": "step", "run_id": run, "step": 1, "wall_time": t + 1, "rank": 0,
             "world_size": 2, "host": "a", "step_time": 0.5, "samples": 8, "comm_time": 1e-300,
             "bytes_sent": (1 << 63) - 1}]


@pytest.fixture
def app(db_url):
    app = create_app({"db": db_url, "ingest_token": TOKEN})
    yield app
    app.extensions["regatta_store"].close()


def ingest(client, batch, headers=AUTH):
    return client.post("/api/v1/ingest", json={"rows": batch}, headers=headers)


def test_derived_values_never_leave_as_infinity(app):
    client = app.test_client()
    assert ingest(client, rows()).status_code == 200
    # 9.2e18 bytes in 1e-300 s would overflow (PostgreSQL raises): no such point at all
    response = client.get("/api/v1/runs/r1/series?metric=bus_bandwidth&by=rank")
    assert response.status_code == 200 and response.get_json()["series"] == []
    # an infinity already in a store (written by something else): null, never Infinity
    store = app.extensions["regatta_store"]
    with store.writer() as conn:
        conn.exec_driver_sql("UPDATE step_metric SET step_time = 'Infinity'"
                             if store.dialect == "postgresql" else
                             "UPDATE step_metric SET step_time = 9e999")
    for url in ("/api/v1/runs/r1/series?metric=step_time&by=host", "/api/v1/runs/r1/imbalance",
                "/api/v1/runs/r1/export.json", "/api/v1/runs/r1"):
        response = client.get(url)
        text = response.get_data(as_text=True)
        assert response.status_code == 200 and "Infinity" not in text and "NaN" not in text, url
    series = client.get("/api/v1/runs/r1/series?metric=step_time&by=host").get_json()
    assert series["series"][0]["value"] == [None]


def test_edit_and_delete_need_the_token(app):
    client = app.test_client()
    ingest(client, rows())
    assert client.patch("/api/v1/runs/r1", json={"name": "x"}).status_code == 401
    assert client.delete("/api/v1/runs/r1").status_code == 401
    bad = client.patch("/api/v1/runs/r1", json={"tags": [1]}, headers=AUTH)
    assert bad.status_code == 400 and bad.get_json()["field"] == "tags"
    bad = client.patch("/api/v1/runs/r1", data=b"[" * 100_000, headers=AUTH)
    assert bad.status_code == 400 and "malformed JSON" in bad.get_json()["error"]
    done = client.patch("/api/v1/runs/r1", json={"name": "Baseline", "tags": ["a", "b"],
                                                 "notes": "first try"}, headers=AUTH)
    assert (done.status_code, done.get_json()["name"], done.get_json()["tags"]) == (200, "Baseline",
                                                                                  ["a", "b"])
    # a later run row (a replay, a restart) does not undo the edit
    ingest(client, [dict(rows()[0], name="from the worker")])
    assert client.get("/api/v1/runs/r1").get_json()["name"] == "Baseline"
    assert client.patch("/api/v1/runs/ghost", json={"notes": ""}, headers=AUTH).status_code == 404
    assert client.delete("/api/v1/runs/r1", headers=AUTH).get_json() == {"deleted": "r1"}
    assert client.get("/api/v1/runs/r1").status_code == 404
    assert client.get("/api/v1/runs").get_json() == {"runs": [], "total": 0}


def test_read_token_guards_every_read(db_url):
    app = create_app({"db": db_url, "ingest_token": TOKEN, "read_token": READ})
    try:
        client = app.test_client()
        assert ingest(client, rows()).status_code == 200   # ingest has its own token
        for url in ("/api/v1/runs", "/api/v1/runs/r1/series", "/api/v1/export.csv", "/metrics"):
            response = client.get(url)
            assert response.status_code == 401 and "read token" in response.get_json()["error"]
        page = client.get("/runs/r1")
        assert page.status_code == 303 and page.headers["Location"] == "/login?next=/runs/r1"
        assert client.get("/static/common.js").status_code == 200
        assert client.get("/api/v1/runs", headers={"Authorization": f"Bearer {READ}"}).status_code == 200
        assert client.get("/api/v1/runs", headers=AUTH).status_code == 200
        wrong = client.post("/login", data={"token": "nope", "next": "/runs/r1"})
        assert wrong.status_code == 401 and "not the token" in wrong.get_data(as_text=True)
        login = client.post("/login", data={"token": READ, "next": "//evil.example/"})
        assert login.status_code == 303 and login.headers["Location"] == "/"
        cookie = login.headers["Set-Cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and READ not in cookie
        assert client.get("/runs/r1").status_code == 200   # the cookie now opens pages
        assert client.get("/api/v1/runs").status_code == 200
    finally:
        app.extensions["regatta_store"].close()


@pytest.mark.parametrize("host, ok", [
    ("localhost", True), ("localhost:8050", True), ("127.0.0.1:8050", True), ("[::1]:8050", True),
    ("10.1.2.3", True), ("dash.example.org", True), ("a.team.example.org:80", True),
    ("evil.example", False), ("127.0.0.1.evil.example", False), ("", False),
    ("localhost.evil.example", False)])
def test_host_header_allow_list(db_url, host, ok):
    app = create_app({"db": db_url, "allowed_hosts": ("dash.example.org", ".team.example.org")})
    try:
        response = app.test_client().get("/api/v1/runs", headers={"Host": host})
        assert response.status_code == (200 if ok else 400)
        if not ok:
            assert "--allow-host" in response.get_json()["error"]
    finally:
        app.extensions["regatta_store"].close()


def test_prometheus_metrics(app):
    client = app.test_client()
    now = time.time()
    batch = rows("r1", now)[:1] + [
        {"type": "step", "run_id": "r1", "step": 3, "wall_time": now + 1, "rank": r,
         "world_size": 2, "host": 'h"1', "slot": r, "step_time": 0.5, "samples": 16}
        for r in range(2)]
    batch.append({"type": "event", "run_id": "r1", "wall_time": now + 2, "kind": "failure",
                  "host": "h2", "detail": {"target": "h2"}})
    assert ingest(client, batch).status_code == 200
    response = client.get("/metrics")
    assert response.status_code == 200 and response.mimetype == "text/plain"
    text = response.get_data(as_text=True)
    assert 'regatta_samples_per_second{run_id="r1",host="h\\"1"} 64' in text
    assert 'regatta_world_size{run_id="r1"} 2' in text
    assert 'regatta_failures_total{run_id="r1"} 1' in text
    assert 'regatta_runs{status="running"} 1' in text
    assert 'regatta_step_time_seconds{run_id="r1",host="h\\"1",slot="1"} 0.5' in text
    for line in text.splitlines():   # every sample line is name{labels} number
        if not line.startswith("#"):
            float(line.rsplit(" ", 1)[1])


def test_waitress_refuses_a_huge_body_before_reading_it(tmp_path):
    server = make_server(str(tmp_path / "m.db"), port=0, token=TOKEN,
                         spool_dir=str(tmp_path / "spool"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        with socket.create_connection(("127.0.0.1", server.effective_port), timeout=10) as sock:
            # claims 1 GiB; sends none of it: the answer must come anyway, at once
            sock.sendall(b"POST /api/v1/ingest HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 1073741824\r\n\r\n")
            started = time.monotonic()
            reply = sock.recv(4096).decode("latin-1")
        assert reply.startswith("HTTP/1.1 413") and time.monotonic() - started < 5
    finally:
        stop(server)
        thread.join(timeout=10)
