"""What the browser test modules share: the real waitress server over a store, a page that
fails the test on any script error or outside request, and reading what Plotly holds in
a chart div. The browser itself is the session fixture ``browser`` (tests/conftest.py).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path

from webui import WebConfig
from webui.serve import make_server, stop

SHOTS = Path(__file__).resolve().parents[1] / "artifacts" / "screenshots"


@contextmanager
def serving(db: str, spool_dir: str, **config):
    """The dashboard on a free 127.0.0.1 port over ``db``; yields its base URL."""
    srv = make_server(db, port=0, config=WebConfig(db=db, **config), spool_dir=spool_dir)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.effective_port}"
    finally:
        stop(srv)
        thread.join(timeout=10)


@contextmanager
def watched_page(context, server: str):
    """A page that records every request and every script error; on leaving, asserts
    that nothing came from outside the server and no script failed."""
    pg = context.new_page()
    pg.set_default_timeout(20_000)
    requests, errors = [], []
    pg.on("request", lambda r: requests.append(r.url))
    pg.on("pageerror", lambda e: errors.append(str(e)))
    # a failed load's message names no URL: its location does
    pg.on("console", lambda m: errors.append(f"{m.text} ({m.location.get('url')})")
          if m.type == "error" else None)
    yield pg
    pg.evaluate("() => localStorage.clear()")  # the x-axis / log-y choices are remembered
    pg.close()
    outside = [u for u in requests if not u.startswith((server + "/", "data:", "blob:"))]
    assert outside == [], "the page loaded something from outside the server"
    assert errors == [], errors


def trace(page, div, name):
    """x and y of the named trace of a Plotly graph div, once it exists."""
    page.wait_for_function("([d, n]) => { const g = document.getElementById(d);"
                           " return g && g.data && g.data.some(t => t.name === n); }", arg=[div, name])
    return page.evaluate("([d, n]) => { const t = document.getElementById(d).data.find("
                         "t => t.name === n); return {x: Array.from(t.x), y: Array.from(t.y)}; }",
                         [div, name])


def trace_names(page, div) -> list[str]:
    return page.evaluate("d => document.getElementById(d).data.map(t => t.name)", div)


def layout(page, div):
    return page.evaluate("d => JSON.parse(JSON.stringify(document.getElementById(d).layout))", div)


def shot(page, name: str):
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.wait_for_timeout(300)  # let Plotly finish its transitions
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)
