"""Regatta's web server: the dashboard and the JSON API over the metrics store.

``create_app(config)`` builds a Flask app around one Store, which this process owns as
the single writer: workers on other machines POST their rows to /api/v1/ingest. Serve it
with webui.serve (waitress): ``regatta ui --db runs/regatta.db``.
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
    from webui import export  # noqa: F401  (registers the export routes on the api)
    from webui.api import api  # here, so importing webui stays cheap
    from webui.pages import pages

    cfg = _as_config(config)
    app = Flask(__name__, static_folder=None)  # the pages blueprint serves /static
    app.config["REGATTA"] = cfg
    app.config["MAX_CONTENT_LENGTH"] = cfg.max_body_bytes
    app.extensions["regatta_store"] = Store(cfg.db)
    app.register_blueprint(api)
    app.register_blueprint(pages)
    app.after_request(_security_headers)
    return app
