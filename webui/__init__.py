"""Regatta's web server: the dashboard and the JSON API over the metrics store.

``create_app(config)`` builds a Flask app around one Store (a SQLite path or any
SQLAlchemy URL), which this process owns as the single writer: workers on other
machines POST their rows to /api/v1/ingest. Serve it with webui.serve (waitress):
``regatta ui --db runs/regatta.db``. What guards it is in webui.guard: the Host
allow-list, the optional read token, JSON errors under /api/v1.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional, Union

from flask import Flask

from monitor.runs import LOST_AFTER_S
from monitor.store import Store
from webui.finite_json import FiniteJSON


@dataclass
class WebConfig:
    """What the server needs: where the store is, who may write to it and read it."""

    db: str = "regatta.db"
    ingest_token: Optional[str] = None     # None or "": ingest and edits refused (403)
    read_token: Optional[str] = None       # set: pages and API need it (cookie or bearer)
    allowed_hosts: tuple = ()              # Host header names besides localhost and IPs
    max_body_bytes: int = 16 * 1024 * 1024  # larger POST bodies get 413
    lost_after_s: float = LOST_AFTER_S     # a running run silent this long shows as lost


# Nothing a page loads may come from another origin; styles stay inline-able because
# plotly.js injects its own <style> elements, and images may be data: URIs (plotly icons).
CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
       "img-src 'self' data: blob:; connect-src 'self'; font-src 'self'; object-src 'none'; "
       "base-uri 'none'; frame-ancestors 'none'; form-action 'self'")


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


def _security_headers(response):
    response.headers.setdefault("Content-Security-Policy", CSP)
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
    response.headers.setdefault("Referrer-Policy", "no-referrer")
    response.headers.setdefault("X-Frame-Options", "DENY")
    return response


def create_app(config: Union[dict, WebConfig, None] = None) -> Flask:
    """A Flask app serving the pages and the API over the store at config.db."""
    from webui import export, prometheus  # noqa: F401  (they register routes)
    from webui.api import api  # here, so importing webui stays cheap
    from webui.guard import install
    from webui.pages import pages
    from webui.run_paths import RunIdConverter

    cfg = _as_config(config)
    app = Flask(__name__, static_folder=None)  # the pages blueprint serves /static
    app.json = FiniteJSON(app)
    app.config["REGATTA"] = cfg
    app.config["MAX_CONTENT_LENGTH"] = cfg.max_body_bytes
    app.url_map.converters["run"] = RunIdConverter   # before the routes that use it
    app.extensions["regatta_store"] = Store(cfg.db)
    install(app)
    app.register_blueprint(api)
    app.register_blueprint(pages)
    app.after_request(_security_headers)
    return app
