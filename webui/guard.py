"""What stands between a browser (or a script) and the store.

- Host allow-list: a request whose Host header is not ``localhost``, an IP address, or a
  name in ``WebConfig.allowed_hosts`` (``.example.org`` allows its subdomains) gets 400.
  A page of another site that makes its name resolve to 127.0.0.1 (DNS rebinding)
  therefore cannot read a dashboard that listens there.
- Read token (optional, ``WebConfig.read_token``): every page and API read needs it,
  as ``Authorization: Bearer <token>`` (the ingest token works too) or as the cookie set
  by ``/login`` (an HMAC of the token, HttpOnly, SameSite=Strict). Static files, the
  login page and ingest (which checks its own token) are exempt.
- Every error under /api/ is a JSON object ``{"error": ...}``, 404/405/500 included.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging

from flask import Flask, current_app, jsonify, redirect, render_template, request
from werkzeug.exceptions import HTTPException

log = logging.getLogger("regatta.webui")
COOKIE = "regatta_read"
OPEN_PREFIXES = ("/static/", "/vendor/", "/login", "/api/v1/ingest")


def host_allowed(header: str, allowed) -> bool:
    """Whether a Host header names this server: localhost, an IP, or an allowed name."""
    host = (header or "").strip().lower()
    if host.startswith("["):
        name = host[1:host.find("]")] if "]" in host else host
    else:
        name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    name = name.rstrip(".")
    if name == "localhost" or name in allowed:
        return bool(name)
    return any(a.startswith(".") and name.endswith(a) for a in allowed)


def cookie_value(token: str) -> str:
    """What the login cookie holds: proof of the token, not the token."""
    return hmac.new(token.encode(), b"regatta-read-cookie", hashlib.sha256).hexdigest()


def bearer_matches(*tokens) -> bool:
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return any(t and hmac.compare_digest(given.strip().encode(), t.encode()) for t in tokens)


def _may_read(cfg) -> bool:
    if not cfg.read_token:
        return True
    cookie = request.cookies.get(COOKIE, "")
    return (hmac.compare_digest(cookie.encode(), cookie_value(cfg.read_token).encode())
            or bearer_matches(cfg.read_token, cfg.ingest_token))


def _check_request():
    cfg = current_app.config["REGATTA"]
    if not host_allowed(request.headers.get("Host", ""), {h.lower() for h in cfg.allowed_hosts}):
        message = ("Host header not allowed: start the server with --allow-host NAME for "
                   "the name clients use")
        return (jsonify(error=message), 400) if request.path.startswith("/api/") \
            else (message, 400, {"Content-Type": "text/plain; charset=utf-8"})
    if request.path.startswith(OPEN_PREFIXES) or _may_read(cfg):
        return None
    if request.path.startswith("/api/") or request.path == "/metrics":
        return jsonify(error="this dashboard needs its read token: send "
                             "'Authorization: Bearer <token>' or log in at /login"), 401, \
            {"WWW-Authenticate": "Bearer"}
    return redirect("/login?next=" + request.full_path.rstrip("?"), 303)


def _login():
    cfg = current_app.config["REGATTA"]
    target = request.values.get("next", "/")
    if not target.startswith("/") or target.startswith("//") or "\\" in target:
        target = "/"
    if request.method == "POST":
        given = request.form.get("token", "")
        if cfg.read_token and hmac.compare_digest(given.encode(), cfg.read_token.encode()):
            response = redirect(target, 303)
            response.set_cookie(COOKIE, cookie_value(cfg.read_token), httponly=True,
                                samesite="Strict", secure=request.is_secure, max_age=30 * 86400)
            return response
        return render_template("login.html", page="login", next=target, wrong=True), 401
    return render_template("login.html", page="login", next=target, wrong=False)


def _http_error(exc: HTTPException):
    if request.path.startswith("/api/"):
        return jsonify(error=exc.description or exc.name), exc.code
    return exc


def _internal_error(exc: Exception):
    if isinstance(exc, HTTPException):
        return _http_error(exc)
    log.exception("error answering %s %s", request.method, request.path)
    if request.path.startswith("/api/"):
        return jsonify(error="internal error; the server's log has the details"), 500
    return "Internal error; the server's log has the details.", 500


def install(app: Flask) -> None:
    """Add the checks and error handlers to ``app``."""
    app.before_request(_check_request)
    app.add_url_rule("/login", "login", _login, methods=["GET", "POST"])
    app.register_error_handler(HTTPException, _http_error)
    app.register_error_handler(Exception, _internal_error)
