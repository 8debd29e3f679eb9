"""Simulated hosts on one machine: loopback aliases 127.0.0.N.

Horovod treats a host as local when its address belongs to this machine, so each alias
added to ``lo`` is a separate local host to the elastic driver: no ssh involved (see
../shared/DESIGN.md). Adding an alias needs root; only aliases we added are removed.
"""
from __future__ import annotations

import ipaddress
import subprocess
from contextlib import contextmanager

import psutil

FIRST = 2   # 127.0.0.1 stays the machine's own loopback


def host_name(index: int) -> str:
    """The name of simulated host ``index`` (0-based): 127.0.0.2, 127.0.0.3, ..."""
    return str(ipaddress.IPv4Address("127.0.0.0") + FIRST + index)


def is_simulated(name: str) -> bool:
    """Whether ``name`` can be a simulated host: a loopback address from FIRST on."""
    try:
        address = ipaddress.IPv4Address(name)
    except ValueError:
        return False
    return address.is_loopback and address >= ipaddress.IPv4Address("127.0.0.0") + FIRST


def _present() -> set[str]:
    return {a.address for addrs in psutil.net_if_addrs().values() for a in addrs}


@contextmanager
def aliases(names: list[str]):
    """Ensure every name is an address of ``lo`` for the duration of the block."""
    added = []
    try:
        for name in names:
            if name in _present():
                continue
            done = subprocess.run(["ip", "addr", "add", f"{name}/8", "dev", "lo"],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"cannot add loopback alias {name} (needs root and iproute2): "
                                   f"{done.stderr.strip()}")
            added.append(name)
        yield
    finally:
        for name in added:
            subprocess.run(["ip", "addr", "del", f"{name}/8", "dev", "lo"], capture_output=True)
