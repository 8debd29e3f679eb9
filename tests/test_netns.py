"""Simulated hosts in private network namespaces: a vanished host is detected by the
lifeline timeout, a stopped process is not declared dead, and nothing is left behind."""
import json
import subprocess

import pytest

from conftest import PYTHON, ROOT, run
from elastic.launch import netns

UNAVAILABLE = netns.available()
pytestmark = pytest.mark.skipif(bool(UNAVAILABLE), reason=UNAVAILABLE)


def host_links() -> set[str]:
    return set(subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout.splitlines())


@pytest.fixture(scope="module")
def vanish_run():
    """Rank 1 SIGSTOPped for 20 s; a second later host 2's link goes down."""
    before = host_links()
    done = run(netns.private([PYTHON, "tests/workers/vanish_lifelines.py", "20"]), timeout=90)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result, before, host_links()


def test_vanished_host_is_detected_by_timeout_within_seconds(vanish_run):
    result, _, _ = vanish_run
    learned = {(who, dead): (how, seconds) for who, dead, how, seconds in result["deaths"]}
    survivors = [learned[survivor, 2] for survivor in (0, 3)]   # rank 1 is stopped meanwhile
    assert "timeout" in {how for how, _ in survivors}        # the first to see it told the rest
    assert all(1.0 < seconds < 8.0 for _, seconds in survivors)   # the bench holds the figure
    # ...and the vanished host sees everyone else vanish: it is the one cut off.
    assert {dead for who, dead, _, _ in result["deaths"] if who == 2} == {0, 1, 3}


def test_stopped_process_is_a_stall_not_a_death(vanish_run):
    result, _, _ = vanish_run
    assert not [d for d in result["deaths"] if d[1] == 1 and d[0] != 2]   # 2 is cut off
    # Records of the stopped rank by those not cut off: the vanished host, silent for up to
    # 8 s before it is declared dead, may be recorded as a stall too, and sees rank 1 stall.
    stopped = [s for s in result["stalls"] if s[2] == 1 and s[0] != 2]
    assert [(who, kind, rank) for who, kind, rank, _ in stopped] == \
        [(0, "stall", 1), (0, "stall_cleared", 1)]
    cleared_after = stopped[1][3]
    assert result["stop_s"] <= cleared_after < result["stop_s"] + 5
    # it heard of host 2 once it could run again
    assert [d[2] for d in result["deaths"] if d[0] == 1 and d[1] == 2] == ["told"]


def test_nothing_is_left_on_the_machines_network(vanish_run):
    _, before, after = vanish_run
    assert after == before
