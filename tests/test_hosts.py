"""Hostfiles, discovery scripts and `regatta local` options: clear errors for bad input."""
import subprocess
import threading
import time

import pytest

from conftest import BIN, ROOT
from elastic.launch.hosts import (Host, HostsError, format_discovery, parse_discovery,
                                  parse_hostfile, run_discovery, write_discovery)
from elastic.launch.local import TAKE_UP_S, apply_due_changes
from elastic.launch.plan import PlanError, parse_plan
from elastic.runtime.events import EventLog, read_events

DISCOVER = ROOT / "hostfiles" / "discover.sh"


def test_hostfile_parses_slots():
    text = "# comment\nnode01 slots=4\nnode02   # trailing comment\n\n10.0.0.7 slots=2 max_slots=4\n"
    assert parse_hostfile(text) == [Host("node01", 4), Host("node02", 1), Host("10.0.0.7", 2)]


@pytest.mark.parametrize("text, message", [
    ("node01 slots=four\n", "hosts.txt:1: slots must be a positive integer, got 'four'"),
    ("node01\nnode02 cpus=3\n", "hosts.txt:2: unknown option 'cpus=3'"),
    ("node01\nnode01\n", "host node01 is listed twice"),
    ("# nothing\n", "lists no hosts"),
    ("bad$name\n", "hosts.txt:1: 'bad$name' is not a valid host name"),
    ("node01 slots=0\n", "slots must be a positive integer, got '0'"),
])
def test_malformed_hostfile(text, message):
    with pytest.raises(HostsError) as err:
        parse_hostfile(text, "hosts.txt")
    assert message in str(err.value)


def test_example_hostfiles_parse():
    for path in (ROOT / "hostfiles").glob("*.txt"):
        text = path.read_text()
        # hosts.txt feeds discover.sh (HOST:SLOTS); the others are OpenMPI hostfiles.
        hosts = parse_discovery(text, path.name) if path.name == "hosts.txt" else parse_hostfile(text, path.name)
        assert hosts, path


def test_discovery_script_prints_hosts(tmp_path):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("# pool\nnode01:4\nnode02\n")
    assert run_discovery(f"{DISCOVER} {hosts}") == [Host("node01", 4), Host("node02", 1)]


def test_discovery_script_rejects_a_malformed_line(tmp_path):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("node01:4\nnode 02\n")
    with pytest.raises(HostsError) as err:
        run_discovery(f"{DISCOVER} {hosts}")
    assert "hosts.txt:2: 'node 02' is not HOST or HOST:SLOTS" in str(err.value)


@pytest.mark.parametrize("script, message", [
    ("echo 'node01:4'; echo 'garbage here!'", "'garbage here!' is not HOST or HOST:SLOTS"),
    ("echo node01:x", "slots must be a positive integer, got 'x'"),
    ("echo oops >&2; exit 3", "failed with exit code 3: oops"),
    ("true", "lists no hosts"),
])
def test_bad_discovery_output(script, message):
    with pytest.raises(HostsError) as err:
        run_discovery(script)
    assert message in str(err.value)


def test_check_hosts_command(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("node01 slots=x\n")
    done = subprocess.run([str(BIN / "regatta"), "check-hosts", "--hostfile", str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "bad.txt:1: slots must be a positive integer" in done.stderr
    done = subprocess.run([str(BIN / "regatta"), "check-hosts", "--discovery",
                           f"{DISCOVER} {ROOT / 'hostfiles' / 'hosts.txt'}"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "localhost\t2 slots" in done.stdout


@pytest.mark.parametrize("args, message", [
    (["--kill", "2"], "--kill '2' must look like HOST@STEP"),
    (["--kill", "2@500"], "step must be between 1 and 99"),
    (["--kill", "9@10"], "host number 9 is outside 1..2"),
    (["--slow", "1:fast"], "--slow '1:fast' must look like HOST:FACTOR"),
    (["--hosts", "0"], "--hosts and --slots must be >= 1"),
    (["--vanish", "2@10", "--aliases"], "--vanish need hosts in network namespaces"),
])
def test_bad_local_options(tmp_path, args, message):
    done = subprocess.run([str(BIN / "regatta"), "local", "digits", "--hosts", "2", "--steps", "100",
                           "--run-dir", str(tmp_path), *args],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr


@pytest.mark.parametrize("args, message", [
    (["--vanish", "2"], "--vanish '2' must look like HOST@STEP"),
    (["--partition", "2@10"], "--partition '2@10' must look like HOST[/SLOT]@STEP[+AFTER]:SECONDS"),
    (["--stop", "2/x@10:5"], "--stop '2/x@10:5': SLOT must be a number"),
    (["--sigkill", "2@10+soon"], "--sigkill '2@10+soon' must look like HOST[/SLOT]@STEP[+AFTER]"),
    (["--sigkill", "3@10"], "host number 3 is outside 1..2"),
    (["--bandwidth", "2"], "--bandwidth '2' must look like HOST:RATE"),
    (["--kill-syncing", "2@100"], "--kill-syncing 127.0.0.3@100: step must be between 1 and 99"),
    (["--kill-syncing", "2"], "--kill-syncing '2' must look like HOST@STEP"),
    (["--add", "node7@20"], "host 'node7': a simulated host is a number (1..2), nothing (the next"),
    (["--kill", "127.0.0.1@20"], "host '127.0.0.1': a simulated host is a number"),
    (["--slow", "10.0.0.2:3"], "host '10.0.0.2': a simulated host is a number"),
])
def test_bad_fault_options(args, message):
    """The outside faults' options, parsed as the command line parses them."""
    with pytest.raises(PlanError) as err:
        parse_plan(["digits", "--hosts", "2", "--steps", "100", *args])
    assert message in str(err.value)


def test_a_host_removed_and_added_again_is_one_host():
    """One agent and one namespace per host: listing it twice started two agents on one
    address (the launcher died with "Address already in use")."""
    plan = parse_plan(["digits", "--hosts", "2", "--slots", "2", "--steps", "900", "--add", "@100",
                       "--remove", "127.0.0.4@300", "--add", "127.0.0.4@500", "--remove", "2@700",
                       "--add", "2@800"])
    assert plan.every_host() == ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    assert plan.max_np == 6


def test_outside_faults_are_planned_as_given():
    plan = parse_plan(["digits", "--hosts", "3", "--steps", "100", "--sigkill", "2/1@40",
                       "--sigkill", "3@40+0.25", "--partition", "1@60:4.5", "--bandwidth", "2:20mbit"])
    assert plan.faults == [
        {"fault": "sigkill", "host": "127.0.0.3", "step": 40, "slot": 1, "seconds": None, "after": None},
        {"fault": "sigkill", "host": "127.0.0.4", "step": 40, "slot": None, "seconds": None, "after": 0.25},
        {"fault": "partition", "host": "127.0.0.2", "step": 60, "slot": None, "seconds": 4.5, "after": None}]
    assert plan.bandwidth == {"127.0.0.3": "20mbit"} and plan.needs_netns() == ["--bandwidth", "--partition"]


def test_a_discovery_file_is_never_seen_half_written(tmp_path):
    """horovodrun polls the file at any instant: every read is one whole host list."""
    path = tmp_path / "hosts.txt"
    lists = [[Host("127.0.0.2", 1), Host("127.0.0.3", 1)], [Host("127.0.0.2", 1)]]
    write_discovery(path, lists[0])
    whole = {format_discovery(hosts) for hosts in lists}
    seen, writing = [], threading.Event()

    def read_while_written():
        while writing.is_set():
            seen.append(path.read_text())

    writing.set()
    reader = threading.Thread(target=read_while_written)
    reader.start()
    written, deadline = 0, time.monotonic() + 60
    while (written < 2000 or len(seen) < 200) and time.monotonic() < deadline:
        write_discovery(path, lists[written % 2])
        written += 1
    writing.clear()
    reader.join(timeout=10)
    assert len(seen) >= 200 and set(seen) <= whole, set(seen) - whole


def test_a_change_to_a_host_waits_until_the_job_took_up_the_last_one(tmp_path):
    """Removed at 400, back at 700: on a fast job step 700 can come before horovodrun saw
    the removal (the world is still 3); the addition waits for the world to move, or for
    TAKE_UP_S; the changes after it wait with it (they keep their order)."""
    path, log, edited = tmp_path / "hosts.txt", EventLog(tmp_path, "launcher", 0), {}
    start = [Host("127.0.0.2", 1), Host("127.0.0.3", 1), Host("127.0.0.4", 1)]
    changes = [(400, "remove", "127.0.0.4"), (700, "add", "127.0.0.4"), (700, "add", "127.0.0.5")]
    hosts = apply_due_changes(changes, 400, start, 1, path, log, world=3, edited=edited)
    assert path.read_text() == "127.0.0.2:1\n127.0.0.3:1\n"
    assert apply_due_changes(changes, 700, hosts, 1, path, log, world=3, edited=edited) == hosts
    assert changes == [(700, "add", "127.0.0.4"), (700, "add", "127.0.0.5")]   # both kept: in order
    hosts = apply_due_changes(changes, 705, hosts, 1, path, log, world=2, edited=edited)
    assert path.read_text() == "127.0.0.2:1\n127.0.0.3:1\n127.0.0.4:1\n127.0.0.5:1\n" and not changes
    assert [(e["kind"], e["target"], e["step"]) for e in read_events(tmp_path)] == [
        ("host_removed", "127.0.0.4", 400), ("host_added", "127.0.0.4", 705), ("host_added", "127.0.0.5", 705)]
    # a change the job never takes up (the world never moves) holds the next back no longer
    changes = [(800, "remove", "127.0.0.5")]
    edited["127.0.0.5"] = (4, time.monotonic() - TAKE_UP_S)
    assert apply_due_changes(changes, 800, hosts, 1, path, log, world=4, edited=edited) == hosts[:3]


def test_changes_due_at_one_step_are_one_discovery_change(tmp_path):
    path = tmp_path / "hosts.txt"
    log = EventLog(tmp_path, "launcher", 0)
    changes = [(10, "add", "127.0.0.4"), (10, "add", "127.0.0.5"), (20, "remove", "127.0.0.2")]
    hosts = apply_due_changes(changes, 12, [Host("127.0.0.2", 2)], 2, path, log)
    assert hosts == [Host("127.0.0.2", 2), Host("127.0.0.4", 2), Host("127.0.0.5", 2)]
    assert path.read_text() == "127.0.0.2:2\n127.0.0.4:2\n127.0.0.5:2\n"
    assert changes == [(20, "remove", "127.0.0.2")]          # not due yet: kept
    added = [(e["target"], e["step"], e["planned_step"]) for e in read_events(tmp_path)]
    assert added == [("127.0.0.4", 12, 10), ("127.0.0.5", 12, 10)]
    assert len({e["wall_time"] for e in read_events(tmp_path)}) == 1   # one instant, one change
    assert apply_due_changes(changes, 19, hosts, 2, path, log) == hosts and changes
