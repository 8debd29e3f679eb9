"""The dashboard in a real browser: Debian's chromium, headless, driven by playwright
against the real waitress server on a free 127.0.0.1 port, over the store of
tests/webui_fixtures.py. Charts are checked through the data Plotly holds in each graph
div; screenshots land in artifacts/screenshots/.

    .venv/bin/python -m pytest -q tests/test_browser.py
"""
import csv
import threading
from pathlib import Path

import pytest
from sqlalchemy import select

import webui_fixtures
from monitor.models import StepMetric
from monitor.sink import SQLiteSink
from monitor.store import Store
from webui.serve import make_server, stop

playwright_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = "/usr/bin/chromium"
SHOTS = Path(__file__).resolve().parents[1] / "artifacts" / "screenshots"
POLL = "?poll=300"  # the page polls every 300 ms instead of 2 s
pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian's chromium")


@pytest.fixture(scope="session")
def data(tmp_path_factory):
    return webui_fixtures.build(tmp_path_factory.mktemp("webui"))


@pytest.fixture(scope="module")
def server(data):
    srv = make_server(data["db"], port=0)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.effective_port}"
    stop(srv)
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def context(browser):
    # One context for the module: its HTTP cache keeps the 4.8 MB plotly.min.js (and
    # V8's compiled code of it) between pages, which halves every page load.
    ctx = browser.new_context(viewport={"width": 1400, "height": 900})
    yield ctx
    ctx.close()


@pytest.fixture
def page(context, server):
    """A page that records every request and every script error."""
    pg = context.new_page()
    pg.set_default_timeout(20_000)
    requests, errors = [], []
    pg.on("request", lambda r: requests.append(r.url))
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    yield pg
    pg.evaluate("() => localStorage.clear()")  # the x-axis / log-y choices are remembered
    pg.close()
    outside = [u for u in requests if not u.startswith((server + "/", "data:", "blob:"))]
    assert outside == [], "the page loaded something from outside the server"
    assert errors == [], errors


@pytest.fixture(scope="module")
def store(data):
    s = Store(data["db"])
    yield s
    s.close()


def trace(page, div, name):
    """x and y of the named trace of a Plotly graph div, once it exists."""
    page.wait_for_function("([d, n]) => { const g = document.getElementById(d);"
                           " return g && g.data && g.data.some(t => t.name === n); }", arg=[div, name])
    return page.evaluate("([d, n]) => { const t = document.getElementById(d).data.find("
                         "t => t.name === n); return {x: Array.from(t.x), y: Array.from(t.y)}; }",
                         [div, name])


def layout(page, div):
    return page.evaluate("d => JSON.parse(JSON.stringify(document.getElementById(d).layout))", div)


def rank_rows(store, run_id, rank):
    with store.engine.connect() as conn:
        return list(conn.execute(select(StepMetric.step, StepMetric.step_time, StepMetric.loss)
                                 .where(StepMetric.run_id == run_id, StepMetric.rank == rank)
                                 .order_by(StepMetric.step)))


def shot(page, name):
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.wait_for_timeout(300)  # let Plotly finish its transitions
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def test_runs_list_shows_the_runs(page, server, data):
    page.goto(server + "/")
    row = page.locator(f'tr[data-run="{data["main"]}"]')
    row.wait_for()
    assert "finished" in row.inner_text()
    elastic = page.locator(f'tr[data-run="{data["elastic"]}"]').inner_text()
    assert "running" in elastic and "6 (4–6)" in elastic and "1 / 1" in elastic
    shot(page, "runs")


def test_run_page_charts_hold_the_stored_numbers(page, server, data, store):
    page.goto(f"{server}/runs/{data['main']}")
    rows = rank_rows(store, data["main"], 0)
    steptime = trace(page, "chart-steptime", "rank 0")
    assert steptime["x"] == [r.step for r in rows]
    assert steptime["y"] == pytest.approx([r.step_time for r in rows], rel=1e-12)
    if len({r.step for r in rows}) == len(rows) and store.count("step", data["main"]) == len(rows):
        loss = trace(page, "chart-loss", "raw")  # one rank: the run's loss is rank 0's
        assert loss["y"] == pytest.approx([r.loss for r in rows], rel=1e-12)
    heat = page.evaluate("() => document.getElementById('chart-heatmap').data[0].z[0]")
    assert heat == pytest.approx([r.step_time for r in rows], rel=1e-12)
    page.locator("#tiles .tile").first.wait_for()
    shot(page, "run-main")


def test_failure_is_marked_and_costed(page, server, data):
    page.goto(f"{server}/runs/{data['elastic']}")
    trace(page, "chart-throughput", "total")
    lines = layout(page, "chart-throughput")["shapes"]
    assert any(s["x0"] == 28 and s["line"]["color"] == "#dc2626" for s in lines)
    marker = page.locator("#chart-throughput .annotation-text", has_text="host-b")
    marker.wait_for(state="visible")
    row = page.locator("#recoveries tr.recovery.failure")
    assert row.locator("td").all_inner_texts()[:3] == ["failure", "host-b", "28"]
    assert row.locator("td").nth(8).inner_text() == "3"  # steps redone
    shot(page, "run-elastic")


def _write_step(store, run_id, step, step_time):
    """The next step of every rank (its last row, 80 ms later, with rank 0 taking
    ``step_time``), written the way a worker's sink writes it."""
    with store.engine.connect() as conn:
        last = [r._asdict() for r in conn.execute(
            select(StepMetric).where(StepMetric.run_id == run_id,
                                     StepMetric.step == select(StepMetric.step).where(
                                         StepMetric.run_id == run_id)
                                     .order_by(StepMetric.wall_time.desc()).limit(1)
                                     .scalar_subquery()))]
    sink = SQLiteSink(store.path, spool_dir=str(Path(store.path).parent / "spool"))
    for row in last:
        row = {k: v for k, v in row.items() if k not in ("id", "uid")}  # the store's own keys
        row.update(type="step", step=step, wall_time=row["wall_time"] + 0.08)
        if row["rank"] == 0:
            row["step_time"] = step_time
        sink.emit(row)
    sink.close()


def _has_point(page, step, value):
    page.wait_for_function("([s, v]) => { const t = document.getElementById('chart-steptime')"
                           ".data.find(t => t.name === 'rank 0'); const i = t.x.indexOf(s);"
                           " return i >= 0 && Math.abs(t.y[i] - v) < 1e-12; }", arg=[step, value])


def test_live_update_and_pause(page, server, data, store):
    page.goto(f"{server}/runs/{data['elastic']}{POLL}")
    last = trace(page, "chart-steptime", "rank 0")["x"][-1]
    page.evaluate("() => { window.notReloaded = true; }")
    _write_step(store, data["elastic"], last + 1, 0.0812345)
    _has_point(page, last + 1, 0.0812345)
    assert page.evaluate("() => window.notReloaded === true")
    page.click("#pause")
    assert page.inner_text("#live-label") == "paused"
    _write_step(store, data["elastic"], last + 2, 0.0823456)
    page.wait_for_timeout(1500)  # five polling periods
    assert last + 2 not in trace(page, "chart-steptime", "rank 0")["x"]
    page.click("#pause")
    _has_point(page, last + 2, 0.0823456)


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


def test_time_axis_and_log_y(page, server, data, store):
    page.goto(f"{server}/runs/{data['main']}")
    rows = rank_rows(store, data["main"], 0)
    trace(page, "chart-steptime", "rank 0")
    page.click("[data-x=time]")
    page.wait_for_function("() => document.getElementById('chart-steptime').layout"
                           ".xaxis.title.text === 'seconds since start'")
    started = store.run(data["main"])["started_at"]
    with store.engine.connect() as conn:
        first_time = conn.execute(select(StepMetric.wall_time).where(
            StepMetric.run_id == data["main"], StepMetric.rank == 0,
            StepMetric.step == rows[0].step)).scalar()
    assert trace(page, "chart-steptime", "rank 0")["x"][0] == pytest.approx(first_time - started)
    page.check("#logy")
    assert layout(page, "chart-steptime")["yaxis"]["type"] == "log"


def test_pipeline_view_and_comparison(page, server, data):
    page.goto(f"{server}/runs/{data['pipeline']}")
    trace(page, "chart-bubble", "stage 1")
    assert page.locator("#pipeline-section").is_visible()
    shot(page, "run-pipeline")
    page.goto(f"{server}/compare?runs={data['main']},{data['elastic']}")
    for run in (data["main"], data["elastic"]):
        assert trace(page, "cmp-loss", run)["x"]
    shot(page, "compare")


def test_dark_mode_follows_the_system(page, server, data):
    page.emulate_media(color_scheme="dark")
    page.goto(f"{server}/runs/{data['elastic']}")
    trace(page, "chart-throughput", "total")
    background = page.evaluate("() => getComputedStyle(document.body).backgroundColor")
    assert background == "rgb(15, 20, 25)"
    assert layout(page, "chart-throughput")["font"]["color"].lower() == "#e3e8ee"
    shot(page, "run-elastic-dark")
