"""Row validation, derived from the models so the schema is written down only once.

A row is a plain dict with a ``type`` (``run``, ``step``, ``event``, ``host``) whose other
keys are the columns of that type's model in monitor.models, plus an optional ``uid``.
Required fields are the non-nullable columns without a default. Floats accept ints; a
NaN or infinite float becomes None in a nullable column and is refused otherwise (SQLite
stores NaN as NULL, and browsers cannot parse NaN/Infinity in JSON). JSON columns
(``config``, ``detail``) take any JSON-serialisable value, or text that already is JSON.

Validation runs for every row a producer emits and every row the server ingests, so the
common case (the value already has the column's exact type) takes a fast path.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Optional

from monitor.models import MODELS

META_FIELDS = ("type", "uid")  # allowed on every row; ``run`` rows ignore the uid
_MISSING = object()


@dataclass(frozen=True)
class Field:
    """One column as a row field."""

    name: str
    typ: type
    required: bool
    nullable: bool
    default: Any
    is_json: bool
    choices: Optional[tuple]

    @property
    def plain(self) -> bool:
        """Values of the exact type need no further check (floats still need finiteness)."""
        return self.typ in (int, str) and not self.is_json and not self.choices


def _fields(model) -> tuple[Field, ...]:
    out = []
    for col in model.__table__.columns:
        if col.primary_key and col.type.python_type is int:
            continue  # surrogate key: assigned by SQLite, never sent
        out.append(Field(col.name, col.type.python_type,
                         required=not col.nullable and col.default is None,
                         nullable=bool(col.nullable),
                         default=col.default.arg if col.default is not None else None,
                         is_json=bool(col.info.get("json")), choices=col.info.get("choices")))
    return tuple(out)


FIELDS = {kind: _fields(model) for kind, model in MODELS.items()}
COLUMNS = {kind: tuple(f.name for f in fields) for kind, fields in FIELDS.items()}
_ALLOWED = {kind: frozenset(names + META_FIELDS) for kind, names in COLUMNS.items()}
_PLAIN = {kind: tuple(f.plain for f in fields) for kind, fields in FIELDS.items()}


def _check_value(kind: str, f: Field, value: Any) -> Any:
    """The slow path: return the value as stored, or raise ValueError naming the field."""
    if value is None:
        if f.nullable:
            return None
        raise ValueError(f"{kind} row: field '{f.name}' must not be null")
    if f.is_json:
        if isinstance(value, str):
            return value
        try:
            return json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{kind} row: field '{f.name}' is not JSON-serialisable: {exc}")
    if f.typ is float and type(value) is int:
        value = float(value)
    if not isinstance(value, f.typ) or isinstance(value, bool):
        raise ValueError(f"{kind} row: field '{f.name}' must be {f.typ.__name__}, "
                         f"got {type(value).__name__}")
    if f.typ is float and not math.isfinite(value):
        if f.nullable:
            return None
        raise ValueError(f"{kind} row: field '{f.name}' must be finite, got {value}")
    if f.choices and value not in f.choices:
        raise ValueError(f"{kind} row: field '{f.name}' must be one of {f.choices}, "
                         f"got {value!r}")
    return value


def normalise(row: Any) -> tuple[str, tuple]:
    """(type, the row's values in COLUMNS[type] order), or ValueError naming the field."""
    if not isinstance(row, dict):
        raise ValueError(f"row must be an object, got {type(row).__name__}")
    kind = row.get("type")
    if kind not in FIELDS:
        raise ValueError(f"field 'type' must be one of {sorted(FIELDS)}, got {kind!r}")
    if not _ALLOWED[kind].issuperset(row):
        unknown = next(name for name in row if name not in _ALLOWED[kind])
        raise ValueError(f"{kind} row: unknown field '{unknown}'")
    uid = row.get("uid")
    if uid is not None and type(uid) is not str:
        raise ValueError(f"{kind} row: field 'uid' must be str, got {type(uid).__name__}")
    values = []
    for f, plain in zip(FIELDS[kind], _PLAIN[kind]):
        v = row.get(f.name, _MISSING)
        t = type(v)
        if t is f.typ and (plain or (t is float and v - v == 0.0)):  # x-x is NaN if not finite
            values.append(v)
        elif v is _MISSING:
            if f.required:
                raise ValueError(f"{kind} row: missing required field '{f.name}'")
            values.append(f.default)
        else:
            values.append(_check_value(kind, f, v))
    return kind, tuple(values)


def validate_row(row: Any) -> dict:
    """Check one row and return it normalised (every column present, JSON as text).

    Raises ValueError naming the offending field: unknown type, missing required field,
    wrong type, or unknown field.
    """
    kind, values = normalise(row)
    return dict(zip(COLUMNS[kind], values))
