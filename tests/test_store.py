"""The store on SQLite and PostgreSQL: row validation, run upserts, exactly-once writes,
the kept run summary, run management, query numbers."""
import json
import math
import random
import time

import pytest
from sqlalchemy import select

from monitor import rollup
from monitor.models import Run, RunProcess
from monitor.store import RowError, Store, UnknownRun, validate_row


@pytest.fixture
def store(db_url):
    s = Store(db_url)
    s.write_rows([RUN])
    yield s
    s.close()


def step(run="r1", step=0, rank=0, host="a", step_time=1.0, **kw):
    """A valid step row; keyword arguments override or add fields."""
    row = {"type": "step", "run_id": run, "step": step, "wall_time": 1000.0 + step,
           "rank": rank, "world_size": 3, "host": host, "step_time": step_time,
           "uid": f"{run}:{rank}:{step}"}
    row.update(kw)
    return row


RUN = {"type": "run", "id": "r1", "job": "mlp", "status": "running", "started_at": 10.0,
       "config": {"lr": 0.1}, "launcher": "horovodrun"}
BIG = 1 << 63
DEEP = [1]
for _ in range(40):
    DEEP = [DEEP]


@pytest.mark.parametrize("row, message", [
    ({"type": "bogus"}, "field 'type' must be one of"),
    ({k: v for k, v in step().items() if k != "rank"}, "step row: missing required field 'rank'"),
    (dict(step(), step="3"), "step row: field 'step' must be int, got str"),
    (step(rank=True), "step row: field 'rank' must be int, got bool"),
    (step(bogus=1), "step row: unknown field 'bogus'"),
    (step(step_time=math.inf), "step row: field 'step_time' must be finite"),
    (step(host=None), "step row: field 'host' must not be null"),
    (dict(RUN, status="paused"), "run row: field 'status' must be one of"),
    ({"type": "event", "run_id": "r1", "wall_time": 1.0}, "event row: missing required field 'kind'"),
    (dict(step(), uid=7), "step row: field 'uid' must be str of 1..200 characters, got int"),
    ("not a dict", "row must be an object"),
    ({"type": ["step"]}, "field 'type' must be one of"),
    ({"type": {"a": 1}}, "field 'type' must be one of"),
    (step(step=-1), "step row: field 'step' must be >= 0, got -1"),
    (step(step=BIG), "step row: field 'step' must fit in 64 bits"),
    (step(rank=7), "step row: field 'rank' must be below world_size=3, got 7"),
    (step(world_size=0, rank=0), "step row: field 'world_size' must be >= 1"),
    (step(step_time=10 ** 400), "step row: field 'step_time' must be a finite number"),
    (step(samples=-5), "step row: field 'samples' must be >= 0"),
    (step(host="a\x00b"), "step row: field 'host' must not contain control characters"),
    (step(host="x" * 300), "step row: field 'host' must be 1..255 characters long"),
    (step(host="\ud800"), "step row: field 'host' must be valid Unicode"),
    (step(bubble=1.5), "step row: field 'bubble' must be <= 1"),
    (dict(RUN, config="{oops"), "run row: field 'config' must hold a JSON object"),
    (dict(RUN, config=[1, 2]), "run row: field 'config' must be a JSON object, got list"),
    (dict(RUN, config="[1, 2]"), "run row: field 'config' must be a JSON object, got list"),
    (dict(RUN, config={"a": DEEP}),
     "nested more than 32 deep"),
    (dict(RUN, tags="x"), "run row: field 'tags' must be a list of strings"),
    (dict(RUN, tags=["ok", ""]), "each tag is 1..50 characters"),
    ({"type": "event", "run_id": "r1", "wall_time": 1.0, "kind": "commit", "detail": "not json"},
     "event row: field 'detail' must hold a JSON object"),
    ({"type": "event", "run_id": "r1", "wall_time": 1.0, "kind": "commit", "detail": [1]},
     "event row: field 'detail' must be a JSON object, got list"),
    ({"type": "event", "run_id": "r1", "wall_time": 1.0, "kind": "Bad Kind"},
     "event row: field 'kind' must match"),
    ({"type": "metric", "run_id": "r1", "wall_time": 1.0, "name": ".hidden", "value": 1.0},
     "metric row: field 'name' must match"),
    ({"type": "metric", "run_id": "r1", "wall_time": 1.0, "name": "a b", "value": 1.0},
     "metric row: field 'name' must match"),
    ({"type": "metric", "run_id": "r1", "wall_time": 1.0, "name": "eval/loss", "value": math.nan},
     "metric row: field 'value' must be finite"),
    ({"type": "run", "id": "r1", "job": "j", "status": "running", "started_at": 1.0,
      "step_rows": 5}, "run row: unknown field 'step_rows'"),   # kept by the store only
])
def test_validation_error_names_the_field(row, message):
    with pytest.raises(ValueError) as info:
        validate_row(row)
    assert message in str(info.value)


def test_validation_normalises():
    out = validate_row(step(step_time=2, loss=math.nan))
    assert out["step_time"] == 2.0 and isinstance(out["step_time"], float)
    assert out["loss"] is None  # NaN is not storable nor valid JSON
    assert (out["slot"], out["stage"], out["samples"], out["comm_time"]) == (0, 0, 0, 0.0)
    assert json.loads(validate_row(RUN)["config"]) == {"lr": 0.1}
    # non-finite numbers inside JSON become null (no NaN/Infinity ever leaves the API)
    assert json.loads(validate_row(dict(RUN, config={"x": math.inf}))["config"]) == {"x": None}
    assert validate_row(dict(RUN, tags=[" a ", "b", "a"]))["tags"] == '["a", "b"]'
    metric = validate_row({"type": "metric", "run_id": "r1", "name": "eval/top-1:val",
                           "step": 3, "value": 2, "wall_time": 5})
    assert (metric["value"], metric["rank"]) == (2.0, None)


def test_bad_row_in_batch_stores_nothing(db_url):
    store = Store(db_url)
    rows = [RUN, step(step=0), step(step=1, step_time="slow"), step(step=2)]
    with pytest.raises(RowError, match=r"rows\[2\]: step row: field 'step_time'") as info:
        store.write_rows(rows)
    assert info.value.field == "step_time"
    assert (store.count("run"), store.count("step")) == (0, 0)
    store.close()


def test_rows_of_an_unknown_run_are_refused(store):
    with pytest.raises(UnknownRun, match="unknown run 'ghost'"):
        store.write_rows([step(run="ghost"), step(step=1)])
    assert store.count("step") == 0
    # the run row in the same batch, even after its steps, is enough
    assert store.write_rows([step(run="r2"), dict(RUN, id="r2")]) == 2


def test_run_upsert(store):
    now = time.time()
    store.write_rows([dict(RUN, id="r2", started_at=now, name="baseline", tags=["lr"],
                           code_revision="abc123")])
    assert store.run("r2")["status"] == "running"
    assert store.run("r1")["status"] == "lost"   # running, and silent since t=10
    store.write_rows([dict(RUN, id="r2", status="failed", finished_at=now + 9,
                           error="CUDA out of memory", name="renamed", config={"lr": 9})])
    store.write_rows([dict(RUN, id="r2", started_at=now)])  # a stale replay: no reopening
    run = store.run("r2")
    assert {k: run[k] for k in ("status", "finished_at", "error", "name", "tags", "config",
                                "code_revision", "launcher")} == {
        "status": "failed", "finished_at": now + 9, "error": "CUDA out of memory",
        "name": "baseline", "tags": ["lr"], "config": {"lr": 0.1}, "code_revision": "abc123",
        "launcher": "horovodrun"}
    assert store.count("run") == 2


def test_exactly_once_by_uid(store):
    first = [step(step=s, rank=r) for s in range(50) for r in range(2)]
    first.append({"type": "event", "run_id": "r1", "wall_time": 5.0, "kind": "commit",
                  "uid": "e1"})
    first.append({"type": "host", "run_id": "r1", "host": "a", "wall_time": 5.0,
                  "cpu_percent": 50.0, "rss_bytes": 1 << 20, "uid": "h1"})
    first.append({"type": "metric", "run_id": "r1", "name": "eval/loss", "value": 0.5,
                  "step": 3, "wall_time": 6.0, "uid": "m1"})
    assert store.write_rows(first) == 103
    new = [step(step=s, rank=2) for s in range(10)]
    assert store.write_rows(first + new) == 10  # the replayed 103 rows are ignored
    assert (store.count("step"), store.count("event"), store.count("host"),
            store.count("metric")) == (110, 1, 1, 1)
    run = store.run("r1")   # replays did not count twice in the kept summary
    assert (run["step_rows"], run["last_step"], run["ranks"]) == (110, 49, 1)


@pytest.fixture
def three_ranks(store):
    """Steps 0-5: ranks 0, 1 on host a (1 s, 2 s), rank 2 on host b slowing (1+s s)."""
    rows = [RUN]
    for s in range(6):
        rows.append(step(step=s, rank=0, host="a", step_time=1.0, compute_time=0.5,
                         samples=10, comm_time=0.25, bytes_sent=1000))
        rows.append(step(step=s, rank=1, host="a", step_time=2.0, compute_time=1.0,
                         samples=10, slot=1))
        rows.append(step(step=s, rank=2, host="b", step_time=1.0 + s, compute_time=0.5,
                         samples=20))
    store.write_rows(rows)
    return store


def values(result):
    return {entry["key"]: (entry["step"], entry["value"]) for entry in result["series"]}


def test_step_series_by_rank_and_downsampling(three_ranks):
    full = values(three_ranks.step_series("r1", "step_time"))
    assert full[2] == ([0, 1, 2, 3, 4, 5], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    assert full[1] == ([0, 1, 2, 3, 4, 5], [2.0] * 6)
    down = three_ranks.step_series("r1", "step_time", max_points=3)
    assert down["bucket"] == 2
    assert values(down)[2] == ([0, 2, 4], [1.5, 3.5, 5.5])
    assert values(three_ranks.step_series("r1", "step_time", max_points=4))[2] == (
        [0, 2, 4], [1.5, 3.5, 5.5])  # 6 steps in 4 points still needs width 2
    since = values(three_ranks.step_series("r1", "step_time", since_step=3))
    assert since[2] == ([4, 5], [5.0, 6.0])


def test_series_by_host(three_ranks):
    mean_time = values(three_ranks.step_series("r1", "step_time", by="host"))
    assert mean_time["a"][1] == [1.5] * 6
    thr = values(three_ranks.throughput("r1"))
    assert thr["a"] == ([0, 1, 2, 3, 4, 5], [15.0] * 6)  # 10/1 + 10/2
    assert thr["b"][1] == pytest.approx([20.0, 10.0, 20 / 3, 5.0, 4.0, 20 / 6])


def test_comm_fraction_and_bus_bandwidth(three_ranks):
    frac = values(three_ranks.comm_fraction("r1"))
    assert frac[0][1] == [0.25] * 6 and frac[1][1] == [0.0] * 6
    bw = values(three_ranks.bus_bandwidth("r1"))
    assert list(bw) == [0]  # ranks that did not communicate have no bandwidth
    assert bw[0][1] == pytest.approx([1000 * 2 * 2 / 3 / 0.25] * 6)


def test_imbalance(three_ranks):
    imb = three_ranks.imbalance("r1")
    assert imb["step"] == [0, 1, 2, 3, 4, 5]
    assert imb["step_time"] == [2.0, 1.0, 1.5, 2.0, 2.5, 3.0]  # max / median of [1, 2, 1+s]
    assert imb["compute_time"] == [2.0] * 6                    # max / median of [.5, 1, .5]
    down = three_ranks.imbalance("r1", max_points=3)
    assert (down["step"], down["step_time"]) == ([0, 2, 4], [1.5, 1.75, 2.75])


def test_replayed_step_counts_once(store):
    """After an elastic restore a rank redoes steps: each (rank, step) counts once."""
    store.write_rows([step(step=0, rank=0, samples=10), step(step=0, rank=1, samples=10),
                      step(step=0, rank=0, samples=10, step_time=3.0, uid="again")])
    assert values(store.step_series("r1", "step_time"))[0] == ([0], [2.0])
    # rank 0: mean of its two attempts (10/1 and 10/3 samples/s), plus rank 1's 10/1
    assert values(store.throughput("r1"))["a"] == ([0], [pytest.approx(20 / 3 + 10)])


def test_run_summary_and_events(three_ranks):
    kinds = ["failure", "reset", "commit"]
    three_ranks.write_rows([
        {"type": "event", "run_id": "r1", "wall_time": 3.0 - i, "kind": k, "step": i,
         "host": "b", "rank": 2, "detail": {"n": i}, "uid": f"ev{i}"}
        for i, k in enumerate(kinds)])
    assert [e["kind"] for e in three_ranks.events("r1")] == ["commit", "reset", "failure"]
    picked = three_ranks.events("r1", kinds=["failure", "commit"])
    assert [(e["kind"], e["step"], e["detail"]) for e in picked] == [
        ("commit", 2, {"n": 2}), ("failure", 0, {"n": 0})]
    summary = three_ranks.run("r1")
    assert {k: summary[k] for k in ("last_step", "step_rows", "ranks", "hosts", "events")} == {
        "last_step": 5, "step_rows": 18, "ranks": 3, "hosts": ["a", "b"], "events": 3}
    assert [p["key"] for p in summary["processes"]] == ["a:0", "a:1", "b:0"]
    assert three_ranks.run("nope") is None


def test_unknown_metric_rejected(three_ranks):
    with pytest.raises(ValueError, match="unknown metric 'speed'"):
        three_ranks.step_series("r1", "speed")
    with pytest.raises(ValueError, match="by must be"):
        three_ranks.step_series("r1", "loss", by="slot")


def summary_columns(store, run_id):
    with store.engine.connect() as conn:
        run = rollup.summary_of(conn, run_id)
        procs = sorted(tuple(p) for p in conn.execute(
            select(RunProcess).where(RunProcess.run_id == run_id)))
    return run, procs


def test_kept_summary_equals_a_recomputation(store):
    """Rows in many batches, out of order, with a restore that replays steps under new
    rank numbers: the summary kept while writing equals one rebuilt from the rows."""
    rows = []
    for s in range(30):   # hosts a (2 slots) and b until step 20; a restore to 15
        for slot, host, rank in (("0", "a", 0), ("1", "a", 1), ("0", "b", 2)):
            if host == "b" and s >= 20:
                continue
            rows.append(step(step=s, rank=rank, host=host, slot=int(slot), samples=8,
                             wall_time=100.0 + s, uid=f"x{s}{host}{slot}"))
    for s in range(15, 25):   # the replay after b died: a's ranks renumbered, world 2
        for slot in (0, 1):
            rows.append(step(step=s, rank=1 - slot, host="a", slot=slot, samples=12,
                             world_size=2, wall_time=200.0 + s, uid=f"y{s}{slot}"))
    batches = [rows[i:i + 7][::-1] for i in range(0, len(rows), 7)]
    random.Random(0).shuffle(batches)   # a spool replays old rows after newer ones
    for batch in batches:
        store.write_rows(batch)
    kept = summary_columns(store, "r1")
    with store.writer() as conn:
        rollup.rebuild(conn, ["r1"])
    assert summary_columns(store, "r1") == kept
    run, procs = kept
    # a counted steps 0..29 once (8 samples each) though it did 15..24 twice, b 0..19
    assert run["samples_done"] == 2 * 30 * 8 + 20 * 8
    assert (run["world_size"], run["world_size_min"], run["world_size_max"]) == (2, 2, 3)
    assert (run["last_step"], run["step_rows"]) == (29, len(rows))
    # the newest row of a:0 is its replay of step 24 under rank 1
    assert [(p[1], p[2], p[3], p[4]) for p in procs] == [("a", 0, 29, 1), ("a", 1, 29, 0),
                                                        ("b", 0, 19, 2)]


def test_edit_search_and_delete(store):
    now = time.time()
    store.write_rows([dict(RUN, id="r2", job="charlm", started_at=now, tags=["big"]),
                      dict(RUN, id="r3", status="finished", finished_at=now, started_at=now - 1),
                      step(run="r2", step=1, wall_time=now)])
    store.edit_run("r1", {"name": "Baseline 50%", "tags": ["lr", "sweep_1"], "notes": "hi"})
    assert store.run("r1")["name"] == "Baseline 50%"
    with pytest.raises(RowError, match="field 'tags'"):
        store.edit_run("r1", {"tags": "lr"})
    with pytest.raises(RowError, match="field 'status'"):
        store.edit_run("r1", {"status": "finished"})
    assert store.edit_run("ghost", {"notes": "x"}) is None
    ids = lambda **kw: [r["id"] for r in store.runs(**kw)]  # noqa: E731
    assert ids() == ["r2", "r3", "r1"]
    assert ids(q="50%") == ["r1"] and ids(q="5_%") == [] and ids(q="BASE") == ["r1"]
    assert ids(tag="sweep_1") == ["r1"] and ids(tag="sweep") == []
    assert ids(job="charlm") == ["r2"]
    assert ids(status="lost") == ["r1"] and ids(status="running") == ["r2"]
    assert ids(status="finished") == ["r3"]
    assert store.runs_page(limit=1, offset=1) == {"runs": store.runs()[1:2], "total": 3}
    assert store.delete_run("r2") and not store.delete_run("r2")
    assert (store.count("run"), store.count("step")) == (2, 0)
    with store.engine.connect() as conn:
        assert conn.execute(select(RunProcess).where(RunProcess.run_id == "r2")).all() == []


def test_bad_rows_already_stored_do_not_break_reading(store):
    """A store written by an older or foreign producer: bad JSON reads as empty."""
    store.write_rows([{"type": "event", "run_id": "r1", "wall_time": 5.0, "kind": "commit",
                       "uid": "e1"}, step(step=1)])
    with store.writer() as conn:
        conn.execute(Run.__table__.update().values(config="{oops", tags="nope"))
        conn.exec_driver_sql("UPDATE event SET detail = 'not json'")
    (run,) = store.runs()
    assert (run["config"], run["tags"], run["config_error"][:8]) == ({}, [], "not JSON")
    (event,) = store.events("r1")
    assert event["detail"] == {} and "detail_error" in event
    assert store.recoveries("r1") == []


def test_a_sqlite_store_is_wal_and_syncs_at_checkpoints_only(tmp_path):
    """Every connection: WAL (readers never block the writers) and synchronous=NORMAL (no
    fsync per commit; a killed process still loses nothing it committed)."""
    store = Store(str(tmp_path / "m.db"))
    try:
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 1   # NORMAL
    finally:
        store.close()
