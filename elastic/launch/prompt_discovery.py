"""horovodrun, but an edit of the hosts file reaches the job at once, not within a second:

    python -m elastic.launch.prompt_discovery --watch hostfiles/hosts.txt -- \\
        --min-np 2 --max-np 8 \\
        --host-discovery-script "hostfiles/discover.sh hostfiles/hosts.txt" python -m jobs.digits

Everything after ``--`` is horovodrun's command line, unchanged. Horovod's elastic driver
runs the discovery script once a second, each time through a freshly spawned Python
middleman (``safe_shell_exec``); a host added just after a run waits a second or more
(1.16 s measured here) before anyone acts on it. When the script reads a file (as
``hostfiles/discover.sh`` does), this driver checks that file every CHECK_S and runs the
script as soon as the file changes, and still once a second otherwise: a script that
also looks elsewhere misses nothing it did before. ``regatta local`` runs its jobs this
way (not with ``--stock-recovery``, which keeps horovodrun as it is).

It uses the driver's public pieces: a ``HostDiscovery`` (whose
``find_available_hosts_and_slots`` is the method a discovery provides) in place of the
``HostDiscoveryScript`` horovodrun builds, and the driver's polling period
``DISCOVER_HOSTS_FREQUENCY_SECS``. Its check that Horovod was built with Gloo, which imports
all of torch on every launch, is remembered per installed build (elastic/launch/horovod_build.py).
"""
from __future__ import annotations

import functools
import os
import sys

from pathlib import Path

# Nothing heavy at the top: horovodrun starts every worker and runs every discovery through
# a spawned Python middleman that imports the launching module first (horovodrun's own
# script imports all of horovod.runner, about 0.2 s of CPU each time).

CHECK_S = 0.02      # the driver's polls between edits cost a stat(), nothing measurable


def split_arguments(argv: list[str]) -> tuple[Path, list[str]]:
    """``--watch FILE -- HOROVODRUN_ARGS...`` -> (FILE, HOROVODRUN_ARGS)."""
    if len(argv) < 3 or argv[0] != "--watch" or argv[2] != "--":
        sys.exit("usage: python -m elastic.launch.prompt_discovery --watch FILE -- HOROVODRUN_ARGS...")
    return Path(argv[1]), argv[3:]


def main(argv: list[str]) -> None:
    watched, horovodrun_args = split_arguments(argv)
    from horovod.runner import launch
    from horovod.runner.elastic import discovery, driver

    from .horovod_build import remembered
    from .watched_discovery import WatchedDiscoveryScript
    driver.DISCOVER_HOSTS_FREQUENCY_SECS = CHECK_S
    launch.gloo_built = remembered(launch.gloo_built)
    discovery.HostDiscoveryScript = functools.partial(WatchedDiscoveryScript, watched=watched)
    sys.argv = [os.path.join(os.path.dirname(sys.executable), "horovodrun"), *horovodrun_args]
    launch.run_commandline()


if __name__ == "__main__":
    main(sys.argv[1:])
