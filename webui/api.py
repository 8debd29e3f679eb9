"""The JSON API under /api/v1: ingest (the only write path) and read-only run queries.

    POST /api/v1/ingest                       {"rows": [...]}, bearer token
    GET  /api/v1/runs                         every run with its summary
    GET  /api/v1/runs/<id>                    one run
    GET  /api/v1/runs/<id>/series             metric, by, from, to, since, max_points
    GET  /api/v1/runs/<id>/imbalance          since, max_points
    GET  /api/v1/runs/<id>/timeline           world size over time; since, max_points
    GET  /api/v1/runs/<id>/events             kinds, since (an event id)
    GET  /api/v1/runs/<id>/recoveries         what each failure / host change cost
    GET  /api/v1/runs/<id>/pipeline           per-stage busy and bubble, or null
    GET  /api/v1/[runs/<id>/]export.csv|json  see webui.export

Every error is a JSON object ``{"error": "<what is wrong>"}`` with a fitting status:
401/403 for credentials, 400 for a malformed body, an invalid row (the whole batch is
refused and nothing stored) or a bad query parameter (then ``parameter`` names it),
404 for an unknown run, 413 for a body above the configured size limit.
"""
from __future__ import annotations

import hmac
import json
from typing import Optional

from flask import Blueprint, Response, current_app, jsonify, request
from werkzeug.exceptions import RequestEntityTooLarge

from monitor.queries import MAX_POINTS
from monitor.store import Store
from webui.params import BadParam, Params
from webui.queries_extra import (BY, SERIES_METRICS, imbalance, pipeline, run_summaries,
                                 series, timeline)
from webui.recovery import recoveries

api = Blueprint("api", __name__, url_prefix="/api/v1")


def get_store() -> Store:
    """The app's store (created by webui.create_app)."""
    return current_app.extensions["regatta_store"]


def _error(status: int, message: str, **headers) -> tuple[Response, int, dict]:
    return jsonify(error=message), status, headers


def _refuse_unauthorised() -> Optional[tuple]:
    """An error response unless the request carries the configured bearer token."""
    expected = current_app.config["REGATTA"].ingest_token
    if not expected:
        return _error(403, "ingest is disabled: the server has no ingest token configured")
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    # compare_digest: the time taken must not reveal how much of the token matched
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                             expected.encode()):
        return _error(401, "missing or wrong bearer token in the Authorization header",
                      **{"WWW-Authenticate": "Bearer"})
    return None


@api.post("/ingest")
def ingest():
    """Store a batch ``{"rows": [...]}``; all rows are validated before any is written."""
    refused = _refuse_unauthorised()
    if refused:
        return refused
    try:
        body = json.loads(request.get_data(cache=False))
    except ValueError as exc:  # includes bytes that are not UTF-8
        return _error(400, f"malformed JSON body: {exc}")
    if not isinstance(body, dict) or not isinstance(body.get("rows"), list):
        return _error(400, "body must be a JSON object with a 'rows' list")
    extra = sorted(set(body) - {"rows"})
    if extra:
        return _error(400, f"unknown body keys {extra}; only 'rows' is accepted")
    try:
        stored = get_store().write_rows(body["rows"])
    except ValueError as exc:  # names the row index and the field
        return _error(400, str(exc))
    return jsonify(stored=stored, received=len(body["rows"]))


@api.errorhandler(RequestEntityTooLarge)
def _too_large(_exc):
    limit = current_app.config["MAX_CONTENT_LENGTH"]
    return _error(413, f"request body larger than {limit} bytes; send smaller batches")


@api.errorhandler(BadParam)
def _bad_param(exc: BadParam):
    return jsonify(error=str(exc), parameter=exc.name), 400


class UnknownRun(LookupError):
    pass


@api.errorhandler(UnknownRun)
def _unknown_run(exc: UnknownRun):
    return _error(404, str(exc))


def known_run(run_id: str) -> Store:
    """The store, once it is clear that it holds ``run_id`` (its run row)."""
    store = get_store()
    if not store.count("run", run_id):
        raise UnknownRun(f"no run {run_id!r}")
    return store


POINTS = dict(default=MAX_POINTS, lo=1, hi=5000)


@api.get("/runs")
def runs():
    """Every run, newest first, with world size, throughput, duration and failures."""
    Params(request.args, ())
    return jsonify(runs=run_summaries(get_store(), recoveries))


@api.get("/runs/<run_id>")
def run(run_id: str):
    """One run: what Store.run records (rows, ranks, hosts) and the runs list's summary."""
    Params(request.args, ())
    store = get_store()
    found = store.run(run_id)
    if found is None:
        return _error(404, f"no run {run_id!r}")
    for summary in run_summaries(store, recoveries, run_id):
        found.update(summary)
    return jsonify(found)


@api.get("/runs/<run_id>/series")
def run_series(run_id: str):
    """One series per rank, host or the whole run of a step metric; poll with since=cursor."""
    args = Params(request.args, ("metric", "by", "from", "to", "since", "max_points"))
    metric = args.choice("metric", SERIES_METRICS, "step_time")
    by = args.choice("by", BY, "rank")
    start, stop = args.integer("from", lo=0), args.integer("to", lo=0)
    if start is not None and stop is not None and stop < start:
        raise BadParam("to", f"must not be below from={start}, got {stop}")
    since, points = args.integer("since", lo=-1), args.integer("max_points", **POINTS)
    return jsonify(series(known_run(run_id), run_id, metric, by, since=since, start=start,
                          stop=stop, max_points=points))


@api.get("/runs/<run_id>/imbalance")
def run_imbalance(run_id: str):
    """max/median across ranks of step and compute time, per step, with its wall time."""
    args = Params(request.args, ("since", "max_points"))
    since, points = args.integer("since", lo=-1), args.integer("max_points", **POINTS)
    return jsonify(imbalance(known_run(run_id), run_id, since=since, max_points=points))


@api.get("/runs/<run_id>/timeline")
def run_timeline(run_id: str):
    """World size over wall time, one point per executed step (thinned)."""
    args = Params(request.args, ("since", "max_points"))
    since, points = args.integer("since", lo=-1), args.integer("max_points", **POINTS)
    return jsonify(timeline(known_run(run_id), run_id, since=since, max_points=points))


@api.get("/runs/<run_id>/events")
def run_events(run_id: str):
    """The run's events in time order; ``since`` is the last event id already seen."""
    args = Params(request.args, ("kinds", "since"))
    kinds, since = args.kinds("kinds"), args.integer("since", lo=0)
    events = known_run(run_id).events(run_id, kinds=kinds)
    if since is not None:
        events = [e for e in events if e["id"] > since]
    cursor = max((e["id"] for e in events), default=since)
    return jsonify(events=events, cursor=cursor)


@api.get("/runs/<run_id>/recoveries")
def run_recoveries(run_id: str):
    """Per failure or host change: seconds to detection, reset, sync, first step; redone."""
    Params(request.args, ())
    return jsonify(recoveries=recoveries(known_run(run_id).events(run_id)))


@api.get("/runs/<run_id>/pipeline")
def run_pipeline(run_id: str):
    """Per-stage busy time and bubble when the run has pipeline stages, else null."""
    args = Params(request.args, ("max_points",))
    points = args.integer("max_points", **POINTS)
    return jsonify(pipeline=pipeline(known_run(run_id), run_id, max_points=points))
