"""The SQLite store: row validation, run upserts, exactly-once writes, query numbers."""
import math

import pytest

from monitor.store import Store, validate_row


@pytest.fixture
def store(tmp_path):
    s = Store(str(tmp_path / "metrics.db"))
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
    (dict(step(), uid=7), "step row: field 'uid' must be str, got int"),
    ("not a dict", "row must be an object"),
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
    assert validate_row(RUN)["config"] == '{"lr": 0.1}'


def test_bad_row_in_batch_stores_nothing(store):
    rows = [RUN, step(step=0), step(step=1, step_time="slow"), step(step=2)]
    with pytest.raises(ValueError, match=r"rows\[2\]: step row: field 'step_time'"):
        store.write_rows(rows)
    assert (store.count("run"), store.count("step")) == (0, 0)


def test_run_upsert(store):
    assert store.write_rows([RUN]) == 1
    assert store.runs()[0]["status"] == "running"
    store.write_rows([dict(RUN, status="finished", finished_at=99.0)])
    store.write_rows([RUN])  # a stale replay of the first row must not reopen the run
    assert store.runs() == [{"id": "r1", "job": "mlp", "status": "finished",
                             "started_at": 10.0, "finished_at": 99.0, "config": {"lr": 0.1},
                             "launcher": "horovodrun", "last_step": None}]
    assert store.count("run") == 1


def test_exactly_once_by_uid(store):
    first = [step(step=s, rank=r) for s in range(50) for r in range(2)]
    first.append({"type": "event", "run_id": "r1", "wall_time": 5.0, "kind": "commit",
                  "uid": "e1"})
    first.append({"type": "host", "run_id": "r1", "host": "a", "wall_time": 5.0,
                  "cpu_percent": 50.0, "rss_bytes": 1 << 20, "uid": "h1"})
    assert store.write_rows(first) == 102
    new = [step(step=s, rank=2) for s in range(10)]
    assert store.write_rows(first + new) == 10  # the replayed 102 rows are ignored
    assert (store.count("step"), store.count("event"), store.count("host")) == (110, 1, 1)


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
    assert three_ranks.run("nope") is None


def test_unknown_metric_rejected(three_ranks):
    with pytest.raises(ValueError, match="unknown metric 'speed'"):
        three_ranks.step_series("r1", "speed")
    with pytest.raises(ValueError, match="by must be"):
        three_ranks.step_series("r1", "loss", by="slot")
