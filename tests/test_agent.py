"""Warm agents and the worker shim: a forked worker behaves like a fresh process to
horovodrun (output, exit status, signals); without an agent the shim forks one of its own,
which starts the worker cold and restarts it in place as a warm agent does."""
import json
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from horovod.runner.http.http_server import KVStoreServer

from conftest import PYTHON, ROOT, kill_tree
from elastic.failures import restart
from elastic.launch.agent import WARMING_ENV
from elastic.failures.lifeline import Lifeline
from elastic.failures.liveness import Heartbeat
from elastic.failures.recovery import GLOO_STUCK_S, STEP_STUCK_S
from elastic.runtime.events import read_events
from workers.handed_commit import allgather_through

JOB = ["-m", "jobs.digits", "--steps", "30", "--no-progress", "--db", ""]


@pytest.fixture(scope="module")
def agent():
    """One warm agent for the module (its start, importing torch, is 4 s): it forks a worker
    for each shim, as it does for a host's successive workers in a run."""
    host = f"agent-test-{time.monotonic_ns()}"
    proc = subprocess.Popen([PYTHON, "-m", "elastic.launch.agent", "--host", host,
                             "--preload", "jobs.digits"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert "ready" in proc.stdout.readline()
    yield host
    kill_tree(proc.pid)
    # the hand-offs its workers left (in /dev/shm, which outlives the test)
    pattern = restart.handoff_path(host, 0).name.replace("-0.pt", "-*")
    for leftover in restart.handoff_path(host, 0).parent.glob(pattern):
        leftover.unlink(missing_ok=True)


def shim(host, run_dir=None, extra_env=None, job=JOB, args=(), **kwargs):
    env = {"HOROVOD_HOSTNAME": host, "PATH": "/usr/bin:/bin", **(extra_env or {})}
    where = ["--run-dir", str(run_dir)] if run_dir else []
    return subprocess.Popen([PYTHON, "-m", "elastic.launch.shim", *job, *where, *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, **kwargs)


@pytest.fixture(params=["warm", "own"])
def either_agent(request, agent):
    """A host's warm agent, or none: then the shim forks an agent of its own, which starts
    the worker cold and handles its death and restart as a warm one does."""
    return agent if request.param == "warm" else f"no-agent-{time.monotonic_ns()}"


def ended(pid: int) -> bool:
    try:
        return "\tZ" in Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0]
    except (FileNotFoundError, IndexError):
        return True


def test_without_agent_the_shim_starts_its_worker_under_an_agent_of_its_own(tmp_path):
    host = "no-agent-here"
    proc = shim(host, tmp_path, job=["-c", "import os, time; print(os.getppid(), flush=True); "
                                           "time.sleep(0.5); os.kill(os.getpid(), 9)"])
    out, _ = proc.communicate(timeout=60)
    parent = int(out.split()[0])
    assert parent != proc.pid   # not the shim itself, exec'd
    assert proc.returncode == -signal.SIGKILL   # the worker's death, passed on as it came
    # its agent was a fork of the shim, and ends with its worker
    deadline = time.monotonic() + 10
    while ended(parent) is False and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ended(parent)
    assert "spawn" not in out   # what an agent tells a launcher is not the job's output


def test_a_sigkill_under_the_shims_own_agent_is_told_to_peers_and_the_driver(tmp_path, rendezvous_store):
    """No warm agent: the shim's own one shuts the killed worker's lifelines the moment
    the signal is sent and marks the rendezvous, so survivors re-forming at that instant
    stop waiting for it (under a bare horovodrun: Gloo's 30 s)."""
    folder = tmp_path / "exchange"
    folder.mkdir()
    env = {"HOROVOD_GLOO_RENDEZVOUS_ADDR": rendezvous_store[0],
           "HOROVOD_GLOO_RENDEZVOUS_PORT": str(rendezvous_store[1])}
    proc = shim(f"no-agent-{time.monotonic_ns()}", extra_env=env, job=(HOLDER,),
                args=("--exchange", str(folder)))
    deaths = []
    try:
        peer = Lifeline(1, 2, "test-peer", "127.0.0.1", allgather_through(folder, 1, 2),
                        Heartbeat(), lambda rank, host, how, when: deaths.append((rank, how, when)))
        assert proc.stdout.readline().strip() == "up"
        time.sleep(0.2)   # its lifelines reach the agent
        worker = next(p for p in psutil.Process(proc.pid).children(recursive=True)
                      if "lifeline_holder" in " ".join(p.cmdline()) and "elastic.launch.shim" not in p.cmdline())
        killed = time.time()
        worker.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        deadline = time.monotonic() + 5
        while not deaths and time.monotonic() < deadline:
            time.sleep(0.01)
        peer.close()
    finally:
        kill_tree(proc.pid)
    assert [(rank, how) for rank, how, _ in deaths] == [(0, "eof")]
    assert deaths[0][2] - killed < 1.0
    assert restart.marked(rendezvous_store)


def test_without_agent_the_shim_runs_the_job_to_the_end(tmp_path):
    proc = shim("no-agent-here", tmp_path)
    assert proc.wait(timeout=120) == 0
    assert (tmp_path / "result.json").exists()


def test_a_shim_waits_for_its_agent_while_the_agents_warm_up(tmp_path):
    """``regatta local`` starts horovodrun while the agents warm up: a shim started
    before its agent listens waits for it (and its worker is forked, not started cold)
    for as long as the launcher's marker says the agents are warming; without the marker
    it starts the worker itself at once."""
    host = f"late-agent-{time.monotonic_ns()}"
    marker = tmp_path / "agents.warming"
    marker.touch()
    early = shim(host, tmp_path / "early", {WARMING_ENV: str(marker)})
    time.sleep(1.0)
    assert early.poll() is None and not (tmp_path / "early").exists()   # still waiting
    agent = subprocess.Popen([PYTHON, "-m", "elastic.launch.agent", "--host", host,
                              "--preload", "jobs.digits"], cwd=ROOT, stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        assert "ready" in agent.stdout.readline()
        marker.unlink()
        assert early.wait(timeout=120) == 0, early.stdout.read()
    finally:
        kill_tree(agent.pid)
    said = [json.loads(line) for line in agent.stdout.read().splitlines()]
    spawned = [m for m in said if "spawn" in m]
    assert len(spawned) == 1 and spawned[0]["host"] == host, said
    assert {"exit": spawned[0]["spawn"], "code": 0} in said
    assert (tmp_path / "early" / "result.json").exists()
    gone = shim(f"never-{host}", tmp_path / "cold", {WARMING_ENV: str(marker)})
    assert gone.wait(timeout=120) == 0 and (tmp_path / "cold" / "result.json").exists()


def wakeups(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return sum(int(line.split()[1]) for line in status if "ctxt_switches" in line)


def test_an_agent_without_workers_sleeps():
    """A chaos run keeps an agent per host it may add (fifty here): polling every 10 ms for
    a SIGKILLed worker it does not have, they took 0.3 of the 2 cores from training."""
    host = f"idle-agent-{time.monotonic_ns()}"
    proc = subprocess.Popen([PYTHON, "-m", "elastic.launch.agent", "--host", host], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert "ready" in proc.stdout.readline()
        before = wakeups(proc.pid)
        time.sleep(2.0)
        assert wakeups(proc.pid) - before <= 10   # polling: 200
    finally:
        kill_tree(proc.pid)


def test_forked_worker_trains_and_exits_cleanly(agent, tmp_path):
    proc = shim(agent, tmp_path)
    assert proc.wait(timeout=120) == 0
    events = (tmp_path / "events").glob("*.jsonl")
    text = "".join(p.read_text() for p in events)
    assert '"kind": "finish"' in text and '"step": 30' in text


def test_killed_worker_is_reported_as_killed(agent, tmp_path):
    plan = '{"kill": [{"host": "%s", "step": 5}]}' % agent
    proc = shim(agent, tmp_path, {"REGATTA_FAULTS": plan})
    assert proc.wait(timeout=120) == -signal.SIGKILL


ABORTS = str(ROOT / "tests" / "workers" / "abort_worker.py")
TERMS = str(ROOT / "tests" / "workers" / "sigterm_worker.py")
STUCK = str(ROOT / "tests" / "workers" / "stuck_shutdown_worker.py")
STUCK_STEP = str(ROOT / "tests" / "workers" / "stuck_collective_worker.py")
RESTARTING = str(ROOT / "tests" / "workers" / "restarting_peer_worker.py")
HOLDER = str(ROOT / "tests" / "workers" / "lifeline_holder.py")


def test_worker_aborted_while_re_forming_is_replaced_with_its_handoff(agent):
    """Gloo aborts a survivor for a peer's death while the world re-forms: its agent forks
    a replacement given its hand-off; horovodrun sees one worker that exited 0."""
    proc = shim(agent, job=(ABORTS,), args=("--handoff",))
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    handed = out.split("handoff out at ")[1].split()[0]
    assert f"replacement of {handed} slot 1" in out


def test_a_survivor_whose_horovod_shutdown_hangs_is_replaced_with_its_commit(either_agent, tmp_path):
    """A death just after the new world's ``hvd.init`` can leave a survivor's Horovod
    background loop in a Gloo wait with no connection left to sever (seen: 30 s), and the
    reset's ``hvd.shutdown`` waits for that loop. Within seconds its recovery restarts it in
    place; the replacement gets its commit; horovodrun sees one worker that exited 0."""
    proc = shim(either_agent, tmp_path, job=(STUCK,))
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0 and "never restarted" not in out, out
    assert "replacement given [b'commit of step 7']" in out, out
    (restarted,) = [e for e in read_events(tmp_path) if e["kind"] == "restart_in_place"]
    assert (restarted["reason"], restarted["handoff"]) == \
        ("Horovod's shutdown waited on Gloo for a dead peer", True)
    began = float(out.split("re-forming from ")[1].split()[0])
    assert GLOO_STUCK_S <= restarted["wall_time"] - began < GLOO_STUCK_S + 3


def test_a_survivor_whose_step_collective_outlives_the_sever_is_replaced(either_agent, tmp_path):
    """A lifeline reports a death, the survivor severs its Gloo connections, yet its
    step's collective does not raise (Horovod's loop waits on a connection Gloo had
    already closed: 30 s in a chaos run). Within seconds it is restarted in place with
    its commit; horovodrun sees one worker that exited 0."""
    proc = shim(either_agent, tmp_path, job=(STUCK_STEP,))
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0 and "never restarted" not in out, out
    # described with the step it was in (the fault plan's measure), not one of an earlier re-forming
    assert "replacement given [b'commit of step 7'] of step 9" in out, out
    (restarted,) = [e for e in read_events(tmp_path) if e["kind"] == "restart_in_place"]
    assert (restarted["reason"], restarted["handoff"]) == \
        ("the step's collective still waited on Gloo after the sever", True)
    # Its step is abandoned as a failed step is: it records the restore of the last commit
    # (the recovery table counts the steps redone from it), just before it leaves.
    (restore,) = [e for e in read_events(tmp_path) if e["kind"] == "restore"]
    assert (restore["step"], restore["from_step"], restore["steps_redone"]) == (7, 9, 2)
    assert restore["in_place"] and restore["wall_time"] <= restarted["wall_time"]
    died = float(out.split("peer died at ")[1].split()[0])
    assert STEP_STUCK_S <= restarted["wall_time"] - died < STEP_STUCK_S + 3


def test_a_rank_two_threads_restart_at_once_asks_for_one_replacement(agent, tmp_path):
    """The watch restarts a rank while its main thread's ``hvd.init`` fails too (seen in a
    5-host run: one survivor asked twice, was replaced once). The watch's last rows take
    their full second here (the dashboard never answers): the main thread's reason comes
    within it, and must wait for the exit, not ask again."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        proc = shim(agent, tmp_path, job=(STUCK,), args=("--ingest", url, "--init-fails"))
        out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0 and "replacement given [b'commit of step 7']" in out, out
    restarted = [e for e in read_events(tmp_path) if e["kind"] == "restart_in_place"]
    assert [e["reason"] for e in restarted] == ["Horovod's shutdown waited on Gloo for a dead peer"]


@pytest.fixture()
def rendezvous_store():
    """Horovod's own key-value store, as horovodrun's rendezvous server serves it."""
    store = KVStoreServer(verbose=0)
    port = store.start_server()
    yield ("127.0.0.1", port)
    store.shutdown_server()


def restart_beside_a_peer(agent, tmp_path, store, unplaced: bool):
    """The worker restarted in place, the test holding the other end of its lifeline:
    what that end was told (deaths, goodbyes), the worker's output, its restart event."""
    folder = tmp_path / "exchange"
    folder.mkdir()
    proc = shim(agent, tmp_path, job=(RESTARTING,),
                args=("--exchange", str(folder), "--rendezvous", "%s:%d" % store,
                      *(["--unplaced"] if unplaced else [])))
    deaths = []
    try:
        peer = Lifeline(1, 2, "test-peer", "127.0.0.1", allgather_through(folder, 1, 2),
                        Heartbeat(), lambda rank, host, how, when: deaths.append((rank, how)))
        if not unplaced:
            assert proc.stdout.readline().strip() == "placed"
            peer.close()     # a peer dies while the worker is in the rendezvous
        out, _ = proc.communicate(timeout=90)
        deadline = time.monotonic() + 5    # what the lifeline's thread read, it has handled
        while unplaced and not (peer.departed or deaths) and time.monotonic() < deadline:
            time.sleep(0.01)
        peer.close()
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 0 and "replacement given [b'commit of step 7']" in out, out
    (restarted,) = [e for e in read_events(tmp_path) if e["kind"] == "restart_in_place"]
    return peer, deaths, restarted


def test_a_rank_restarted_before_it_is_placed_is_no_death_to_its_peers(agent, tmp_path, rendezvous_store):
    """Its replacement takes the slot in the driver's next world. Counted as a death, it
    started its peers' watch of the rendezvous, which then restarted them in turn while a
    refilled worker was slow to join (a 150 s stall, test_slot_failure, a loaded machine)."""
    peer, deaths, restarted = restart_beside_a_peer(agent, tmp_path, rendezvous_store, unplaced=True)
    assert (peer.departed, deaths) == ({0}, [])
    assert not restart.marked(rendezvous_store)     # no world is doomed by it
    assert (restarted["reason"], restarted["marked"]) == \
        ("Horovod's shutdown waited on Gloo for a dead peer", False)


def test_a_rank_restarted_inside_a_rendezvous_marks_it(agent, tmp_path, rendezvous_store):
    """The rest of that rendezvous would wait out Gloo's 30 s for it; marked, they are
    replaced too, at once."""
    _, _, restarted = restart_beside_a_peer(agent, tmp_path, rendezvous_store, unplaced=False)
    assert restart.marked(rendezvous_store)
    assert (restarted["reason"], restarted["marked"]) == ("the rendezvous stalled after a peer died", True)


@pytest.mark.parametrize("carried", [60, 40, None])
def test_a_replacement_dies_where_a_fault_planned_its_hosts_death(tmp_path, rendezvous_store, carried):
    """A host planned to die as the sync of the first recovery after step 50 starts dies
    there even if its worker was restarted in place during that recovery: the replacement
    carries its predecessor's step (60: dies; 40, or a fresh worker's None: lives on). Seen
    in CI: the replaced worker lived, and the job finished on one host too many."""
    host = f"doomed-{time.monotonic_ns()}"
    predecessor = restart.handoff_path(host, 1)
    restart.describe_handoff(predecessor, 0, placed=True, step=carried)
    place = urllib.request.Request("http://%s:%d/%s/%s:0" % (*rendezvous_store, restart.ASSIGNMENT, host),
                                   data=b"1,2,0,1,1,2", method="PUT")   # rank, size, local ...
    urllib.request.urlopen(place, timeout=5).close()
    env = {"PATH": "/usr/bin:/bin", "HOROVOD_HOSTNAME": host, restart.HANDOFF_ENV: str(predecessor),
           "HOROVOD_GLOO_RENDEZVOUS_ADDR": rendezvous_store[0],
           "HOROVOD_GLOO_RENDEZVOUS_PORT": str(rendezvous_store[1])}
    try:
        done = subprocess.run([PYTHON, str(ROOT / "tests" / "workers" / "doomed_replacement.py"),
                               "--run-dir", str(tmp_path)], cwd=ROOT, env=env, timeout=60,
                              capture_output=True, text=True)
    finally:
        for path in predecessor.parent.glob(f"*-{host}-*"):   # its own, under its pid, too
            path.unlink(missing_ok=True)
    kills = [e for e in read_events(tmp_path) if e["kind"] == "kill_injected"]
    if carried == 60:
        assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr
        assert [(e["step"], e["syncing"]) for e in kills] == [(60, True)]
    else:
        assert (done.returncode, done.stdout.strip(), kills) == (0, "survived", []), done.stderr


def test_worker_left_out_of_the_world_forming_is_not_replaced(agent):
    """Horovod aborts the worker of a removed host when the driver gives it no place: a
    replacement would ask the driver for a place and be counted in the next rendezvous
    (tests/test_elastic.py shows the stall that caused). The shim exits with the abort and
    the hand-off is cleared."""
    proc = shim(agent, job=(ABORTS,), args=("--handoff", "--unplaced"))
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGABRT and "replacement" not in out, out
    handed = out.split("handoff out at ")[1].split()[0]
    assert not any(p.exists() for p in restart.handoff_files(Path(handed)))


def test_worker_aborted_while_training_is_reported_as_aborted(agent):
    """Without a hand-off out, an abort is a death like any other: not replaced."""
    proc = shim(agent, job=(ABORTS,))
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGABRT and "replacement" not in out, out


def test_sigterm_to_the_shim_reaches_the_worker(agent):
    """A worker that handles SIGTERM hears it when the shim is signalled, and the shim
    exits as the worker did. Without forwarding the shim would die of the signal and the
    agent would SIGKILL the worker when its shim went."""
    proc = shim(agent, job=(TERMS,))
    try:
        assert proc.stdout.readline().startswith("worker ready")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0 and "got SIGTERM" in out, (proc.returncode, out)
    finally:
        kill_tree(proc.pid)


def test_one_warm_process_forks_an_agent_per_host_and_names_one_that_failed(tmp_path):
    """``--hosts-on-stdin``: each host's agent is forked from the warm process, named after
    its host, serves workers; one that cannot start says so instead of leaving the
    launcher waiting."""
    host = f"fork-test-{time.monotonic_ns() % 10**6}"
    proc = subprocess.Popen([PYTHON, "-m", "elastic.launch.agent", "--hosts-on-stdin",
                             "--preload", "jobs.digits"], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert json.loads(proc.stdout.readline()) == {"ready": proc.pid, "host": None}
        proc.stdin.write(json.dumps({"host": host, "netns": None}) + "\n")
        proc.stdin.write(json.dumps({"host": "no-such-ns", "netns": 2 ** 22 + 1}) + "\n")
        proc.stdin.flush()
        said = [json.loads(proc.stdout.readline()) for _ in range(2)]
        ready = next(m for m in said if m.get("host") == host)
        (failed,) = [m for m in said if "failed" in m]
        assert failed["failed"] == "no-such-ns" and "FileNotFoundError" in failed["error"]
        assert open(f"/proc/{ready['ready']}/comm").read().strip() == host[:15]
        worker = shim(host, tmp_path)
        assert worker.wait(timeout=120) == 0 and (tmp_path / "result.json").exists()
        spawned, ended = (json.loads(proc.stdout.readline()) for _ in range(2))
        assert spawned["host"] == host and ended == {"exit": spawned["spawn"], "code": 0}
    finally:
        kill_tree(proc.pid)
