"""Serve the dashboard and the ingest API with waitress (a production WSGI server).

    regatta ui --db runs/regatta.db [--host 127.0.0.1] [--port 8050] [--token T]
    .venv/bin/python -m webui.serve --db runs/regatta.db --port 8050

It binds 127.0.0.1 unless told otherwise: the read API has no authentication, so exposing
it to a network is a decision to take on purpose (``--host 0.0.0.0``). Workers on other
machines can only write with the ingest token (``--token`` or REGATTA_INGEST_TOKEN).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Optional

from webui import WebConfig, create_app

DEFAULT_PORT = 8050


def make_server(db: str, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                token: Optional[str] = None, threads: int = 8):
    """A waitress server for the app, bound but not yet serving (port 0: any free port,
    see ``server.effective_port``). ``server.run()`` serves; ``stop(server)`` ends it."""
    from waitress.server import create_server
    app = create_app(WebConfig(db=db, ingest_token=token))
    # ident: no "waitress" banner in headers; clear_untrusted_proxy_headers: no spoofing.
    server = create_server(app, host=host, port=port, threads=threads, ident="regatta",
                           clear_untrusted_proxy_headers=True)
    server.regatta_app = app  # waitress wraps the app; stop() needs the store it holds
    return server


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
    server.task_dispatcher.shutdown()
    server.regatta_app.extensions["regatta_store"].close()


def serve(db: str, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
          token: Optional[str] = None) -> None:
    """Serve until interrupted, printing the URL."""
    from waitress import wasyncore
    server = make_server(db, host, port, token)
    shown = "127.0.0.1" if host in ("", "0.0.0.0") else host
    print(f"Regatta dashboard on http://{shown}:{getattr(server, 'effective_port', port)}/ "
          f"(store {db}; ingest {'on' if token else 'off: no --token'})", flush=True)
    if threading.current_thread() is threading.main_thread():
        # SIGTERM (systemd, docker, kill) ends it as cleanly as Ctrl-C does.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
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
    p.add_argument("--db", required=True, metavar="PATH", help="SQLite metrics store")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default %(default)s; 0.0.0.0 exposes it)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="default %(default)s")
    p.add_argument("--token", default=os.environ.get("REGATTA_INGEST_TOKEN"),
                   help="bearer token workers must send to /api/v1/ingest "
                        "(default: $REGATTA_INGEST_TOKEN; none: ingest refused)")


def main(args: argparse.Namespace) -> int:
    """Run ``regatta ui`` with parsed arguments; returns the exit status."""
    serve(args.db, host=args.host, port=args.port, token=args.token)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m webui.serve", description=__doc__)
    _arguments(parser)
    raise SystemExit(main(parser.parse_args()))
