"""Regatta's horovodrun (elastic/launch/prompt_discovery.py): an edited hosts file is
discovered at once, a script that looks elsewhere still runs once a second, bad input is
named. The real driver runs it in every `regatta local` test."""
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from elastic.launch.hosts import Host, HostsError, write_discovery
from elastic.launch.watched_discovery import FULL_RUN_S, WatchedDiscoveryScript

DISCOVER = ROOT / "hostfiles" / "discover.sh"


def counting_script(tmp_path, body: str) -> tuple[str, object]:
    """A discovery script that appends a line to a file each time it runs."""
    runs, script = tmp_path / "runs", tmp_path / "discover"
    script.write_text(f"#!/bin/sh\necho run >> {runs}\n{body}\n")
    script.chmod(0o755)
    return str(script), lambda: len(runs.read_text().splitlines()) if runs.exists() else 0


def test_an_edit_is_discovered_at_once_and_nothing_else_reruns_the_script(tmp_path):
    hosts_file = tmp_path / "hosts.txt"
    script, runs = counting_script(tmp_path, f'exec {DISCOVER} "$1"')
    write_discovery(hosts_file, [Host("10.0.0.1", 2)])
    found = WatchedDiscoveryScript(f"{script} {hosts_file}", None, hosts_file)
    start = time.monotonic()
    for _ in range(50):   # the driver's polls between edits cost a stat(), not a script run
        assert found.find_available_hosts_and_slots() == {"10.0.0.1": 2}
    assert runs() == 1 or time.monotonic() - start > FULL_RUN_S
    write_discovery(hosts_file, [Host("10.0.0.1", 2), Host("10.0.0.2", 1)])
    assert found.find_available_hosts_and_slots() == {"10.0.0.1": 2, "10.0.0.2": 1}
    write_discovery(hosts_file, [Host("10.0.0.2", 1)])     # same size, a new file: seen too
    assert found.find_available_hosts_and_slots() == {"10.0.0.2": 1}


def test_a_script_that_looks_elsewhere_still_runs_once_a_second(tmp_path):
    state = tmp_path / "state"
    state.write_text("10.0.0.1:1\n")
    script, runs = counting_script(tmp_path, f"cat {state}")
    found = WatchedDiscoveryScript(script, None, tmp_path / "never-written")
    assert found.find_available_hosts_and_slots() == {"10.0.0.1": 1}
    state.write_text("10.0.0.1:1\n10.0.0.3:1\n")            # not the watched file
    assert found.find_available_hosts_and_slots() == {"10.0.0.1": 1}
    time.sleep(FULL_RUN_S + 0.05)
    assert found.find_available_hosts_and_slots() == {"10.0.0.1": 1, "10.0.0.3": 1}
    assert runs() == 2


def test_a_bare_host_name_gets_horovodruns_slots_per_host(tmp_path):
    script, _ = counting_script(tmp_path, "echo 10.0.0.1; echo 10.0.0.2:3")
    found = WatchedDiscoveryScript(script, 4, tmp_path / "hosts.txt")
    assert found.find_available_hosts_and_slots() == {"10.0.0.1": 4, "10.0.0.2": 3}


def test_a_failing_script_is_named_then_the_last_good_list_holds_until_it_runs_again(tmp_path):
    hosts_file = tmp_path / "hosts.txt"
    write_discovery(hosts_file, [Host("10.0.0.1", 1)])
    script, runs = counting_script(tmp_path, f'[ -e {tmp_path}/broken ] && {{ echo "no hosts today" >&2; exit 3; }}\n'
                                             f'exec {DISCOVER} "$1"')
    found = WatchedDiscoveryScript(f"{script} {hosts_file}", None, hosts_file)
    assert found.find_available_hosts_and_slots() == {"10.0.0.1": 1}
    (tmp_path / "broken").touch()
    write_discovery(hosts_file, [Host("10.0.0.1", 1), Host("10.0.0.2", 1)])
    with pytest.raises(HostsError, match="failed with exit code 3: no hosts today"):
        found.find_available_hosts_and_slots()
    for _ in range(20):   # no script run per poll, and never an empty list meaning "no hosts"
        assert found.find_available_hosts_and_slots() == {"10.0.0.1": 1}
    assert runs() == 2
    (tmp_path / "broken").unlink()
    time.sleep(FULL_RUN_S + 0.05)
    assert found.find_available_hosts_and_slots() == {"10.0.0.1": 1, "10.0.0.2": 1}


@pytest.mark.parametrize("args", [[], ["--watch", "hosts.txt"], ["hosts.txt", "--", "-np", "2"],
                                  ["--watch", "hosts.txt", "-np", "2"]])
def test_bad_command_line_names_the_usage(args):
    done = subprocess.run([sys.executable, "-m", "elastic.launch.prompt_discovery", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 1
    assert "usage: python -m elastic.launch.prompt_discovery --watch FILE -- HOROVODRUN_ARGS" in done.stderr


def imported(modules: str, watched: set[str]) -> list[str]:
    """Which of the ``watched`` top-level packages importing ``modules`` pulls in, in a
    fresh interpreter."""
    code = (f"import json, sys, {modules}; "
            f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({sorted(watched)!r}))))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_what_runs_before_every_worker_start_imports_nothing_heavy():
    """horovodrun starts each worker through a spawned middleman that first imports the
    launching module (horovodrun's own script: all of horovod.runner, ~0.2 s of CPU),
    and the shim it runs then talks to the agent: neither should import Horovod, torch or
    the agent's own dependencies."""
    assert imported("elastic.launch.prompt_discovery, elastic.launch.shim",
                    {"horovod", "torch", "http", "numpy"}) == []


def test_the_launcher_outside_the_namespaces_imports_no_store():
    """``regatta local`` starts itself again inside the namespaces; the outer one only waits
    for it, so SQLAlchemy (0.5 s of imports) is for the inner one alone."""
    assert imported("regatta.cli, elastic.launch.local", {"sqlalchemy", "alembic", "torch", "horovod"}) == []


class Counted:
    """Horovod's own ``gloo_built``, counting how often it is asked."""
    def __init__(self):
        from horovod.common.util import gloo_built
        self.asked, self._ask = 0, gloo_built

    def __call__(self, verbose=False):
        self.asked += 1
        return self._ask(verbose=verbose)


def test_horovods_gloo_check_is_asked_once_per_installed_build(tmp_path):
    """The check imports all of torch in a forked process on every launch; the answer is
    kept per build, and a record of another build, or a corrupt one, asks again."""
    from elastic.launch.horovod_build import RECORD, build_key, remembered
    asked = Counted()
    check = remembered(asked, tmp_path)
    assert check() is True and asked.asked == 1
    assert json.loads((tmp_path / RECORD).read_text()) == {"key": build_key(), "gloo": True}
    assert check() is True and asked.asked == 1
    assert oct((tmp_path / RECORD).stat().st_mode & 0o777) == "0o644"   # an unprivileged launch reads it
    (tmp_path / RECORD).write_text(json.dumps({"key": ["0.0.1"], "gloo": False}))
    assert check() is True and asked.asked == 2
    (tmp_path / RECORD).write_text("{not json")
    assert check() is True and asked.asked == 3
    assert json.loads((tmp_path / RECORD).read_text())["gloo"] is True
    assert remembered(asked, tmp_path / "missing")() is True and asked.asked == 4   # nowhere to keep it
    assert [p.name for p in tmp_path.iterdir()] == [RECORD]    # no temporary left behind
