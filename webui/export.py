"""Downloads of what the store holds, streamed so that a large store never sits in memory.

    GET /api/v1/runs/<id>/export.csv?kind=step   one run's step rows (kind: run, step,
                                                 event, host, metric; default step)
    GET /api/v1/runs/<id>/export.json            one run: {"runs", "steps", "events",
                                                 "hosts", "metrics"}
    GET /api/v1/export.csv?kind=step             every run
    GET /api/v1/export.json                      every run

Columns are the store's own (monitor.models); in JSON the ``config`` and ``detail``
columns are decoded into objects (one that is not valid JSON, from an older store, stays
text), in CSV they stay JSON text; non-finite numbers are written as null.
"""
from __future__ import annotations

import csv
import io
import json
import re
from typing import Iterator, Optional

from flask import Response, request

from webui.finite_json import finite
from webui.api import api, get_store, known_run
from webui.params import Params

KINDS = ("run", "step", "event", "host", "metric")
_JSON_KEYS = {"run": "runs", "step": "steps", "event": "events", "host": "hosts",
              "metric": "metrics"}
_JSON_COLUMNS = ("config", "detail", "tags")


def _decoded(value):
    try:
        return json.loads(value)
    except (TypeError, ValueError, RecursionError):
        return value


def _filename(run_id: Optional[str], what: str, ext: str) -> str:
    # Run ids come from workers; keep the header value a plain, safe file name.
    name = re.sub(r"[^A-Za-z0-9._-]", "_", run_id or "all")[:80]
    return f"regatta-{name}-{what}.{ext}"


def _download(body: Iterator[str], mimetype: str, filename: str) -> Response:
    return Response(body, mimetype=mimetype, headers={
        "Content-Disposition": f'attachment; filename="{filename}"',
        "Cache-Control": "no-store"})


# The generators get the store as an argument: they run after the request context is gone.
def _csv(store, kind: str, run_id: Optional[str]) -> Iterator[str]:
    columns, rows = store.export_rows(kind, run_id)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(columns)
    for i, row in enumerate(rows, 1):
        writer.writerow(row)
        if i % 1000 == 0:  # yield in chunks: one write per row would be slow
            yield buffer.getvalue()
            buffer.seek(0)
            buffer.truncate()
    yield buffer.getvalue()


def _json(store, run_id: Optional[str]) -> Iterator[str]:
    yield "{"
    for n, kind in enumerate(KINDS):
        yield ("," if n else "") + json.dumps(_JSON_KEYS[kind]) + ":["
        columns, rows = store.export_rows(kind, run_id)
        decode = [c in _JSON_COLUMNS for c in columns]
        for i, row in enumerate(rows):
            record = {c: (_decoded(v) if d and v is not None else v)
                      for c, v, d in zip(columns, row, decode)}
            yield ("," if i else "") + json.dumps(finite(record), separators=(",", ":"))
        yield "]"
    yield "}\n"


def _csv_response(run_id: Optional[str]) -> Response:
    kind = Params(request.args, ("kind",)).choice("kind", KINDS, "step")
    return _download(_csv(get_store(), kind, run_id), "text/csv",
                     _filename(run_id, kind + "s", "csv"))


@api.get("/runs/<run:run_id>/export.csv")
def export_run_csv(run_id: str):
    known_run(run_id)
    return _csv_response(run_id)


@api.get("/export.csv")
def export_all_csv():
    return _csv_response(None)


@api.get("/runs/<run:run_id>/export.json")
def export_run_json(run_id: str):
    Params(request.args, ())
    known_run(run_id)
    return _download(_json(get_store(), run_id), "application/json",
                     _filename(run_id, "all", "json"))


@api.get("/export.json")
def export_all_json():
    Params(request.args, ())
    return _download(_json(get_store(), None), "application/json",
                     _filename(None, "all", "json"))
