"""Host samples through the API (GET /api/v1/runs/<id>/hosts), on SQLite and PostgreSQL,
over samples written by hand so every expected number can be worked out here: CPU % is
the mean of a host's processes, memory their sum, a missing sample is carried one
bucket, samples without a slot are one process, ``since`` polls, ``max_points`` thins,
bad parameters are 400s naming them."""
import pytest

from webui import create_app

T0 = 1_000_000.0
MIB = 2**20


def samples() -> list[dict]:
    """Host a: slots 0 and 1 sample every second (phases 0.2 s and 0.7 s) for 10 s, slot
    1 misses its samples at 4 s and 5 s. Host b: one process with a GPU. Host c: an
    older producer's rows without a slot."""
    rows = [{"type": "run", "id": "h1", "job": "digits", "status": "running", "started_at": T0}]

    def sample(host, t, cpu, rss, slot=None, **gpu):
        row = {"type": "host", "run_id": "h1", "host": host, "wall_time": t,
               "cpu_percent": cpu, "rss_bytes": rss, **gpu}
        rows.append(row if slot is None else dict(row, slot=slot))
    for k in range(10):
        sample("a", T0 + k + 0.2, 40.0, 100 * MIB + k, slot=0)
        if k not in (4, 5):
            sample("a", T0 + k + 0.7, 60.0, 200 * MIB + 10 * k, slot=1)
        sample("b", T0 + k + 0.3, 90.0, 50 * MIB, slot=0, gpu_util=30.0, gpu_mem=1 << 30)
    sample("c", T0 + 0.4, 10.0, 70 * MIB)
    sample("c", T0 + 0.9, 20.0, 90 * MIB)
    return rows


@pytest.fixture
def client(db_url):
    app = create_app({"db": db_url, "ingest_token": "t0ken"})
    client = app.test_client()
    stored = client.post("/api/v1/ingest", json={"rows": samples()},
                         headers={"Authorization": "Bearer t0ken"})
    assert stored.status_code == 200, stored.get_data(as_text=True)
    yield client
    app.extensions["regatta_store"].close()


def get(client, url, status=200):
    response = client.get(url)
    assert response.status_code == status, (url, response.get_data(as_text=True)[:500])
    return response.get_json()


def test_cpu_is_the_mean_and_memory_the_sum_of_a_hosts_processes(client):
    body = get(client, "/api/v1/runs/h1/hosts")
    assert body["bucket_s"] == 2.0 and body["cursor"] == T0 + 9.7
    a, b, c = body["hosts"]
    assert (a["host"], b["host"], c["host"]) == ("a", "b", "c")
    # Buckets of 2 s from the first sample (T0 + 0.2): each holds seconds 2i and 2i + 1
    # of both slots; slot 1's bucket 2 is empty, so its bucket-1 mean stands in.
    slot1 = [200 * MIB + 10 * (2 * i + 0.5) for i in range(5)]
    slot1[2] = slot1[1]
    assert a["time"] == pytest.approx([T0 + 2 * i + 0.2 for i in range(5)])
    assert a["processes"] == [2] * 5
    assert a["cpu_percent"] == pytest.approx([50.0] * 5)
    assert a["rss_bytes"] == pytest.approx([100 * MIB + 2 * i + 0.5 + slot1[i] for i in range(5)])
    assert a["gpu_util"] == [None] * 5 and a["gpu_mem"] == [None] * 5
    assert b["rss_bytes"] == pytest.approx([50 * MIB] * 5)
    assert (b["gpu_util"], b["gpu_mem"]) == ([30.0] * 5, [1 << 30] * 5)
    # No slot: one process whose two samples of the bucket are averaged, not added.
    assert (c["processes"], c["cpu_percent"], c["rss_bytes"]) == ([1], [15.0], [80 * MIB])


def test_since_polls_and_max_points_thins(client):
    tail = get(client, f"/api/v1/runs/h1/hosts?since={T0 + 6.5}")
    a = tail["hosts"][0]
    assert a["time"][0] == pytest.approx(T0 + 6.7) and tail["cursor"] == T0 + 9.7
    assert get(client, f"/api/v1/runs/h1/hosts?since={T0 + 9.7}") == \
        {"bucket_s": None, "cursor": T0 + 9.7, "hosts": []}
    thin = get(client, "/api/v1/runs/h1/hosts?max_points=2")
    assert thin["bucket_s"] == 4.751   # 9.5 s over 2 points, the newest inside the second
    for host in thin["hosts"]:
        assert len(host["time"]) <= 2
    # host a's first point: the mean of each slot over 0.2 .. 4.95 s, added up
    first = thin["hosts"][0]["rss_bytes"][0]
    assert first == pytest.approx(100 * MIB + 2 + 200 * MIB + 10 * (0 + 1 + 2 + 3) / 4)


@pytest.mark.parametrize("query, parameter", [
    ("since=soon", "since"), ("since=-1", "since"), ("since=nan", "since"),
    ("since=inf", "since"), ("since=1e300", "since"), ("max_points=0", "max_points"),
    ("host=a", "host"), ("since=1&since=2", "since")])
def test_bad_parameters_are_400_naming_them(client, query, parameter):
    body = get(client, f"/api/v1/runs/h1/hosts?{query}", 400)
    assert body["parameter"] == parameter and f"'{parameter}'" in body["error"]


def test_unknown_run_is_404(client):
    assert get(client, "/api/v1/runs/ghost/hosts", 404)["error"] == "no run 'ghost'"
