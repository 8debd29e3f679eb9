"""HTML pages (runs list, one run, comparison) and the locally served plotly.js.

Pages are shells: templates carry no data and no inline script (the Content-Security-Policy
set in webui.create_app forbids it); webui/static/*.js fetch everything from /api/v1.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

import json

from flask import Blueprint, Response, abort, render_template, request, send_file

from monitor import event_kinds
from webui.api import get_store

pages = Blueprint("pages", __name__, template_folder="templates", static_folder="static",
                  static_url_path="/static")

# The plotly.js bundled with the installed plotly package: the dashboard never needs a CDN.
PLOTLY_JS = Path(str(resources.files("plotly") / "package_data" / "plotly.min.js"))


@pages.get("/")
def runs_page():
    return render_template("runs.html", page="runs")


@pages.get("/runs/<run:run_id>")
def run_page(run_id: str):
    if not get_store().count("run", run_id):
        abort(404, f"no run {run_id[:200]!r} in this store")
    return render_template("run.html", page="run", run_id=run_id)


@pages.get("/compare")
def compare_page():
    ids = [r for r in request.args.get("runs", "").split(",") if r.strip()]
    return render_template("compare.html", page="compare", run_ids=",".join(ids))


@pages.get("/vendor/event-kinds.js")
def event_kinds_js():
    """monitor.event_kinds for the pages' scripts: defined in Python, once."""
    table = json.dumps(event_kinds.as_json()).replace("<", "\\u003c")
    return Response(f"const EVENT_KINDS = Object.freeze({table});\n",
                    mimetype="text/javascript", headers={"Cache-Control": "no-cache"})


@pages.get("/vendor/plotly.min.js")
def plotly_js():
    # Cached for a day: 4.8 MB that only changes when the plotly package does.
    return send_file(PLOTLY_JS, mimetype="text/javascript", max_age=86400)
