"""The JSON API under /api/v1: ingest (the only write path) and read-only run queries.

Every error is a JSON object ``{"error": "<what is wrong>"}`` with a fitting status:
401/403 for credentials, 400 for a malformed body or an invalid row (the whole batch is
refused and nothing stored), 413 for a body above the configured size limit.
"""
from __future__ import annotations

import hmac
import json
from typing import Optional

from flask import Blueprint, Response, current_app, jsonify, request
from werkzeug.exceptions import RequestEntityTooLarge

from monitor.store import Store

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


@api.get("/runs")
def runs():
    """Every run, newest first."""
    return jsonify(runs=get_store().runs())


@api.get("/runs/<run_id>")
def run(run_id: str):
    """One run with a summary of what was recorded."""
    found = get_store().run(run_id)
    if found is None:
        return _error(404, f"no run {run_id!r}")
    return jsonify(found)
