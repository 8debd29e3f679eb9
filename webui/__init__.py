"""Regatta's web server: the dashboard and the JSON API over the metrics store.

``create_app(config)`` builds a Flask app around one Store, which this process owns as
the single writer: workers on other machines POST their rows to /api/v1/ingest.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional, Union

from flask import Flask

from monitor.store import Store


@dataclass
class WebConfig:
    """What the server needs: where the store is and who may write to it."""

    db: str = "regatta.db"
    ingest_token: Optional[str] = None     # None or "": ingest refused (403)
    max_body_bytes: int = 16 * 1024 * 1024  # larger POST bodies get 413


def _as_config(config: Union[dict, WebConfig, None]) -> WebConfig:
    if config is None:
        return WebConfig()
    if isinstance(config, WebConfig):
        return config
    known = {f.name for f in fields(WebConfig)}
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(f"unknown webui config keys {unknown}; expected {sorted(known)}")
    return WebConfig(**config)


def create_app(config: Union[dict, WebConfig, None] = None) -> Flask:
    """A Flask app serving the API (and, later, the pages) over the store at config.db."""
    from webui.api import api  # here, so importing webui stays cheap

    cfg = _as_config(config)
    app = Flask(__name__)
    app.config["REGATTA"] = cfg
    app.config["MAX_CONTENT_LENGTH"] = cfg.max_body_bytes
    app.extensions["regatta_store"] = Store(cfg.db)
    app.register_blueprint(api)
    return app
