"""What the suite needs of the machine beyond Python packages, checked once at the start.

Where ``REGATTA_REQUIRE_CAPABILITIES=1`` (``make test``, hence CI), a machine lacking one
stops the session with a message saying what to install or enable, instead of skipping
the tests that need it (vanishes, partitions, SIGSTOPs, recovery races, the browser) and
passing green without them. Run without it (a plain ``pytest tests/test_x.py``), those
tests skip as before.

``REGATTA_TEST_PRETEND_MISSING=netns,chromium,postgresql`` makes this check, and only
this check, treat those as missing: it is how tests/test_capabilities.py sees the
failure on a machine that has them all.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

from elastic.launch import netns

REQUIRE_ENV = "REGATTA_REQUIRE_CAPABILITIES"
PRETEND_ENV = "REGATTA_TEST_PRETEND_MISSING"
CHROMIUM = "/usr/bin/chromium"


def _netns() -> str:
    why = netns.available()
    return why and f"user and network namespaces are unavailable ({why})"


def _chromium() -> str:
    if not Path(CHROMIUM).exists() or importlib.util.find_spec("playwright") is None:
        return f"Debian's chromium at {CHROMIUM} or the playwright package is missing"
    return ""


def _postgresql() -> str:
    if not list(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl")):
        return "Debian's PostgreSQL server is not installed"
    return ""


def _slurm() -> str:
    lacking = [tool for tool in ("slurmctld", "slurmd", "sbatch", "munged", "unshare")
               if shutil.which(tool) is None and not Path("/usr/sbin", tool).exists()]
    if lacking:
        return f"Slurm or munge is not installed (no {', '.join(lacking)})"
    if os.geteuid() != 0:
        return "the Slurm cluster of the tests needs root (slurmctld and slurmd drop " \
               "supplementary groups, which a user namespace forbids)"
    return ""


# name -> (the check: why it is missing, or ""; what to do)
CHECKS = {
    "netns": (_netns, "enable unprivileged user namespaces (sysctl "
              "kernel.unprivileged_userns_clone=1; on Ubuntu also "
              "kernel.apparmor_restrict_unprivileged_userns=0) or run the suite as root; in a "
              "container, allow unshare(CLONE_NEWUSER | CLONE_NEWNET)"),
    "chromium": (_chromium, "run `bash tools/setup.sh` (apt-get install chromium; pip playwright)"),
    "postgresql": (_postgresql, "run `bash tools/setup.sh` (apt-get install postgresql)"),
    "slurm": (_slurm, "run `bash tools/setup.sh` as root (apt-get install slurmctld slurmd "
              "slurm-client munge)"),
}


def missing() -> list[str]:
    """What this machine lacks, one message each (empty: everything is here)."""
    pretend = {n.strip() for n in os.environ.get(PRETEND_ENV, "").split(",") if n.strip()}
    unknown = pretend - set(CHECKS)
    if unknown:
        raise ValueError(f"{PRETEND_ENV} names unknown capabilities {sorted(unknown)}; "
                         f"known: {sorted(CHECKS)}")
    found = []
    for name, (check, remedy) in CHECKS.items():
        why = f"{name}: pretended missing ({PRETEND_ENV})" if name in pretend else check()
        if why:
            found.append(f"{why}: {remedy}")
    return found
