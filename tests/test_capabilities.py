"""The suite fails, naming what to install or enable, where the machine lacks something
it needs, when run as `make test` runs it (tests/capabilities.py)."""
from __future__ import annotations

import os
import subprocess

import pytest

import capabilities
from conftest import PYTHON, ROOT


def session(**env) -> subprocess.CompletedProcess:
    """A pytest session collecting one small module, with ``env`` on top of ours."""
    environ = {k: v for k, v in os.environ.items() if k not in (capabilities.REQUIRE_ENV,
                                                                 capabilities.PRETEND_ENV)}
    return subprocess.run([PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                           "tests/test_run_paths.py"], cwd=ROOT, env={**environ, **env},
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name, words", [("netns", "user namespaces"),
                                         ("chromium", "apt-get install chromium"),
                                         ("postgresql", "apt-get install postgresql"),
                                         ("slurm", "apt-get install slurmctld")])
def test_a_missing_capability_fails_the_session_saying_what_to_do(name, words):
    done = session(**{capabilities.REQUIRE_ENV: "1", capabilities.PRETEND_ENV: name})
    out = done.stdout + done.stderr
    assert done.returncode == 3, out
    assert "cannot run the whole suite" in out and words in out and name in out


def test_this_machine_has_them_all_and_the_check_passes():
    # `make test` requires them here; so does this test, or the suite skips silently again
    assert capabilities.missing() == []
    done = session(**{capabilities.REQUIRE_ENV: "1"})
    assert done.returncode == 0, done.stdout + done.stderr


def test_without_the_requirement_nothing_is_checked():
    done = session(**{capabilities.PRETEND_ENV: "netns"})
    assert done.returncode == 0, done.stdout + done.stderr


def test_an_unknown_name_is_refused():
    done = session(**{capabilities.REQUIRE_ENV: "1", capabilities.PRETEND_ENV: "gpu"})
    assert done.returncode != 0 and "unknown capabilities ['gpu']" in done.stdout + done.stderr
