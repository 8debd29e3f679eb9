"""Simulated hosts in network namespaces: each host its own network stack, joined to the
others by a veth pair and a bridge, so a host can vanish (its link goes down: no FIN, no
RST, packets simply disappear), be partitioned and come back, or sit behind a slow link.

Everything is built inside a private user + network + PID namespace (:func:`private`),
so no root is needed and nothing is left on the machine's network when the launcher
ends: the kernel removes the namespaces, links and processes with their last process.

    hub namespace (the launcher, horovodrun, the shims)  bridge rg0 10.77.0.1/24
      |-- veth rgv0 <-> rg0 10.77.0.10 in host 0's namespace (its warm agent, its workers)
      |-- veth rgv1 <-> rg0 10.77.0.11 in host 1's namespace ...

The bridge in the hub and each host's interface share one name (``rg0``): Horovod hands
every worker the launcher's ``--network-interface``. Each host also has its own host
name (``sim-host0``...; a UTS namespace) that the private ``/etc/hosts`` maps to its
address: Horovod builds its process-set Gloo contexts on the machine's host name, not on
the interface. A host's namespaces are held by a ``sleep`` process; anything is started
inside them with ``nsenter``.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field

SUBNET = "10.77.0"
INTERFACE = "rg0"
FIRST_HOST = 10
PRIVATE_ENV = "REGATTA_PRIVATE_NETWORK"   # set inside the namespaces private() enters


class NetnsError(RuntimeError):
    """Namespaces cannot be made here; the message says what failed."""


def _ip(*args: str, holder: int | None = None) -> None:
    command = ["ip", *args] if holder is None else ["nsenter", "-t", str(holder), "-n", "ip", *args]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise NetnsError(f"{' '.join(command)}: {done.stderr.strip()}")


def private(argv: list[str]) -> list[str]:
    """``argv`` run as root of its own user, network and PID namespaces. When its first
    process ends, the kernel kills every process inside and removes every link."""
    return ["unshare", "--user", "--map-root-user", "--net", "--pid", "--fork",
            "--mount-proc", "--kill-child", *argv]


def inside_private() -> bool:
    return os.environ.get(PRIVATE_ENV) == "1"


def available() -> str:
    """Empty when private namespaces work here, else why not."""
    for tool in ("unshare", "nsenter", "ip"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    probe = subprocess.run(private(["ip", "link", "add", "probe0", "type", "bridge"]),
                           capture_output=True, text=True)
    return "" if probe.returncode == 0 else f"unshare refused: {probe.stderr.strip()}"


def _settled(holder: subprocess.Popen, timeout: float = 10.0) -> None:
    """Wait until the holder has its own namespaces and its host name (it sleeps then)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{holder.pid}/comm") as comm:
                if comm.read().strip() == "sleep":
                    return
        except FileNotFoundError:
            break
        time.sleep(0.005)
    raise NetnsError(f"the namespace holder {holder.pid} did not start (exit {holder.poll()})")


def join(holder: int) -> None:
    """Move this single-threaded process into the network and UTS (host name) namespaces
    ``holder`` holds: what ``SimHost.command``'s nsenter does, for a process already warm."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    for kind, flag in (("net", 0x40000000), ("uts", 0x04000000)):   # CLONE_NEWNET, CLONE_NEWUTS
        fd = os.open(f"/proc/{holder}/ns/{kind}", os.O_RDONLY)
        try:
            if libc.setns(fd, flag) != 0:
                raise NetnsError(f"setns into {holder}'s {kind} namespace: "
                                 f"{os.strerror(ctypes.get_errno())}")
        finally:
            os.close(fd)


@dataclass
class SimHost:
    name: str          # the launcher's name for the host
    index: int
    holder: subprocess.Popen
    address: str

    @property
    def link(self) -> str:
        """The hub's end of the host's veth: what a fault takes down."""
        return f"rgv{self.index}"

    @property
    def hostname(self) -> str:
        return f"sim-host{self.index}"

    def command(self, argv: list[str]) -> list[str]:
        return ["nsenter", "-t", str(self.holder.pid), "-n", "-u", *argv]


@dataclass
class Network:
    """The bridge and its hosts. Use as a context manager inside :func:`private`."""
    folder: str             # where the private /etc/hosts is kept (the run's folder)
    hosts: dict = field(default_factory=dict)
    names_file: str = ""    # the private /etc/hosts, when this process may mount one

    def __enter__(self) -> "Network":
        if inside_private():    # our own mount namespace: /etc/hosts can be ours
            self.names_file = os.path.join(self.folder, "etc-hosts")
            shutil.copyfile("/etc/hosts", self.names_file)
            done = subprocess.run(["mount", "--bind", self.names_file, "/etc/hosts"],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                raise NetnsError(f"mount --bind over /etc/hosts: {done.stderr.strip()}")
        _ip("link", "set", "lo", "up")
        _ip("link", "add", INTERFACE, "type", "bridge")
        # horovodrun accepts an interface for all-local hosts only if it carries 127.0.0.1,
        # and hands workers the interface's last IPv4 address as the driver's: the
        # bridge's, which every host namespace reaches.
        _ip("addr", "add", "127.0.0.1/32", "dev", INTERFACE)
        _ip("addr", "add", f"{SUBNET}.1/24", "dev", INTERFACE)
        _ip("link", "set", INTERFACE, "up")
        return self

    @property
    def hub_address(self) -> str:
        return f"{SUBNET}.1"

    def add_host(self, name: str) -> SimHost:
        index = len(self.hosts)
        holder = subprocess.Popen(["unshare", "--net", "--uts", "--", "sh", "-c",
                                   f"hostname sim-host{index} && exec sleep infinity"])
        host = SimHost(name, index, holder, f"{SUBNET}.{FIRST_HOST + index}")
        self.hosts[name] = host
        _settled(holder)
        if self.names_file:
            with open(self.names_file, "a") as names:
                names.write(f"{host.address}\t{host.hostname}\n")
        peer = f"rgp{index}"
        _ip("link", "add", host.link, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", str(holder.pid))
        _ip("link", "set", peer, "name", INTERFACE, holder=holder.pid)
        _ip("addr", "add", f"{host.address}/24", "dev", INTERFACE, holder=holder.pid)
        _ip("link", "set", INTERFACE, "up", holder=holder.pid)
        _ip("link", "set", "lo", "up", holder=holder.pid)
        _ip("link", "set", host.link, "master", INTERFACE)
        _ip("link", "set", host.link, "up")
        return host

    def link(self, name: str, up: bool) -> None:
        """Down: the host vanishes (packets dropped silently both ways). Up: it is back."""
        _ip("link", "set", self.hosts[name].link, "up" if up else "down")

    def bandwidth(self, name: str, rate: str) -> None:
        """A slow link both ways (tbf; netem is not in this kernel)."""
        host = self.hosts[name]
        shape = ["root", "tbf", "rate", rate, "burst", "32kbit", "latency", "400ms"]
        _ip_tc = ["tc", "qdisc", "replace", "dev"]
        for command in ([*_ip_tc, host.link, *shape], host.command([*_ip_tc, INTERFACE, *shape])):
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                raise NetnsError(f"{' '.join(command)}: {done.stderr.strip()}")

    def __exit__(self, *exc) -> None:
        for host in self.hosts.values():
            host.holder.kill()
            host.holder.wait()
        subprocess.run(["ip", "link", "del", INTERFACE], capture_output=True)
