"""Serve the dashboard and the ingest API with waitress (a production WSGI server).

    regatta ui --db runs/regatta.db [--host 127.0.0.1] [--port 8050]
    regatta ui --db postgresql+psycopg://regatta@db/regatta --host 0.0.0.0 \
        --allow-host dash.example.org --token-file /etc/regatta/ingest \
        --read-token-file /etc/regatta/read
    .venv/bin/python -m webui.serve --db runs/regatta.db --port 8050

It binds 127.0.0.1 unless told otherwise: exposing it to a network is a decision to take
on purpose (``--host 0.0.0.0``), best with a read token. Workers on other machines write
only with the ingest token, read from REGATTA_INGEST_TOKEN or ``--token-file`` (a token on
the command line is visible to every user in ``ps``). Bodies above ``--max-body-mb`` are
refused by waitress before they are read. At start, rows that finished producers on this
machine left spooled for this store or this server are delivered (monitor.replay).
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Optional
from urllib.parse import urlsplit

from webui import WebConfig, create_app

DEFAULT_PORT = 8050
log = logging.getLogger("regatta.webui")


def make_server(db: str, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                token: Optional[str] = None, threads: int = 8,
                config: Optional[WebConfig] = None, spool_dir: Optional[str] = None):
    """A waitress server for the app, bound but not yet serving (port 0: any free port,
    see ``server.effective_port``). ``server.run()`` serves; ``stop(server)`` ends it.
    ``config`` overrides db and token; spooled rows for this store or server are
    replayed in the background (``spool_dir``: see monitor.queued)."""
    from waitress.server import create_server
    cfg = config or WebConfig(db=db, ingest_token=token)
    if host not in ("", "0.0.0.0", "::") and host not in cfg.allowed_hosts:
        cfg.allowed_hosts = tuple(cfg.allowed_hosts) + (host.lower(),)
    app = create_app(cfg)
    # ident: no "waitress" banner in headers; clear_untrusted_proxy_headers: no spoofing;
    # max_request_body_size: a body above the limit is refused before it is read.
    server = create_server(app, host=host, port=port, threads=threads, ident="regatta",
                           clear_untrusted_proxy_headers=True,
                           max_request_body_size=cfg.max_body_bytes)
    server.regatta_app = app  # waitress wraps the app; stop() needs the store it holds
    port = int(getattr(server, "effective_port", port))   # waitress gives a str
    server.regatta_replay = threading.Thread(target=replay_for, args=(app, port, spool_dir),
                                             daemon=True, name="regatta-replay")
    server.regatta_replay.start()
    return server


def replay_for(app, port: int, spool_dir: Optional[str] = None) -> None:
    """Deliver spooled rows whose destination is this server's store, or this server
    (an ingest URL on its port naming this machine), straight into the store."""
    from monitor.replay import replay
    from monitor.sink import destination_of, store_rows
    store = app.extensions["regatta_store"]
    local = {"localhost", "127.0.0.1", "::1", socket.gethostname().lower(),
             socket.getfqdn().lower()} | {h.lower() for h in app.config["REGATTA"].allowed_hosts}

    def mine(destination: str) -> bool:
        if destination == destination_of(db=store.path):
            return True
        url = urlsplit(destination)
        return url.scheme in ("http", "https") and url.port == port \
            and (url.hostname or "").lower() in local

    try:
        report = replay(spool_dir, deliver=lambda rows: store_rows(store, rows), match=mine)
    except Exception:  # noqa: BLE001 - a bad spool must not stop the server
        log.exception("replaying spooled rows failed")
        return
    if report.delivered or report.left:
        log.warning("replayed %d spooled rows into the store; %d files still waiting",
                    report.delivered, len(report.left))


def _socket_map(server) -> dict:
    return server.map if hasattr(server, "map") else server._map  # several sockets or one


def stop(server) -> None:
    """Stop a server whose ``server.run()`` runs in another thread, from this one.

    run()'s loop ends once its socket map is empty; server.close() alone leaves the
    browsers' keep-alive connections in it (the loop then never ends), and closing them
    from this thread would pull sockets from under a select() in that one. So the loop's
    own thread closes everything, asked through waitress's trigger (its thunks run there).
    """
    from waitress import wasyncore
    socket_map = _socket_map(server)
    trigger = next((x for x in list(socket_map.values()) if hasattr(x, "thunks")), None)
    if trigger is not None:
        trigger.pull_trigger(lambda: wasyncore.close_all(socket_map))
        # Wait until that thread has closed them: a file descriptor it closes later could
        # by then belong to something else in this process (a next server, say).
        deadline = time.monotonic() + 60
        while socket_map and time.monotonic() < deadline:
            time.sleep(0.02)
    server.task_dispatcher.shutdown()
    server.regatta_replay.join(timeout=60)
    server.regatta_app.extensions["regatta_store"].close()


def serve(config: WebConfig, host: str = "127.0.0.1", port: int = DEFAULT_PORT) -> None:
    """Serve until interrupted, printing the URL."""
    from waitress import wasyncore
    from monitor.dialect import shown as shown_db
    server = make_server(config.db, host, port, config=config)
    shown = "127.0.0.1" if host in ("", "0.0.0.0") else host
    if threading.current_thread() is threading.main_thread():
        # SIGTERM (systemd, docker, kill) ends it as cleanly as Ctrl-C does; installed
        # before the URL is printed, since whoever reads it may stop the server at once.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        print(f"Regatta dashboard on http://{shown}:{getattr(server, 'effective_port', port)}/ "
              f"(store {shown_db(config.db)}; ingest {'on' if config.ingest_token else 'off: no token'}"
              f"; reads {'need the read token' if config.read_token else 'open'})", flush=True)
        server.run()  # returns on Ctrl-C or SIGTERM, having stopped its worker threads
    finally:
        wasyncore.close_all(_socket_map(server))  # the loop is over: close here
        server.task_dispatcher.shutdown()
        server.regatta_app.extensions["regatta_store"].close()


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``ui`` to the ``regatta`` command's subparsers; it runs ``main(args)``."""
    p = subparsers.add_parser("ui", help="serve the dashboard and the ingest API",
                              description="Serve the Regatta dashboard over a metrics store.")
    _arguments(p)
    p.set_defaults(func=main)
    return p


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", required=True, metavar="PATH_OR_URL",
                   help="metrics store: a SQLite file or a SQLAlchemy URL "
                        "(postgresql+psycopg://user@host/db)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default %(default)s; 0.0.0.0 exposes it)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="default %(default)s")
    p.add_argument("--token-file", metavar="FILE",
                   help="file holding the bearer token for ingest and run edits "
                        "(default: $REGATTA_INGEST_TOKEN; none: both refused)")
    p.add_argument("--token", help=argparse.SUPPRESS)   # visible in ps: kept for old scripts
    p.add_argument("--read-token-file", metavar="FILE",
                   help="file holding a token needed to read pages and the API "
                        "(default: $REGATTA_READ_TOKEN; none: reads are open)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="a Host name clients use for this server (besides localhost and "
                        "IP addresses); '.example.org' allows its subdomains")
    p.add_argument("--max-body-mb", type=float, default=16.0,
                   help="largest request body accepted (default %(default)s)")


def _secret(path: Optional[str], env: str) -> Optional[str]:
    if path:
        with open(path, encoding="utf-8") as fh:
            return fh.read().strip() or None
    return os.environ.get(env) or None


def config_from_args(args: argparse.Namespace) -> WebConfig:
    token = _secret(args.token_file, "REGATTA_INGEST_TOKEN")
    if args.token:
        print("regatta ui: --token is visible to every user in `ps`; use --token-file or "
              "REGATTA_INGEST_TOKEN", file=sys.stderr)
        token = args.token
    return WebConfig(db=args.db, ingest_token=token,
                     read_token=_secret(args.read_token_file, "REGATTA_READ_TOKEN"),
                     allowed_hosts=tuple(h.lower() for h in args.allow_host),
                     max_body_bytes=int(args.max_body_mb * 1024 * 1024))


def main(args: argparse.Namespace) -> int:
    """Run ``regatta ui`` with parsed arguments; returns the exit status."""
    serve(config_from_args(args), host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m webui.serve", description=__doc__)
    _arguments(parser)
    raise SystemExit(main(parser.parse_args()))
