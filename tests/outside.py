"""Faults from outside a running job: start `regatta local` in the background, watch the
event files its workers write, and SIGKILL chosen workers at whatever instant the test
reaches (mid-step, mid-allreduce, mid-commit), not at a step boundary the victim chose."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from itertools import combinations
from pathlib import Path

import pytest

from conftest import BIN, ROOT, kill_tree, outside_pid
from elastic.runtime.events import read_events
from elastic.runtime.shards import cover
from monitor.event_kinds import KINDS, MINOR


class LocalRun:
    """A `regatta local` run in the background; use as a context manager (it always
    ends the whole process tree)."""

    def __init__(self, tmp: Path, *args: str, job_args=(), timeout: float = 300, env=None):
        self.run_dir, self.report = tmp / "run", tmp / "report.json"
        cmd = [str(BIN / "regatta"), "local", *args, "--run-dir", str(self.run_dir),
               "--report", str(self.report), "--timeout", str(timeout - 20), "--", *job_args]
        self.log = open(tmp / "local.log", "w")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                    "REGATTA_AUDIT": "1", **(env or {})}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.deadline = time.monotonic() + timeout

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        kill_tree(self.proc.pid)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log.close()

    def events(self) -> list[dict]:
        return read_events(self.run_dir) if (self.run_dir / "events").exists() else []

    def wait_for(self, found, what: str):
        """Poll the events until ``found(events)`` is truthy; its value."""
        while True:
            value = found(self.events())
            if value:
                return value
            if self.proc.poll() is not None or time.monotonic() > self.deadline:
                pytest.fail(f"{what}: not seen (exit {self.proc.poll()}); see {self.log.name}")
            time.sleep(0.05)

    def kill(self, hosts) -> float:
        """SIGKILL the training process of every host in ``hosts``, together: each is
        stopped first, so none can see another die and record a recovery of its own should
        this process be descheduled between two kills (a loaded CI machine did: a victim
        restored before its own kill). A stop closes no socket; the peers see only the
        kills. Returns the time just before the kills."""
        pids = {}
        for event in self.events():
            if event["kind"] == "start":
                pids[event["host"]] = event["pid"]
        targets = [outside_pid(host, pids[host]) for host in hosts]   # found first: kills back to back
        for pid in targets:
            os.kill(pid, signal.SIGSTOP)
        now = time.time()
        for pid in targets:
            os.kill(pid, signal.SIGKILL)
        return now

    def finish(self) -> dict:
        try:
            code = self.proc.wait(max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"regatta local did not finish in time; see {self.log.name}")
        assert code == 0, self.why_it_failed()
        return json.loads(self.report.read_text())

    def why_it_failed(self) -> str:
        """What a failed run leaves to read in a CI log, where its run dir is gone: the
        launcher's output, then ``what_happened``."""
        return "\n".join([Path(self.log.name).read_text()[-2000:],
                          what_happened(self.run_dir, self.events())])


def what_happened(run_dir: Path, events: list[dict]) -> str:
    """horovodrun's last lines and every rare event, one line each: what a failed run's
    assertion shows in a CI log, where the run dir is gone."""
    horovodrun = Path(run_dir) / "horovodrun.log"
    rare = [e for e in events if e["kind"] != "start" and
            (e["kind"] not in KINDS or KINDS[e["kind"]].klass != MINOR)]
    lines = [f"{e['wall_time']:.3f} {e['host']}/{e.get('pid')} {e['kind']} step={e['step']} "
             + json.dumps({k: v for k, v in e.items()
                           if k not in ("wall_time", "host", "pid", "kind", "step", "slot", "rank")})[:300]
             for e in rare[-60:]]
    return "\n".join(["-- horovodrun.log:",
                      horovodrun.read_text()[-5000:] if horovodrun.exists() else "(none)",
                      "-- events:", *lines])


def held_at(events: list[dict], step: int) -> dict[str, list]:
    """host -> the ranges its commit at ``step`` held (once every worker recorded it)."""
    return {e["host"]: [tuple(r) for r in e["held"]] for e in events
            if e["kind"] == "commit" and e["step"] == step}


def pair_to_kill(held: dict[str, list], extent: int, leaves_a_copy: bool) -> tuple[str, str]:
    """Two hosts whose loss leaves a copy of every piece (or, if not ``leaves_a_copy``,
    leaves some piece with none)."""
    def rest_covers(pair):
        items = [{"rank": i, "step": 0, "extent": extent, "ranges": ranges}
                 for i, (host, ranges) in enumerate(sorted(held.items())) if host not in pair]
        return cover(items, 0) is not None

    pairs = [p for p in combinations(sorted(held), 2) if rest_covers(p) == leaves_a_copy]
    assert pairs, f"no pair of hosts fits (held: {held})"
    return pairs[0]
