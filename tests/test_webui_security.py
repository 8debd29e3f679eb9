"""What the dashboard server must never do: store rows without the ingest token, load or
point to anything outside itself, bind beyond 127.0.0.1 unasked, or echo run ids as
markup."""
import argparse
import re
import threading
import urllib.request
from pathlib import Path

import pytest

from monitor.store import Store
from webui import create_app
from webui.serve import add_parser, make_server, stop

TOKEN = "s3cret-token"
STATIC = Path(__file__).resolve().parents[1] / "webui" / "static"
URL = re.compile(r"""(?:https?:)?//[a-z0-9.-]+""", re.I)
EVIL = "<img src=x onerror=alert(1)>"


def rows():
    return [{"type": "run", "id": "r1", "job": "digits", "status": "running", "started_at": 1.0},
            {"type": "step", "run_id": "r1", "step": 1, "wall_time": 2.0, "rank": 0,
             "world_size": 1, "host": "a", "step_time": 0.1}]


@pytest.fixture
def app(tmp_path):
    app = create_app({"db": str(tmp_path / "m.db"), "ingest_token": TOKEN})
    yield app
    app.extensions["regatta_store"].close()


def counts(app):
    store = app.extensions["regatta_store"]
    return store.count("run"), store.count("step")


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": TOKEN},
                                     {"Authorization": f"Basic {TOKEN}"},
                                     {"Authorization": f"Bearer {TOKEN}x"}])
def test_ingest_without_the_token_is_401_and_stores_nothing(app, headers):
    response = app.test_client().post("/api/v1/ingest", json={"rows": rows()}, headers=headers)
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"] == "Bearer"
    assert counts(app) == (0, 0)


def test_ingest_with_the_token_stores(app):
    response = app.test_client().post("/api/v1/ingest", json={"rows": rows()},
                                      headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 200 and counts(app) == (1, 1)


def test_ingest_is_off_without_a_configured_token(tmp_path):
    app = create_app({"db": str(tmp_path / "m.db")})
    response = app.test_client().post("/api/v1/ingest", json={"rows": rows()},
                                      headers={"Authorization": "Bearer "})
    assert response.status_code == 403 and counts(app) == (0, 0)
    app.extensions["regatta_store"].close()


def _pages(client):
    return {url: client.get(url) for url in ("/", "/runs/r1", "/compare?runs=r1", "/runs/nope")}


def test_pages_point_nowhere_outside_the_server(app):
    app.extensions["regatta_store"].write_rows(rows())
    client = app.test_client()
    for url, response in _pages(client).items():
        html = response.get_data(as_text=True)
        assert URL.findall(html) == [], url
        for ref in re.findall(r"""(?:src|href)="([^"]*)\"""", html):
            assert ref.startswith(("/", "data:")) and not ref.startswith("//"), (url, ref)
            if ref.startswith("/"):  # and every referenced file is served here
                assert client.get(ref).status_code == 200, ref
    for path in sorted(STATIC.iterdir()):
        served = client.get(f"/static/{path.name}").get_data(as_text=True)
        assert URL.findall(served) == [], path.name


def test_every_response_forbids_other_origins(app):
    client = app.test_client()
    for response in list(_pages(client).values()) + [client.get("/api/v1/runs"),
                                                     client.get("/static/common.js")]:
        csp = response.headers["Content-Security-Policy"]
        assert "default-src 'self'" in csp and "script-src 'self';" in csp
        assert "connect-src 'self'" in csp and not URL.search(csp)
        assert response.headers["X-Content-Type-Options"] == "nosniff"


def test_run_ids_are_escaped(app):
    app.extensions["regatta_store"].write_rows([dict(rows()[0], id=EVIL)])
    client = app.test_client()
    html = client.get("/runs/" + urllib.request.quote(EVIL, safe="")).get_data(as_text=True)
    assert EVIL not in html and "&lt;img src=x onerror=alert(1)&gt;" in html
    disposition = client.get("/api/v1/runs/" + urllib.request.quote(EVIL, safe="")
                             + "/export.csv").headers["Content-Disposition"]
    assert disposition == 'attachment; filename="regatta-_img_src_x_onerror_alert_1__-steps.csv"'
    # the pages build every table cell with textContent, never innerHTML
    assert "innerHTML" not in "".join(p.read_text() for p in STATIC.glob("*.js"))


def test_server_binds_loopback_unless_told(tmp_path):
    server = make_server(str(tmp_path / "m.db"), port=0, spool_dir=str(tmp_path / "spool"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        assert server.effective_host == "127.0.0.1"
        with urllib.request.urlopen(f"http://127.0.0.1:{server.effective_port}/api/v1/runs",
                                    timeout=10) as response:
            assert response.headers["Server"] == "regatta"  # no server version banner
    finally:
        stop(server)
        thread.join(timeout=10)
    assert not thread.is_alive()


def test_ui_command_defaults():
    parser = argparse.ArgumentParser(prog="regatta")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["ui", "--db", "x.db"])
    assert (args.db, args.host, args.port) == ("x.db", "127.0.0.1", 8050)
    assert args.func.__module__ == "webui.serve"
    with pytest.raises(SystemExit):
        parser.parse_args(["ui"])  # --db is required


def test_tokens_come_from_the_environment_or_a_file(tmp_path, monkeypatch, capsys):
    from webui.serve import config_from_args
    parser = argparse.ArgumentParser(prog="regatta")
    add_parser(parser.add_subparsers(dest="command"))
    monkeypatch.setenv("REGATTA_INGEST_TOKEN", "from-env")
    monkeypatch.delenv("REGATTA_READ_TOKEN", raising=False)
    cfg = config_from_args(parser.parse_args(["ui", "--db", "x.db"]))
    assert (cfg.ingest_token, cfg.read_token) == ("from-env", None)
    (tmp_path / "w").write_text("from-file\n")
    (tmp_path / "r").write_text("reader\n")
    cfg = config_from_args(parser.parse_args(
        ["ui", "--db", "postgresql://u@db/x", "--token-file", str(tmp_path / "w"),
         "--read-token-file", str(tmp_path / "r"), "--allow-host", "Dash.Example.org"]))
    assert (cfg.ingest_token, cfg.read_token, cfg.allowed_hosts) == (
        "from-file", "reader", ("dash.example.org",))
    cfg = config_from_args(parser.parse_args(["ui", "--db", "x.db", "--token", "visible"]))
    assert cfg.ingest_token == "visible" and "visible to every user in `ps`" in capsys.readouterr().err
    assert "--token " not in parser.format_help()   # no longer advertised

