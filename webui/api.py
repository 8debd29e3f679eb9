"""The JSON API under /api/v1: ingest and run edits (the write paths, with the ingest
token) and the run queries (with the read token, when one is set).

    POST   /api/v1/ingest                       {"rows": [...]}, bearer token
    GET    /api/v1/runs                         q, status, tag, job, limit, offset
    GET    /api/v1/runs/<id>                    one run: summary, processes, config
    PATCH  /api/v1/runs/<id>                    {"name", "tags", "notes"}, bearer token
    DELETE /api/v1/runs/<id>                    the run and every row of it, bearer token
    GET    /api/v1/runs/<id>/series             metric, by, from, to, since, max_points
    GET    /api/v1/runs/<id>/imbalance          since, max_points
    GET    /api/v1/runs/<id>/timeline           world size over time; since, max_points
    GET    /api/v1/runs/<id>/events             kinds, since (an event id)
    GET    /api/v1/runs/<id>/recoveries         what each failure / host change cost
    GET    /api/v1/runs/<id>/pipeline           per-stage busy and bubble, or null
    GET    /api/v1/runs/<id>/hosts              CPU %, memory, GPU per host over wall time;
                                                since (a wall time), max_points
    GET    /api/v1/runs/<id>/metrics/custom     names of the user-logged metrics; with
                                                name=...: its values (since, max_points)
    GET    /api/v1/event-kinds                  monitor.event_kinds as JSON
    GET    /api/v1/[runs/<id>/]export.csv|json  see webui.export
    GET    /metrics                             Prometheus text format (webui.prometheus)

Every error is a JSON object ``{"error": "<what is wrong>"}`` with a fitting status:
401/403 for credentials, 400 for a malformed body, an invalid row (the whole batch is
refused, nothing stored; ``field`` names the field) or a bad query parameter
(``parameter`` names it), 404 for an unknown run, 409 for rows of a run whose run row
has not been stored yet (send it first; sinks retry), 413 for a body above the limit.
"""
from __future__ import annotations

import json
from typing import Optional

from flask import Blueprint, Response, current_app, jsonify, request
from werkzeug.exceptions import RequestEntityTooLarge

from monitor import event_kinds
from monitor.models import READ_STATUSES, WALL
from monitor.series import BY, MAX_POINTS, SERIES_METRICS
from monitor.store import RowError, Store, UnknownRun
from webui.guard import bearer_matches
from webui.params import BadParam, Params

api = Blueprint("api", __name__, url_prefix="/api/v1")
POINTS = dict(default=MAX_POINTS, lo=1, hi=5000)


def get_store() -> Store:
    """The app's store (created by webui.create_app)."""
    return current_app.extensions["regatta_store"]


def _config():
    return current_app.config["REGATTA"]


def _error(status: int, message: str, **headers) -> tuple[Response, int, dict]:
    return jsonify(error=message), status, headers


def _refuse_unauthorised() -> Optional[tuple]:
    """An error response unless the request carries the configured bearer token."""
    expected = _config().ingest_token
    if not expected:
        return _error(403, "writing is disabled: the server has no ingest token configured")
    if not bearer_matches(expected):
        return _error(401, "missing or wrong bearer token in the Authorization header",
                      **{"WWW-Authenticate": "Bearer"})
    return None


def _json_body():
    """The request's JSON body, or a 400 error response."""
    try:
        return json.loads(request.get_data(cache=False)), None
    except (ValueError, RecursionError) as exc:  # includes bytes that are not UTF-8
        return None, _error(400, f"malformed JSON body: {str(exc)[:200]}")


@api.post("/ingest")
def ingest():
    """Store a batch ``{"rows": [...]}``; all rows are validated before any is written."""
    refused = _refuse_unauthorised()
    if refused:
        return refused
    body, bad = _json_body()
    if bad:
        return bad
    if not isinstance(body, dict) or not isinstance(body.get("rows"), list):
        return _error(400, "body must be a JSON object with a 'rows' list")
    extra = sorted(str(k)[:60] for k in set(body) - {"rows"})
    if extra:
        return _error(400, f"unknown body keys {extra}; only 'rows' is accepted")
    try:
        stored = get_store().write_rows(body["rows"])
    except UnknownRun as exc:
        return jsonify(error=str(exc), field="run_id"), 409
    except RowError as exc:  # names the row index and the field
        return jsonify(error=str(exc), field=exc.field), 400
    return jsonify(stored=stored, received=len(body["rows"]))


@api.errorhandler(RequestEntityTooLarge)
def _too_large(_exc):
    limit = current_app.config["MAX_CONTENT_LENGTH"]
    return _error(413, f"request body larger than {limit} bytes; send smaller batches")


@api.errorhandler(BadParam)
def _bad_param(exc: BadParam):
    return jsonify(error=str(exc), parameter=exc.name), 400


class NoSuchRun(LookupError):
    pass


@api.errorhandler(NoSuchRun)
def _unknown_run(exc: NoSuchRun):
    return _error(404, str(exc))


def known_run(run_id: str) -> Store:
    """The store, once it is clear that it holds ``run_id`` (its run row)."""
    store = get_store()
    if not store.count("run", run_id):
        raise NoSuchRun(f"no run {run_id[:200]!r}")
    return store


@api.get("/runs")
def runs():
    """Runs newest first with their kept summary; filtered and paged."""
    args = Params(request.args, ("q", "status", "tag", "job", "limit", "offset"))
    status = args.args.get("status") or None
    if status is not None:
        args.choice("status", READ_STATUSES, "running")
    return jsonify(get_store().runs_page(
        q=args.text("q", 200), status=status, tag=args.text("tag", 50) or None,
        job=args.text("job", 200) or None, limit=args.integer("limit", 500, lo=1, hi=5000),
        offset=args.integer("offset", 0, lo=0), lost_after=_config().lost_after_s))


@api.get("/runs/<run:run_id>")
def run(run_id: str):
    """One run: its summary, processes (host:slot with their rank now), config, failures."""
    Params(request.args, ())
    found = get_store().run(run_id, lost_after=_config().lost_after_s)
    if found is None:
        return _error(404, f"no run {run_id[:200]!r}")
    return jsonify(found)


@api.patch("/runs/<run:run_id>")
def edit_run(run_id: str):
    """Set the run's name, tags and/or notes (the ingest token is the write token)."""
    refused = _refuse_unauthorised()
    if refused:
        return refused
    body, bad = _json_body()
    if bad:
        return bad
    if not isinstance(body, dict):
        return _error(400, "body must be a JSON object with name, tags and/or notes")
    try:
        found = get_store().edit_run(run_id, body)
    except RowError as exc:
        return jsonify(error=str(exc), field=exc.field), 400
    if found is None:
        return _error(404, f"no run {run_id[:200]!r}")
    return jsonify(found)


@api.delete("/runs/<run:run_id>")
def delete_run(run_id: str):
    refused = _refuse_unauthorised()
    if refused:
        return refused
    if not get_store().delete_run(run_id):
        return _error(404, f"no run {run_id[:200]!r}")
    return jsonify(deleted=run_id)


@api.get("/runs/<run:run_id>/series")
def run_series(run_id: str):
    """One series per rank, process, host or the whole run; poll with since=cursor."""
    args = Params(request.args, ("metric", "by", "from", "to", "since", "max_points"))
    metric = args.choice("metric", SERIES_METRICS, "step_time")
    by = args.choice("by", BY, "rank")
    start, stop = args.integer("from", lo=0), args.integer("to", lo=0)
    if start is not None and stop is not None and stop < start:
        raise BadParam("to", f"must not be below from={start}, got {stop}")
    since, points = args.integer("since", lo=-1), args.integer("max_points", **POINTS)
    return jsonify(known_run(run_id).series(run_id, metric, by, since=since, start=start,
                                            stop=stop, max_points=points))


@api.get("/runs/<run:run_id>/imbalance")
def run_imbalance(run_id: str):
    """max/median across ranks of step and compute time, per step, with its wall time."""
    args = Params(request.args, ("since", "max_points"))
    since, points = args.integer("since", lo=-1), args.integer("max_points", **POINTS)
    return jsonify(known_run(run_id).imbalance(run_id, since, points))


@api.get("/runs/<run:run_id>/timeline")
def run_timeline(run_id: str):
    """World size over wall time, one point per executed step (thinned)."""
    args = Params(request.args, ("since", "max_points"))
    since, points = args.integer("since", lo=-1), args.integer("max_points", **POINTS)
    return jsonify(known_run(run_id).timeline(run_id, since, points))


@api.get("/runs/<run:run_id>/events")
def run_events(run_id: str):
    """The run's events in time order; ``since`` is the last event id already seen."""
    args = Params(request.args, ("kinds", "since"))
    kinds, since = args.kinds("kinds"), args.integer("since", lo=0)
    events = known_run(run_id).events(run_id, kinds=kinds, since_id=since)
    cursor = max((e["id"] for e in events), default=since)
    return jsonify(events=events, cursor=cursor)


@api.get("/runs/<run:run_id>/recoveries")
def run_recoveries(run_id: str):
    """Per failure or host change: seconds to detection, reset, sync, first step; redone."""
    Params(request.args, ())
    return jsonify(recoveries=known_run(run_id).recoveries(run_id))


@api.get("/runs/<run:run_id>/pipeline")
def run_pipeline(run_id: str):
    """Per-stage busy time and bubble when the run has pipeline stages, else null."""
    args = Params(request.args, ("max_points",))
    points = args.integer("max_points", **POINTS)
    return jsonify(pipeline=known_run(run_id).pipeline(run_id, points))


@api.get("/runs/<run:run_id>/hosts")
def run_hosts(run_id: str):
    """Per host over wall time: CPU % (mean of its processes' samples), memory (sum of
    its processes' RSS), GPU when sampled; poll with since=cursor (a wall time)."""
    args = Params(request.args, ("since", "max_points"))
    since = args.number("since", lo=0, hi=WALL["max"])
    points = args.integer("max_points", **POINTS)
    return jsonify(known_run(run_id).host_samples(run_id, since, points))


@api.get("/runs/<run:run_id>/metrics/custom")
def run_custom_metrics(run_id: str):
    """Without ``name``: the names logged (with counts). With it: its values in logging
    order (step, time, value, rank), ``since`` an id cursor for polling."""
    args = Params(request.args, ("name", "since", "max_points"))
    name = args.text("name", 100)
    since, points = args.integer("since", lo=0), args.integer("max_points", 2000, lo=1, hi=20000)
    store = known_run(run_id)
    if not name:
        return jsonify(names=store.metric_names(run_id))
    return jsonify(store.metric_points(run_id, name, since, points))


@api.get("/event-kinds")
def kinds():
    """Every event kind with its class (major, minor, none), label and colour."""
    Params(request.args, ())
    return jsonify(event_kinds.as_json())
