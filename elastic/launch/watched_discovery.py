"""A host discovery for Horovod's elastic driver that runs the discovery script as soon as
the file it reads changes, and once a second otherwise (elastic/launch/prompt_discovery.py
puts it in horovodrun)."""
from __future__ import annotations

import time

from pathlib import Path

from horovod.runner.elastic import discovery

from .hosts import run_discovery

FULL_RUN_S = 1.0    # Horovod's own period: what the watched file cannot tell still shows up


def _stamp(path: Path) -> tuple | None:
    """What changes when the file is edited in place or replaced by a rename."""
    try:
        found = path.stat()
    except FileNotFoundError:
        return None
    return found.st_ino, found.st_mtime_ns, found.st_size


class WatchedDiscoveryScript(discovery.HostDiscovery):
    """Runs the discovery script when ``watched`` changed or FULL_RUN_S passed; in between,
    answers the driver's frequent polls with the last result."""

    def __init__(self, discovery_script: str, slots: int | None, watched: Path):
        super().__init__()
        self.command, self.default_slots, self.watched = discovery_script, slots or 1, watched
        self.seen: tuple | None = None
        self.last_run = -FULL_RUN_S
        self.hosts: dict[str, int] | None = None   # the last good list

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        stamp = _stamp(self.watched)    # before the run: an edit during it shows next time
        recent = time.monotonic() - self.last_run < FULL_RUN_S
        if stamp == self.seen and recent and self.hosts is not None:
            return dict(self.hosts)
        # A script that fails is run again after FULL_RUN_S, as Horovod would, and the polls
        # in between keep the last good list (Horovod keeps it while the script fails).
        self.seen, self.last_run = stamp, time.monotonic()
        found = run_discovery(self.command, default_slots=self.default_slots)
        self.hosts = {host.name: host.slots for host in found}
        return dict(self.hosts)
