"""Host lists: OpenMPI hostfiles (``host slots=N``) and discovery output (``host:N``).

Every parse error names the source, the line number and the offending text.
"""
from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..whole_files import replace_text

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class HostsError(ValueError):
    """A host list is malformed; the message says where."""


@dataclass(frozen=True)
class Host:
    name: str
    slots: int

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise HostsError(f"{self.name!r} is not a valid host name")
        if self.slots < 1:
            raise HostsError(f"host {self.name} has {self.slots} slots; need at least 1")


def _lines(text: str):
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if line:
            yield number, line


def _slots(value: str, where: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise HostsError(f"{where}: slots must be a positive integer, got {value!r}")
    return int(value)


def _unique(hosts: list[Host], source: str) -> list[Host]:
    seen = set()
    for host in hosts:
        if host.name in seen:
            raise HostsError(f"{source}: host {host.name} is listed twice")
        seen.add(host.name)
    if not hosts:
        raise HostsError(f"{source}: lists no hosts")
    return hosts


def parse_hostfile(text: str, source: str = "hostfile") -> list[Host]:
    """OpenMPI hostfile: ``name [slots=N] [max_slots=M]`` per line."""
    hosts = []
    for number, line in _lines(text):
        where = f"{source}:{number}"
        name, *options = line.split()
        slots = 1
        for option in options:
            key, sep, value = option.partition("=")
            if not sep or key not in ("slots", "max_slots", "max-slots"):
                raise HostsError(f"{where}: unknown option {option!r} (expected slots=N)")
            if key == "slots":
                slots = _slots(value, where)
        try:
            hosts.append(Host(name, slots))
        except HostsError as err:
            raise HostsError(f"{where}: {err}") from None
    return _unique(hosts, source)


def parse_discovery(text: str, source: str = "discovery output", default_slots: int = 1) -> list[Host]:
    """Host discovery output: ``name`` or ``name:slots`` per line (a bare name has
    ``default_slots``, horovodrun's ``--slots-per-host``)."""
    hosts = []
    for number, line in _lines(text):
        where = f"{source}:{number}"
        name, sep, slots = line.partition(":")
        if " " in line or "\t" in line:
            raise HostsError(f"{where}: {line!r} is not HOST or HOST:SLOTS")
        count = _slots(slots, where) if sep else default_slots
        try:
            hosts.append(Host(name, count))
        except HostsError as err:
            raise HostsError(f"{where}: {err}") from None
    return _unique(hosts, source)


def run_discovery(command: str, timeout: float = 10.0, default_slots: int = 1) -> list[Host]:
    """Run a discovery script once, as horovodrun would, and parse what it prints."""
    try:
        done = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise HostsError(f"discovery script {command!r} did not finish within {timeout:.0f} s") from None
    if done.returncode != 0:
        detail = done.stderr.strip() or done.stdout.strip() or "no output"
        raise HostsError(f"discovery script {command!r} failed with exit code "
                         f"{done.returncode}: {detail}")
    return parse_discovery(done.stdout, f"output of {command!r}", default_slots)


def format_discovery(hosts: list[Host]) -> str:
    return "".join(f"{host.name}:{host.slots}\n" for host in hosts)


def write_discovery(path: Path, hosts: list[Host]) -> None:
    """Replace a discovery file in one step: horovodrun's discovery poll reads it at any
    instant, and a file caught truncated, or half written, would list hosts that are not
    the plan's (no hosts at all, or ``127.0.``)."""
    replace_text(path, format_discovery(hosts))
