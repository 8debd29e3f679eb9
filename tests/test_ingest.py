"""HTTP ingest against a real server on 127.0.0.1: delivery, outage replay, auth, errors."""
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from werkzeug.serving import make_server

from monitor.sink import HttpSink, SinkConfig
from monitor.store import Store
from webui import create_app

TOKEN = "s3cret"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """The real app served by werkzeug in a thread; can be stopped and restarted."""

    def __init__(self, config: dict, port: int):
        self.config, self.port = config, port
        self.url = f"http://127.0.0.1:{port}"
        self._server = None

    def start(self):
        self.app = create_app(self.config)
        self._server = make_server("127.0.0.1", self.port, self.app, threaded=True)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        kwargs={"poll_interval": 0.05})  # quick shutdown
        self._thread.start()

    def stop(self):
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=10)
            self.app.extensions["regatta_store"].close()
            self._server = None


RUN = {"type": "run", "id": "r1", "job": "mlp", "status": "running", "started_at": 1.0}


@pytest.fixture
def server(tmp_path):
    """A live server whose store knows run r1 (rows of unknown runs are refused)."""
    srv = LiveServer({"db": str(tmp_path / "m.db"), "ingest_token": TOKEN,
                      "max_body_bytes": 256 * 1024}, free_port())
    srv.start()
    assert post(srv.url, json.dumps({"rows": [RUN]}).encode())[0] == 200
    yield srv
    srv.stop()


def stored(srv, kind="step") -> int:
    store = Store(srv.config["db"])
    try:
        return store.count(kind)
    finally:
        store.close()


def post(url, body: bytes, token=TOKEN):
    """POST raw bytes; returns (status, decoded JSON reply)."""
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url + "/api/v1/ingest", data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def step_row(step, rank=0, **kw):
    row = {"type": "step", "run_id": "r1", "step": step, "wall_time": float(step),
           "rank": rank, "world_size": 2, "host": "h", "step_time": 0.5}
    row.update(kw)
    return row


def fast_sink(srv, tmp_path, token=TOKEN) -> HttpSink:
    config = SinkConfig(batch_size=50, flush_interval=0.05, retry_min=0.1, retry_max=0.5)
    return HttpSink(srv.url, token, str(tmp_path / "sink.jsonl"), config=config, timeout=2.0)


def test_http_sink_delivers_every_type(server, tmp_path):
    with fast_sink(server, tmp_path) as sink:
        sink.emit({"type": "run", "id": "r1", "job": "mlp", "status": "running",
                   "started_at": 1.0})
        for s in range(120):
            sink.emit(step_row(s, loss=1.0 / (s + 1)))
        sink.emit({"type": "event", "run_id": "r1", "wall_time": 2.0, "kind": "commit",
                   "step": 100, "detail": {"commits": 1}})
        sink.emit({"type": "host", "run_id": "r1", "host": "h", "wall_time": 2.0,
                   "cpu_percent": 12.5, "rss_bytes": 1024})
    assert (stored(server, "run"), stored(server, "step"), stored(server, "event"),
            stored(server, "host")) == (1, 120, 1, 1)
    assert sink.failures == 0


def test_outage_loses_nothing_and_duplicates_nothing(server, tmp_path):
    sink = fast_sink(server, tmp_path)
    try:
        for s in range(100):
            sink.emit(step_row(s))
        assert sink.flush(timeout=20)
        assert (stored(server), sink.spooled) == (100, 0)
        server.stop()
        down_at = time.monotonic()
        for s in range(100, 250):  # training goes on while the dashboard is down
            sink.emit(step_row(s))
            time.sleep(0.01)
        assert sink.flush(timeout=20)
        assert sink.spooled == 150 and sink.failures > 0
        time.sleep(max(0.0, 10.0 - (time.monotonic() - down_at)))   # down for 10 s
        server.start()  # same port, same database
        deadline = time.monotonic() + 20
        while sink.spooled and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sink.spooled == 0
    finally:
        sink.close(timeout=20)
    store = Store(server.config["db"])
    series = store.step_series("r1", "step_time", max_points=1000)["series"][0]
    assert series["step"] == list(range(250))
    assert store.count("step") == 250
    store.close()


def test_rows_wait_for_their_run_row(server, tmp_path):
    """Another producer's run row arrives later: 409 until then, then every row once."""
    rows = [dict(step_row(s), run_id="late") for s in range(30)]
    status, reply = post(server.url, json.dumps({"rows": rows}).encode())
    assert status == 409 and reply["field"] == "run_id" and "unknown run 'late'" in reply["error"]
    with fast_sink(server, tmp_path) as sink:
        for row in rows:
            sink.emit(row)
        assert sink.flush(timeout=20)
        assert sink.spooled == 30 and stored(server) == 0   # waiting, not rejected
        post(server.url, json.dumps({"rows": [dict(RUN, id="late")]}).encode())
        deadline = time.monotonic() + 20
        while sink.spooled and time.monotonic() < deadline:
            time.sleep(0.05)
    assert stored(server) == 30 and not (tmp_path / "sink.jsonl.rejected").exists()


def test_replayed_batch_is_stored_once(server):
    rows = [dict(step_row(s), uid=f"p:{s}") for s in range(10)]
    body = json.dumps({"rows": rows}).encode()
    assert post(server.url, body) == (200, {"stored": 10, "received": 10})
    assert post(server.url, body) == (200, {"stored": 0, "received": 10})
    assert stored(server) == 10


@pytest.mark.parametrize("token", [None, "wrong", ""])
def test_bad_token_is_refused_and_nothing_stored(server, token):
    status, reply = post(server.url, json.dumps({"rows": [step_row(0)]}).encode(), token)
    assert status == 401 and "bearer token" in reply["error"]
    assert stored(server) == 0


def test_ingest_disabled_without_server_token(tmp_path):
    srv = LiveServer({"db": str(tmp_path / "m.db")}, free_port())
    srv.start()
    try:
        status, reply = post(srv.url, json.dumps({"rows": [step_row(0)]}).encode())
        assert status == 403 and "no ingest token" in reply["error"]
        assert stored(srv) == 0
    finally:
        srv.stop()


@pytest.mark.parametrize("body, problem", [
    (b"{not json", "malformed JSON body"),
    (b"\xff\xfe", "malformed JSON body"),
    (b"[1, 2]", "'rows' list"),
    (b'{"rows": {"type": "step"}}', "'rows' list"),
    (b'{"rows": [], "extra": 1}', "unknown body keys ['extra']"),
    (json.dumps({"rows": [step_row(0), {k: v for k, v in step_row(1).items() if k != "rank"}]})
     .encode(), "rows[1]: step row: missing required field 'rank'"),
    (json.dumps({"rows": [step_row(0), dict(step_row(1), step_time="fast")]}).encode(),
     "rows[1]: step row: field 'step_time' must be float, got str"),
    (json.dumps({"rows": [{"type": "gpu"}]}).encode(), "rows[0]: field 'type' must be one of"),
])
def test_malformed_body_is_refused_and_nothing_stored(server, body, problem):
    status, reply = post(server.url, body)
    assert status == 400 and problem in reply["error"], reply
    assert stored(server) == 0  # the valid row before a bad one is not stored either


def test_huge_body_is_refused(server):
    rows = [step_row(s) for s in range(3000)]  # about 400 kB > the 256 kB limit
    status, reply = post(server.url, json.dumps({"rows": rows}).encode())
    assert status == 413 and "larger than 262144 bytes" in reply["error"]
    assert stored(server) == 0


def test_http_sink_splits_batches_the_server_finds_too_big(server, tmp_path):
    config = SinkConfig(batch_size=3000, flush_interval=30.0)
    with HttpSink(server.url, TOKEN, str(tmp_path / "s.jsonl"), config=config) as sink:
        for s in range(3000):
            sink.emit(step_row(s))
        assert sink.flush(timeout=30)
    assert stored(server) == 3000 and sink.failures == 0


def test_read_api(server):
    run = {"type": "run", "id": "r1", "job": "mlp", "status": "finished", "started_at": 1.0,
           "finished_at": 9.0}
    assert post(server.url, json.dumps({"rows": [run, step_row(4)]}).encode())[0] == 200
    with urllib.request.urlopen(server.url + "/api/v1/runs", timeout=10) as reply:
        runs = json.loads(reply.read())["runs"]
    assert [(r["id"], r["status"], r["last_step"]) for r in runs] == [("r1", "finished", 4)]
    with urllib.request.urlopen(server.url + "/api/v1/runs/r1", timeout=10) as reply:
        one = json.loads(reply.read())
    assert (one["hosts"], one["ranks"], one["step_rows"]) == (["h"], 1, 1)
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(server.url + "/api/v1/runs/nope", timeout=10)
    assert info.value.code == 404 and json.loads(info.value.read()) == {"error": "no run 'nope'"}
