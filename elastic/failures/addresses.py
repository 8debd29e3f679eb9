"""Which of this machine's addresses peers reach a host at (lifelines, the pipeline's
Gloo group): simulated hosts are addresses of one machine, real ones have a Gloo NIC."""
from __future__ import annotations

import os
import socket

import psutil


def host_address(host: str) -> str:
    """The address peers reach this host at: the launcher's host name when it is one of
    this machine's addresses (simulated hosts), else the Gloo interface's IPv4."""
    local = {a.address: nic for nic, addrs in psutil.net_if_addrs().items() for a in addrs
             if a.family == socket.AF_INET}
    try:
        resolved = socket.gethostbyname(host)
    except OSError:
        resolved = ""
    if resolved in local:
        return resolved
    iface = os.environ.get("HOROVOD_GLOO_IFACE", "")
    return next((a for a, nic in local.items() if nic == iface), resolved or "127.0.0.1")
