"""Run ids in URL paths: any id the store can hold has exactly one path segment.

Werkzeug decodes ``%2F`` before routing, so an id holding ``/`` (runs of a script path
stored by Regatta before 2026-12-05) would never reach a ``<run:run_id>`` route, and a browser
folds an id that is ``.`` or ``..`` away as a dot segment. In a path the id is written with
``~2F`` for ``/``, ``~7E`` for ``~`` and ``~2E`` for a leading ``.``; every other character
stays as it is (percent-encoded by whoever builds the URL, as usual). New ids are safe by
construction (elastic/runtime/runs.py), so their path is the id itself.
``webui/static/common.js`` (``R.runPath``) writes the same form.
"""
from __future__ import annotations

import re

from werkzeug.routing import BaseConverter, ValidationError

_ESCAPES = {"~": "~7E", "/": "~2F"}
_CODES = {"7E": "~", "2F": "/", "2E": "."}


def to_segment(run_id: str) -> str:
    """The id as one path segment (before percent-encoding)."""
    segment = re.sub("[~/]", lambda m: _ESCAPES[m.group()], run_id)
    return "~2E" + segment[1:] if segment.startswith(".") else segment


def from_segment(segment: str) -> str:
    """The id a segment names; ValueError where no id is written that way."""
    run_id = re.sub("~(7E|2F|2E)", lambda m: _CODES[m.group(1)], segment)
    if to_segment(run_id) != segment:   # a stray ~, a ~2E inside, a raw leading .
        raise ValueError(f"{segment[:200]!r} is not a run id as a URL writes it")
    return run_id


class RunIdConverter(BaseConverter):
    """``<run:run_id>``: a malformed segment is a 404, never a 500."""

    def to_python(self, value: str) -> str:
        try:
            return from_segment(value)
        except ValueError:
            raise ValidationError() from None

    def to_url(self, value: str) -> str:
        return super().to_url(to_segment(value))
