"""Where a host's warm agent (elastic/launch/agent.py) listens, and which signals a
worker's shim forwards to it (an agent leaves those to the shim). The shim, which starts
every worker, needs only this: importing the agent itself costs each start ~40 ms."""
from __future__ import annotations

import os
import signal

SOCKET_PREFIX = "\0regatta-agent-"   # abstract unix socket: nothing to clean up on disk
NAMESPACE_ENV = "REGATTA_AGENT_NAMESPACE"
DIR_ENV = "REGATTA_AGENT_DIR"   # sockets as files there: they cross network namespaces
WARMING_ENV = "REGATTA_AGENTS_WARMING"   # a file that exists while the agents warm up
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def socket_name(host: str, namespace: str | None = None) -> str:
    """Agents of different launches on one machine (simulated hosts share it) must not
    serve each other's workers: the launcher's namespace keeps them apart. An abstract
    socket belongs to one network namespace, so hosts in namespaces use a file."""
    folder = os.environ.get(DIR_ENV, "")
    if folder:
        return os.path.join(folder, f"{host}.sock")
    namespace = os.environ.get(NAMESPACE_ENV, "") if namespace is None else namespace
    return f"{SOCKET_PREFIX}{namespace}-{host}" if namespace else SOCKET_PREFIX + host
