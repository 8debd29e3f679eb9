"""The dashboard in a real browser: Debian's chromium, headless, driven by playwright
against the real waitress server on a free 127.0.0.1 port, over the store of
tests/webui_fixtures.py, on SQLite and, for what reads the store, on PostgreSQL too (one browser).
Charts are checked through the data Plotly holds in each graph div; screenshots land in
artifacts/screenshots/.

    .venv/bin/python -m pytest -q tests/test_browser.py
"""
import csv

import pytest
from sqlalchemy import func, select

import browsing
import webui_fixtures
from browsing import layout, trace
from monitor.models import CustomMetric, StepMetric
from monitor.sink import SqlSink
from monitor.store import Store

TOKEN = "browser-t0ken"
POLL = "?poll=300"  # the page polls every 300 ms instead of 2 s


# What reads the store runs on both backends; what only draws in the browser (escaping,
# axes, export, dark mode, the pipeline view, ...) runs on SQLite, for CI's time budget.
SQLITE_ONLY = pytest.mark.parametrize("data", ["sqlite"], indirect=True)


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def data(request, tmp_path_factory):
    pg = request.getfixturevalue("postgres") if request.param == "postgresql" else None
    built = webui_fixtures.build_on(request.param, tmp_path_factory.getbasetemp() / "webui", pg)
    return dict(built, kind=request.param, spool=str(tmp_path_factory.mktemp("spool")))


@pytest.fixture(scope="module")
def server(data):
    with browsing.serving(data["db"], data["spool"], ingest_token=TOKEN,
                          lost_after_s=webui_fixtures.LOST_AFTER_S) as url:
        yield url


@pytest.fixture(scope="module")
def store(data):
    s = Store(data["db"])
    yield s
    s.close()


def rank_rows(store, run_id, rank):
    with store.engine.connect() as conn:
        return list(conn.execute(select(StepMetric.step, StepMetric.step_time, StepMetric.loss)
                                 .where(StepMetric.run_id == run_id, StepMetric.rank == rank)
                                 .order_by(StepMetric.step)))


def shot(page, name, data):
    browsing.shot(page, f"{name}-{data['kind']}")


def test_runs_list_shows_the_runs(page, server, data):
    page.goto(server + "/")
    row = page.locator(f'tr[data-run="{data["main"]}"]')
    row.wait_for()
    assert "finished" in row.inner_text()
    elastic = page.locator(f'tr[data-run="{data["elastic"]}"]').inner_text()
    assert "running" in elastic and "6 (4–6)" in elastic and "1 / 1" in elastic
    assert "elastic demo" in elastic and "demo" in elastic
    assert "lost" in page.locator(f'tr[data-run="{data["lost"]}"]').inner_text()
    shot(page, "runs", data)
    page.fill("#filters input[name=q]", "DEMO")
    page.click("#filters button[type=submit]")
    page.wait_for_function("() => document.querySelectorAll('#runs tbody tr').length === 1")
    assert page.locator("#runs tbody tr").get_attribute("data-run") == data["elastic"]
    assert "q=DEMO" in page.url


def test_run_page_charts_hold_the_stored_numbers(page, server, data, store):
    page.goto(f"{server}/runs/{data['main']}")
    rows = rank_rows(store, data["main"], 0)
    page.select_option("#by", "rank")
    steptime = trace(page, "chart-steptime", "rank 0")
    assert steptime["x"] == [r.step for r in rows]
    assert steptime["y"] == pytest.approx([r.step_time for r in rows], rel=1e-12)
    if len({r.step for r in rows}) == len(rows) and store.count("step", data["main"]) == len(rows):
        loss = trace(page, "chart-loss", "raw")  # one rank: the run's loss is rank 0's
        assert loss["y"] == pytest.approx([r.loss for r in rows], rel=1e-12)
    heat = page.evaluate("() => document.getElementById('chart-heatmap').data[0].z[0]")
    assert heat == pytest.approx([r.step_time for r in rows], rel=1e-12)
    page.locator("#tiles .tile").first.wait_for()
    shot(page, "run-main", data)


@SQLITE_ONLY
def test_demo_like_run_reads_well(page, server, data, store):
    """Major events are labelled lines naming the host affected; commits, checkpoints
    and the repeated straggler flags are a low rug that the box toggles; a process's line
    breaks where it was absent; processes are host:slot with the rank in the hover."""
    page.goto(f"{server}/runs/{data['elastic']}")
    trace(page, "chart-throughput", "total")
    lay = layout(page, "chart-steptime")
    lines = [(s["x0"], s["line"]["color"]) for s in lay["shapes"]]
    assert lines == [(28, "#dc2626"), (40, "#16a34a")]   # the failure, host-b back; no commits
    labels = [a["text"] for a in lay["annotations"]]
    assert labels == ["✖ host-b", "+ host-b"]   # the host that died, not the one recording it
    rug = page.evaluate("() => document.getElementById('chart-steptime').data"
                        ".find(t => t.name === 'events').y")
    minor = sum(1 for y in rug if y < 0.5)
    assert minor >= 10 and rug.count(0.97) == 2   # commits + straggler flags at the bottom
    page.uncheck("#minor")
    page.wait_for_function("() => document.getElementById('chart-steptime').data"
                           ".find(t => t.name === 'events').y.length === 2")
    page.check("#minor")
    # host-b:0 is absent from step 29 to 40: its line has a gap, not a straight join
    b = trace(page, "chart-steptime", "host-b:0")
    gap = b["x"].index(None)
    assert b["x"][gap - 1] == 28 and b["x"][gap + 1] == 41 and b["y"][gap] is None
    with store.engine.connect() as conn:
        ranks = dict(conn.execute(select(StepMetric.step, func.max(StepMetric.rank)).where(
            StepMetric.run_id == data["elastic"], StepMetric.host == "host-c",
            StepMetric.slot == 1).group_by(StepMetric.step)).all())
    hover = page.evaluate("() => document.getElementById('chart-steptime').data"
                          ".find(t => t.name === 'host-c:1').customdata")
    assert {step: rank for step, rank in hover if step is not None} == ranks
    seq = [ranks[k] for k in sorted(ranks)]
    assert sum(a != b for a, b in zip(seq, seq[1:])) == 2   # renumbered twice, one line
    row = page.locator("#recoveries tr.recovery.failure")
    cells = row.locator("td").all_inner_texts()
    assert cells[:4] == ["failure", "host-b", "kill (injected)", "28"]
    assert cells[5] == "0.15 s"   # detected: measured from the kill
    assert cells[9] == "3"  # steps redone
    shot(page, "run-elastic", data)


def test_logged_metrics_config_and_editing(page, server, data, store):
    page.goto(f"{server}/runs/{data['elastic']}")
    with store.engine.connect() as conn:
        stored = conn.execute(select(CustomMetric.step, CustomMetric.value).where(
            CustomMetric.run_id == data["elastic"]).order_by(CustomMetric.id)).all()
    page.locator('[data-metric="eval/loss"]').wait_for()
    chart = page.evaluate("() => { const t = document.querySelector('[data-metric=\"eval/loss\"]')"
                          ".data[0]; return {x: t.x, y: t.y}; }")
    assert chart == {"x": [s for s, _ in stored], "y": [v for _, v in stored]}
    config = dict(tuple(r) for r in page.locator("#config tbody tr").evaluate_all(
        "rows => rows.map(r => [...r.cells].map(c => c.textContent))"))
    assert config == {"train.steps": "60", "train.lr": "0.05", "model.hidden": "512"}
    page.evaluate(f"() => sessionStorage.setItem('regatta.token', '{TOKEN}')")
    before = store.run(data["elastic"])
    try:
        page.fill("#manage textarea[name=notes]", "looked fine")
        page.fill("#manage input[name=tags]", "demo, elastic, reviewed")
        page.click("#save-run")
        page.wait_for_function("() => document.getElementById('manage-status').textContent"
                               " === 'saved'")
        run = store.run(data["elastic"])
        assert (run["notes"], run["tags"]) == ("looked fine", ["demo", "elastic", "reviewed"])
        assert page.locator("#run-tags .tag").all_inner_texts() == ["demo", "elastic", "reviewed"]
    finally:   # the session's store is shared with the API tests
        store.edit_run(data["elastic"], {"tags": before["tags"], "notes": before["notes"]})


@SQLITE_ONLY
def test_markup_in_names_is_shown_not_run(page, server, data):
    page.goto(f"{server}/runs/{data['failed']}")
    trace(page, "chart-throughput", webui_fixtures.EVIL_HOST.replace("<", "&#60;")
          .replace(">", "&#62;").replace('"', "&#34;"))
    legend = page.locator("#chart-throughput .legendtext").evaluate_all(
        "els => els.map(e => e.textContent)")
    assert webui_fixtures.EVIL_HOST in legend   # the text as it is
    assert page.locator('a[href="/evil"]').count() == 0   # never a link
    assert page.locator("#run-error").inner_text() == "Failed: CUDA out of memory"


def _write_step(store, run_id, step, step_time, spool_dir):
    """The next step of every rank (its last row, 80 ms later, with rank 0 taking
    ``step_time``), written the way a worker's sink writes it."""
    with store.engine.connect() as conn:
        last = [r._asdict() for r in conn.execute(
            select(StepMetric).where(StepMetric.run_id == run_id,
                                     StepMetric.step == select(StepMetric.step).where(
                                         StepMetric.run_id == run_id)
                                     .order_by(StepMetric.wall_time.desc()).limit(1)
                                     .scalar_subquery()))]
    sink = SqlSink(store.path, spool_dir=spool_dir)
    for row in last:
        row = {k: v for k, v in row.items() if k not in ("id", "uid")}  # the store's own keys
        row.update(type="step", step=step, wall_time=row["wall_time"] + 0.08)
        if row["rank"] == 0:
            row["step_time"] = step_time
        sink.emit(row)
    sink.close()


def _has_point(page, step, value):
    page.wait_for_function("([s, v]) => { const t = document.getElementById('chart-steptime')"
                           ".data.find(t => t.name === 'host-a:0'); const i = t.x.indexOf(s);"
                           " return i >= 0 && Math.abs(t.y[i] - v) < 1e-12; }", arg=[step, value])


def test_live_update_and_pause(page, server, data, store):
    page.goto(f"{server}/runs/{data['elastic']}{POLL}")
    last = trace(page, "chart-steptime", "host-a:0")["x"][-1]
    page.evaluate("() => { window.notReloaded = true; }")
    _write_step(store, data["elastic"], last + 1, 0.0812345, data["spool"])
    _has_point(page, last + 1, 0.0812345)
    assert page.evaluate("() => window.notReloaded === true")
    page.click("#pause")
    assert page.inner_text("#live-label") == "paused"
    # a refresh already under way when the pause was clicked may still draw; wait it out
    page.wait_for_function("() => !document.getElementById('live-dot').classList.contains('busy')")
    _write_step(store, data["elastic"], last + 2, 0.0823456, data["spool"])
    page.wait_for_timeout(1500)  # five polling periods
    assert last + 2 not in trace(page, "chart-steptime", "host-a:0")["x"]
    page.click("#pause")
    _has_point(page, last + 2, 0.0823456)


@SQLITE_ONLY
def test_export_downloads_the_rows(page, server, data, store):
    page.goto(f"{server}/runs/{data['main']}")
    with page.expect_download() as download:
        page.click("#export-csv")
    path = download.value.path()
    assert download.value.suggested_filename.endswith("-steps.csv")
    with open(path, newline="") as f:
        table = list(csv.DictReader(f))
    assert len(table) == store.count("step", data["main"])
    assert {r["run_id"] for r in table} == {data["main"]}


@SQLITE_ONLY
def test_time_axis_and_log_y(page, server, data, store):
    page.goto(f"{server}/runs/{data['main']}")
    rows = rank_rows(store, data["main"], 0)
    page.select_option("#by", "rank")
    trace(page, "chart-steptime", "rank 0")
    page.click("[data-x=time]")
    page.wait_for_function("() => document.getElementById('chart-steptime')?.layout"
                           "?.xaxis?.title?.text === 'seconds since start'")
    started = store.run(data["main"])["started_at"]
    with store.engine.connect() as conn:
        first_time = conn.execute(select(StepMetric.wall_time).where(
            StepMetric.run_id == data["main"], StepMetric.rank == 0,
            StepMetric.step == rows[0].step)).scalar()
    assert trace(page, "chart-steptime", "rank 0")["x"][0] == pytest.approx(first_time - started)
    page.check("#logy")
    assert layout(page, "chart-steptime")["yaxis"]["type"] == "log"


@SQLITE_ONLY
def test_pipeline_view_and_comparison(page, server, data):
    page.goto(f"{server}/runs/{data['pipeline']}")
    trace(page, "chart-bubble", "stage 1")
    assert page.locator("#pipeline-section").is_visible()
    shot(page, "run-pipeline", data)
    page.goto(f"{server}/compare?runs={data['pipeline']},{data['elastic']}")
    for name in ("elastic demo", data["pipeline"]):
        assert trace(page, "cmp-loss", name)["x"]
    page.locator("#config-diff tbody tr.diff").first.wait_for()
    diff = page.locator("#config-diff tbody tr").evaluate_all(
        "rows => rows.map(r => [...r.cells].map(c => c.textContent))")
    assert diff == [["parallel.pp", "2", "–"], ["train.lr", "0.1", "0.05"],
                    ["train.steps", "30", "60"]]
    page.uncheck("#only-diff")
    assert page.locator("#config-diff tbody tr").count() == 4   # model.hidden is the same
    shot(page, "compare", data)


@SQLITE_ONLY
def test_dark_mode_follows_the_system(page, server, data):
    page.emulate_media(color_scheme="dark")
    page.goto(f"{server}/runs/{data['elastic']}")
    trace(page, "chart-throughput", "total")
    background = page.evaluate("() => getComputedStyle(document.body).backgroundColor")
    assert background == "rgb(15, 20, 25)"
    assert layout(page, "chart-throughput")["font"]["color"].lower() == "#e3e8ee"
    shot(page, "run-elastic-dark", data)


def _host_chart(page, div, host):
    """The named host's points of a host chart (gaps dropped)."""
    got = trace(page, div, host.replace("<", "&#60;").replace(">", "&#62;").replace('"', "&#34;"))
    return [(x, y) for x, y in zip(got["x"], got["y"]) if y is not None]


def test_host_samples_chart_per_host(page, server, data, store):
    """CPU % and memory per host over time, as the store's read gives them (the API test
    checks that read against the samples); host-c, the busy host, stands out."""
    run = data["elastic"]
    page.goto(f"{server}/runs/{run}")
    page.click("[data-x=time]")
    started = store.run(run)["started_at"]
    expected = {h["host"]: h for h in store.host_samples(run)["hosts"]}
    assert sorted(expected) == ["host-a", "host-b", "host-c"]
    for host, want in expected.items():
        page.wait_for_function("() => document.getElementById('chart-host-cpu')?.layout"
                               "?.xaxis?.title?.text === 'seconds since start'")
        cpu = _host_chart(page, "chart-host-cpu", host)
        assert [x for x, _ in cpu] == pytest.approx([t - started for t in want["time"]])
        assert [y for _, y in cpu] == pytest.approx(want["cpu_percent"], rel=1e-12)
        mem = _host_chart(page, "chart-host-mem", host)
        assert [y for _, y in mem] == pytest.approx([v / 2**20 for v in want["rss_bytes"]], rel=1e-12)
    busy = {h: sum(v for _, v in _host_chart(page, "chart-host-cpu", h)) for h in expected}
    assert max(busy, key=lambda h: busy[h] / len(expected[h]["time"])) == "host-c"
    shot(page, "run-hosts", data)


@SQLITE_ONLY
def test_host_samples_are_live_and_names_escaped(page, server, data, store):
    run = data["elastic"]
    page.goto(f"{server}/runs/{run}{POLL}")
    page.click("[data-x=time]")
    _host_chart(page, "chart-host-mem", "host-a")
    newest = store.host_samples(run)["cursor"]   # an earlier module may have added some
    sink = SqlSink(store.path, spool_dir=data["spool"])
    for slot, rss in ((0, 111 * 2**20), (1, 222 * 2**20)):   # 7 s after every other sample
        sink.emit({"type": "host", "run_id": run, "host": "host-a", "slot": slot,
                   "wall_time": newest + 7 + 0.1 * slot, "cpu_percent": 12.5, "rss_bytes": rss})
    sink.close()
    at = newest + 7 - store.run(run)["started_at"]   # the new point's x: its first sample
    page.wait_for_function("at => { const t = document.getElementById('chart-host-mem').data"
                           ".find(t => t.name === 'host-a'); const i = t.y.length - 1;"
                           " return t.y[i] === 333 && Math.abs(t.x[i] - at) < 0.11; }", arg=at)
    x, y = _host_chart(page, "chart-host-cpu", "host-a")[-1]
    assert y == 12.5 and x == pytest.approx(at, abs=0.11)
    page.goto(f"{server}/runs/{data['failed']}")
    assert _host_chart(page, "chart-host-cpu", webui_fixtures.EVIL_HOST)
    legend = page.locator("#chart-host-mem .legendtext").evaluate_all(
        "els => els.map(e => e.textContent)")
    assert legend == [webui_fixtures.EVIL_HOST]   # the text as it is, never a link
    assert page.locator('a[href="/evil"]').count() == 0


SHARE_SHOWN = "() => { const v = document.querySelector('#share-tile .v'); return v && v.textContent !== '–'; }"


@SQLITE_ONLY
def test_a_data_loading_bottleneck_is_said_plainly(page, server, data, store):
    page.goto(f"{server}/runs/{data['loader']}")
    tile = page.locator("#share-tile")
    page.wait_for_function(SHARE_SHOWN)
    assert "alert" in tile.get_attribute("class")
    assert tile.locator(".v").inner_text().startswith("data loading ")
    assert tile.locator(".sub").inner_text() == "bottleneck: data loading"
    rows = list(store.export_rows("step", data["loader"])[1])
    share = sum(r.data_time for r in rows) / sum(r.step_time for r in rows)
    assert tile.locator(".v").inner_text() == f"data loading {100 * share:.0f} %"
    trace(page, "chart-breakdown", "data")
    assert [a["text"] for a in layout(page, "chart-breakdown")["annotations"]] == \
        ["bottleneck: data loading"]
    shot(page, "run-loader", data)
    # A run whose steps are mostly compute: no such flag anywhere.
    page.goto(f"{server}/runs/{data['elastic']}")
    page.wait_for_function(SHARE_SHOWN)
    assert page.locator("#share-tile .v").inner_text().startswith("compute ")
    assert "alert" not in page.locator("#share-tile").get_attribute("class")
    trace(page, "chart-breakdown", "data")
    assert "annotations" not in layout(page, "chart-breakdown")
    assert "bottleneck" not in page.locator("body").inner_text()
