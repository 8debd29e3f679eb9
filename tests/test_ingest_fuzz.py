"""The ingest door under attack, on SQLite and PostgreSQL: hundreds of malformed bodies
of every kind the issue lists (types that are lists or objects, integers beyond int64,
int-to-float overflow, deep nesting, negative steps, ranks outside the world, JSON columns
that are not objects, unknown runs, control characters, lone surrogates, ...) each get a
4xx naming the problem, nothing of them is stored, and every page and API answer still
loads afterwards."""
import json
import math
import random

import pytest
from sqlalchemy import select

from monitor.models import Event, Run
from monitor.schema import COLUMNS, REQUIRED
from webui import create_app

TOKEN = "fuzz-t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
RUN = {"type": "run", "id": "r1", "job": "digits", "status": "running", "started_at": 1e9,
       "config": {"lr": 0.1}}
GOOD = {
    "step": {"type": "step", "run_id": "r1", "step": 3, "wall_time": 1e9 + 3, "rank": 1,
             "world_size": 2, "host": "h", "step_time": 0.5, "samples": 8},
    "event": {"type": "event", "run_id": "r1", "wall_time": 1e9 + 4, "kind": "commit",
              "step": 3, "detail": {"cost_s": 0.1}},
    "host": {"type": "host", "run_id": "r1", "host": "h", "wall_time": 1e9 + 5,
             "cpu_percent": 5.0, "rss_bytes": 100},
    "metric": {"type": "metric", "run_id": "r1", "name": "eval/loss", "value": 0.5,
               "wall_time": 1e9 + 6, "step": 3},
    "run": RUN,
}
# values no column of any type accepts
POISON = [[], {}, [1, 2], {"a": 1}, True, 1 << 64, -(1 << 64), 10 ** 400, "x" * 100_000,
          "a\x00b", "\ud800"]
BAD_BY_FIELD = {   # values a particular field refuses although others might take them
    "step": [-1, 1.5, "3"], "rank": [-1], "world_size": [0, -2], "wall_time": [-5.0, 1e12],
    "step_time": [-0.1, 1e300, math.inf], "samples": [-1], "host": ["", "h\n", "x" * 300],
    "kind": ["Bad Kind", "", "x" * 41], "detail": ["not json", "[1]", [1], "{oops", 3],
    "config": ["{oops", "[1, 2]", [1], "null"], "status": ["paused", "RUNNING"],
    "value": [math.nan, 1e200], "cpu_percent": [-1.0], "bubble": [1.5, -0.1],
    "tags": ["x", [1], [""]],
}
BAD_BY_KIND = {("step", "rank"): [2, 7], ("metric", "name"): [".hidden", "a b", "x" * 101],
               ("run", "name"): ["x" * 201, "a\nb"]}
OPTIONAL_OK = {"tags": [[]]}   # values that are fine for one field though poison elsewhere


def malformed_bodies(rng: random.Random) -> list[bytes]:
    out = [b"", b"{", b"{not json", b"\xff\xfe\x00", b"[1, 2]", b"null", b'"rows"', b"1e999",
           b'{"rows": {}}', b'{"rows": null}', b'{"rows": [], "x": 1}', b'{"rows": "a"}',
           b"[" * 100_000 + b"]" * 100_000, b'{"rows": ' + b"[" * 5000 + b"]" * 5000 + b"}",
           b'{"rows": [NaN]}', b'{"rows": [Infinity]}', b'{"rows": [1, 2, 3]}']
    rows = []
    for kind, good in GOOD.items():
        for field in COLUMNS[kind] + ("type", "uid", "bogus"):
            bad = POISON + BAD_BY_FIELD.get(field, []) + BAD_BY_KIND.get((kind, field), [])
            for value in bad:
                if field in ("detail", "config") and isinstance(value, dict):
                    continue   # an object is what they take
                if value in OPTIONAL_OK.get(field, []):
                    continue
                rows.append(dict(good, **{field: value}))
        for field in REQUIRED[kind]:
            rows.append({k: v for k, v in good.items() if k != field})
        rows.append(dict(good, run_id="ghost") if kind != "run" else dict(good, id=""))
    rows.append(dict(GOOD["event"], detail={"deep": json.loads("[" * 40 + "]" * 40)}))
    for row in rows:
        # a bad row alone, and hidden among good ones (nothing of the batch may be stored)
        batch = [row] if rng.random() < 0.5 else [GOOD["step"], row, GOOD["event"]]
        try:
            out.append(json.dumps({"rows": batch}).encode())
        except (ValueError, OverflowError):
            continue
    out += [b'{"rows": [{"type": "step", "run_id": "r1", "step": 1e400}]}',
            b'{"rows": [{"type": "step", "run_id": "r1", "step": 123456789012345678901234567890}]}']
    return out


def counts(store) -> tuple:
    return tuple(store.count(k) for k in ("run", "step", "event", "host", "metric"))


def test_malformed_bodies_get_4xx_and_store_nothing(db_url):
    app = create_app({"db": db_url, "ingest_token": TOKEN, "max_body_bytes": 1 << 20})
    store = app.extensions["regatta_store"]
    client = app.test_client()
    try:
        assert client.post("/api/v1/ingest", data=json.dumps({"rows": [RUN]}),
                           headers=AUTH).status_code == 200
        before = counts(store)
        bodies = malformed_bodies(random.Random(7))
        assert len(bodies) >= 300
        statuses = {}
        for body in bodies:
            response = client.post("/api/v1/ingest", data=body, headers=AUTH)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            assert 400 <= response.status_code < 500, (body[:200], response.get_data()[:300])
            assert response.is_json and response.get_json()["error"], body[:200]
        assert counts(store) == before, statuses
        assert set(statuses) <= {400, 409, 413}
        # the store still holds only what is valid: the run row, untouched
        with store.engine.connect() as conn:
            (config,) = conn.execute(select(Run.config)).one()
            assert json.loads(config) == {"lr": 0.1}
            assert conn.execute(select(Event)).all() == []
        # and every page and every API answer of the run still loads
        for url in ("/", "/runs/r1", "/compare?runs=r1", "/api/v1/runs", "/api/v1/runs/r1",
                    "/api/v1/runs/r1/series", "/api/v1/runs/r1/events",
                    "/api/v1/runs/r1/recoveries", "/api/v1/runs/r1/imbalance",
                    "/api/v1/runs/r1/timeline", "/api/v1/runs/r1/pipeline",
                    "/api/v1/runs/r1/metrics/custom", "/api/v1/runs/r1/export.json",
                    "/api/v1/export.csv", "/metrics"):
            assert client.get(url).status_code == 200, url
    finally:
        store.close()
