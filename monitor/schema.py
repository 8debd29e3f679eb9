"""Row validation, derived from the models so the schema is written down only once.

A row is a plain dict with a ``type`` (``run``, ``step``, ``event``, ``host``, ``metric``)
whose other keys are the columns of that type's model in monitor.models, plus an
optional ``uid``. Required fields are the non-nullable columns without a default.

What every value must be (a RowError naming the field otherwise):

- ints: Python ints (not bools) within int64, and within the column's ``min``;
- floats: ints or floats, finite, within ``min``/``max``; in a nullable column a NaN or
  infinity becomes None (browsers cannot parse NaN/Infinity in JSON);
- strings: no NUL and, in names and ids, no control characters, valid UTF-8, at most
  ``max_len`` characters, matching ``pattern`` and ``choices`` where the column says so;
- JSON columns (``config``, ``detail``): an object (a dict, or text holding one), nested
  at most 32 deep, at most 256 kB; non-finite numbers inside become null. ``tags``: a
  list of at most 50 distinct short strings;
- a step row's rank is below its world size.

Validation runs for every row a producer emits and every row the server ingests, so each
column's check is built once and the common value takes the shortest path.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any, Callable

from monitor.models import MODELS

INT64 = (-(1 << 63), (1 << 63) - 1)
MAX_JSON_BYTES = 256 * 1024
MAX_JSON_DEPTH = 32
MAX_TAGS, MAX_TAG_LEN = 50, 50
META_FIELDS = ("type", "uid")  # allowed on every row; ``run`` rows ignore the uid
_MISSING = object()
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_NUL = re.compile(r"\x00")
_SURROGATE = re.compile("[\ud800-\udfff]")


class RowError(ValueError):
    """A row the store refuses; ``field`` names the offending field (or None)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def _sanitised(value: Any, depth: int = 0) -> Any:
    """A JSON value with non-finite floats as None; refuses deep or odd structures."""
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"nested more than {MAX_JSON_DEPTH} deep")
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _sanitised(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_sanitised(v, depth + 1) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and not INT64[0] <= value <= INT64[1]:
        return float(value) if abs(value) < 1e308 else None
    if value is None or isinstance(value, (str, bool, int)):
        return value
    raise ValueError(f"holds a {type(value).__name__}, which is not JSON")


def _json_text(value: Any) -> str:
    if isinstance(value, (str, bytes)):
        value = json.loads(value)
    return json.dumps(_sanitised(value), separators=(",", ":"))


def _checker(kind: str, col) -> Callable[[Any], Any]:
    """The check of one column: value in, stored value out, RowError naming it."""
    name, info = col.name, col.info
    typ = col.type.python_type
    nullable = bool(col.nullable)
    lo, hi, max_len = info.get("min"), info.get("max"), info.get("max_len", 1_000_000)
    min_len = info.get("min_len", 0)
    choices, json_kind = info.get("choices"), info.get("json")
    pattern = re.compile(info["pattern"]) if "pattern" in info else None
    forbidden = _CONTROL if (pattern or name in ("id", "run_id", "host", "job", "name", "uid",
                                                 "launcher", "code_revision")) else _NUL

    def fail(message: str):
        raise RowError(f"{kind} row: field '{name}' {message}", name)

    def check(v):
        if v is None:
            if nullable:
                return None
            fail("must not be null")
        if json_kind:
            return check_json(v)
        t = type(v)
        if typ is float:
            if t is int:
                if not INT64[0] <= v <= INT64[1]:
                    fail(f"must be a finite number within int64 range, got {v}")
                v = float(v)
            elif t is not float:
                fail(f"must be float, got {t.__name__}")
            if not math.isfinite(v):
                if nullable:
                    return None
                fail(f"must be finite, got {v}")
        elif typ is int:
            if t is not int:
                fail(f"must be int, got {t.__name__}")
            if not INT64[0] <= v <= INT64[1]:
                fail(f"must fit in 64 bits, got {v}")
        else:
            if t is not str:
                fail(f"must be str, got {t.__name__}")
            if not min_len <= len(v) <= max_len:
                fail(f"must be {min_len}..{max_len} characters long, got {len(v)}")
            if forbidden.search(v):
                fail("must not contain control characters")
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                fail("must be valid Unicode text (no lone surrogates)")
            if pattern is not None and not pattern.fullmatch(v):
                fail(f"must match {pattern.pattern}, got {v[:60]!r}")
            if choices and v not in choices:
                fail(f"must be one of {choices}, got {v!r}")
            return v
        if lo is not None and v < lo:
            fail(f"must be >= {lo}, got {v}")
        if hi is not None and v > hi:
            fail(f"must be <= {hi}, got {v}")
        return v

    def check_json(v):
        if json_kind == "tags":
            return _tags(kind, name, v)
        try:
            text = _json_text(v)
            decoded = json.loads(text)
        except (ValueError, TypeError, RecursionError) as exc:
            fail(f"must hold a JSON object: {str(exc)[:200]}")
        if not isinstance(decoded, dict):
            fail(f"must be a JSON object, got {type(decoded).__name__}")
        if len(text) > MAX_JSON_BYTES:
            fail(f"must be at most {MAX_JSON_BYTES} bytes as JSON, got {len(text)}")
        return text

    return check


def _tags(kind: str, name: str, value: Any) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            raise RowError(f"{kind} row: field '{name}' must be a list of strings", name) from None
    return json.dumps(check_tags(value, f"{kind} row: field '{name}'", name))


def check_tags(value: Any, what: str = "field 'tags'", field: str = "tags") -> list[str]:
    """A list of distinct tags (short strings without control characters), or RowError."""
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise RowError(f"{what} must be a list of strings", field)
    if len(value) > MAX_TAGS:
        raise RowError(f"{what} must hold at most {MAX_TAGS} tags, got {len(value)}", field)
    out = []
    for tag in value:
        tag = tag.strip()
        if not 1 <= len(tag) <= MAX_TAG_LEN or _CONTROL.search(tag):
            raise RowError(f"{what}: each tag is 1..{MAX_TAG_LEN} characters without control "
                           f"characters, got {tag[:60]!r}", field)
        try:
            tag.encode("utf-8")
        except UnicodeEncodeError:
            raise RowError(f"{what}: tag {tag[:60]!r} is not valid Unicode text", field) from None
        if tag not in out:
            out.append(tag)
    return out


def _columns(model) -> list:
    return [c for c in model.__table__.columns
            if not (c.primary_key and c.type.python_type is int) and not c.info.get("derived")]


def _required(col) -> bool:
    return not col.nullable and col.default is None


def _fast_range(col) -> tuple:
    """(type, lo, hi) such that a value of exactly that type within lo..hi needs no
    further check (NaN and infinities fail the comparison); (None, 0, 0) for the rest."""
    typ, info = col.type.python_type, col.info
    if info.get("json") or typ not in (int, float):
        return None, 0, 0
    big = INT64 if typ is int else (-1.7976931348623157e308, 1.7976931348623157e308)
    lo = max(info.get("min", big[0]), big[0])
    hi = min(info.get("max", big[1]), big[1])
    return typ, lo, hi


COLUMNS = {kind: tuple(c.name for c in _columns(m)) for kind, m in MODELS.items()}
REQUIRED = {kind: frozenset(c.name for c in _columns(m) if _required(c)) for kind, m in MODELS.items()}
_FIELDS = {kind: tuple((c.name, *_fast_range(c), _checker(kind, c), _required(c),
                        c.default.arg if c.default is not None else None) for c in _columns(m))
           for kind, m in MODELS.items()}
_GOOD_TEXT: dict = {}   # (kind, field, text) already checked: run ids and hosts repeat
_ALLOWED = {kind: frozenset(names + META_FIELDS) for kind, names in COLUMNS.items()}


def normalise(row: Any) -> tuple[str, tuple]:
    """(type, the row's values in COLUMNS[type] order), or RowError naming the field."""
    if not isinstance(row, dict):
        raise RowError(f"row must be an object, got {type(row).__name__}")
    kind = row.get("type")
    if not isinstance(kind, str) or kind not in _FIELDS:
        shown = kind if isinstance(kind, str) else type(kind).__name__
        raise RowError(f"field 'type' must be one of {sorted(_FIELDS)}, got {shown!r}"[:300],
                       "type")
    if not _ALLOWED[kind].issuperset(row):
        unknown = next(name for name in row if name not in _ALLOWED[kind])
        raise RowError(f"{kind} row: unknown field '{str(unknown)[:60]}'", str(unknown)[:60])
    uid = row.get("uid")
    if uid is not None and (type(uid) is not str or not 0 < len(uid) <= 200
                            or _CONTROL.search(uid) or _SURROGATE.search(uid)):
        raise RowError(f"{kind} row: field 'uid' must be str of 1..200 characters, "
                       f"got {type(uid).__name__}", "uid")
    values = []
    for name, fast, lo, hi, check, required, default in _FIELDS[kind]:
        v = row.get(name, _MISSING)
        t = type(v)
        if t is fast and lo <= v <= hi:
            values.append(v)
        elif t is str and name != "uid" and (kind, name, v) in _GOOD_TEXT:
            values.append(v)
        elif v is _MISSING:
            if required:
                raise RowError(f"{kind} row: missing required field '{name}'", name)
            values.append(default)
        else:
            values.append(check(v))
            if t is str and values[-1] is v and len(v) <= 255 and name != "uid":
                if len(_GOOD_TEXT) > 10_000:
                    _GOOD_TEXT.clear()
                _GOOD_TEXT[(kind, name, v)] = True
    if kind == "step":
        rank, size = values[_RANK], values[_SIZE]
        if rank >= size:
            raise RowError(f"step row: field 'rank' must be below world_size={size}, "
                           f"got {rank}", "rank")
    return kind, tuple(values)


_RANK, _SIZE = COLUMNS["step"].index("rank"), COLUMNS["step"].index("world_size")


def validate_row(row: Any) -> dict:
    """Check one row and return it normalised (every column present, JSON as text).

    Raises RowError (a ValueError) naming the offending field: unknown type, missing
    required field, wrong type, value out of range, or unknown field.
    """
    kind, values = normalise(row)
    return dict(zip(COLUMNS[kind], values))
