"""JSON the browser can parse: no NaN or Infinity (a derived value can overflow even
when every stored value is finite)."""
from __future__ import annotations

import math

from flask.json.provider import DefaultJSONProvider


def finite(value):
    """``value`` with every NaN or infinite float replaced by None (JSON has neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


class FiniteJSON(DefaultJSONProvider):
    """Flask's JSON, refusing to write NaN/Infinity: such floats become null (a derived
    value can overflow even when every stored value is finite)."""

    def dumps(self, obj, **kwargs):
        kwargs.setdefault("allow_nan", False)
        try:
            return super().dumps(obj, **kwargs)
        except ValueError:   # only then pay for the walk
            return super().dumps(finite(obj), **kwargs)
