"""``regatta local``: a real ``horovodrun`` elastic job on simulated hosts of this machine,
with faults injected at exact steps and a JSON report of what happened.

    regatta local digits --hosts 3 --slots 1 --steps 200 --commit-every 10 \
        --kill 2@60 --add @120 --report runs/local/report.json
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from ..events import EventLog, read_progress
from ..faults import ENV as FAULTS_ENV, FaultPlan
from . import agent, loopback
from .hosts import Host, format_discovery, run_discovery
from .report import build_report, write_report

DISCOVER = Path(__file__).resolve().parents[2] / "hostfiles" / "discover.sh"


class PlanError(ValueError):
    """A ``regatta local`` option is malformed; the message names it."""


@dataclass
class LocalPlan:
    job: str
    hosts: int = 2
    slots: int = 1
    steps: int = 100
    commit_every: int | str = 10
    kill: list[tuple[str, int]] = field(default_factory=list)
    add: list[tuple[str, int]] = field(default_factory=list)
    remove: list[tuple[str, int]] = field(default_factory=list)
    slow: dict[str, float] = field(default_factory=dict)
    pause: list[tuple[str, int, float]] = field(default_factory=list)
    run_dir: str = "runs/local"
    report: str = ""
    gloo_timeout: int = 30
    fast_recovery: bool = True
    timeout: float = 600.0
    job_args: list[str] = field(default_factory=list)
    module: str = ""        # worker module; default jobs.<job> (benchmarks run a stock loop)
    warm_agents: bool = True   # fork workers from a warm agent per host (elastic.launch.agent)

    def __post_init__(self) -> None:
        if self.hosts < 1 or self.slots < 1:
            raise PlanError(f"--hosts and --slots must be >= 1, got {self.hosts} and {self.slots}")
        if self.steps < 1:
            raise PlanError(f"--steps must be >= 1, got {self.steps}")
        if self.commit_every != "auto" and not (str(self.commit_every).isdigit() and int(self.commit_every) > 0):
            raise PlanError(f"--commit-every must be a positive integer or 'auto', got {self.commit_every!r}")
        for option, entries in (("--kill", self.kill), ("--add", self.add), ("--remove", self.remove)):
            for host, step in entries:
                if not 0 < step < self.steps:
                    raise PlanError(f"{option} {host}@{step}: step must be between 1 and {self.steps - 1}")
        initial = set(self.initial_hosts())
        for host, _ in self.kill + self.remove:
            if host not in initial and host not in {h for h, _ in self.add}:
                raise PlanError(f"host {host} is not one of this run's hosts: {', '.join(sorted(initial))}")

    def initial_hosts(self) -> list[str]:
        return [loopback.host_name(i) for i in range(self.hosts)]

    @property
    def max_np(self) -> int:
        return (self.hosts + len(self.add)) * self.slots


def resolve_host(text: str, plan_hosts: int, next_new: int) -> str:
    """``2`` means the second simulated host; ``""`` the next new one; else a name."""
    if text == "":
        return loopback.host_name(next_new)
    if text.isdigit():
        if not 1 <= int(text) <= plan_hosts:
            raise PlanError(f"host number {text} is outside 1..{plan_hosts}")
        return loopback.host_name(int(text) - 1)
    return text


def parse_at(value: str, option: str) -> tuple[str, int]:
    host, sep, step = value.rpartition("@")
    if not sep or not step.isdigit():
        raise PlanError(f"{option} {value!r} must look like HOST@STEP")
    return host, int(step)


def worker_module(plan: LocalPlan) -> str:
    return plan.module or f"jobs.{plan.job}"


def horovodrun_command(plan: LocalPlan, hosts_file: Path) -> list[str]:
    venv_bin = Path(sys.executable).parent
    python = [sys.executable, "-m", "elastic.launch.shim"] if plan.warm_agents else [sys.executable]
    return [str(venv_bin / "horovodrun"), "-np", str(plan.hosts * plan.slots),
            "--min-np", str(plan.slots), "--max-np", str(plan.max_np),
            "--host-discovery-script", f"{DISCOVER} {hosts_file}",
            "--network-interface", "lo", "--gloo-timeout-seconds", str(plan.gloo_timeout),
            *python, "-m", worker_module(plan), "--run-dir", plan.run_dir,
            "--steps", str(plan.steps), "--commit-every", str(plan.commit_every),
            "--no-progress", *plan.job_args]


def worker_env(plan: LocalPlan) -> dict[str, str]:
    faults = FaultPlan(kill=[{"host": h, "step": s} for h, s in plan.kill],
                       slow=dict(plan.slow),
                       pause=[{"host": h, "step": s, "seconds": t} for h, s, t in plan.pause])
    env = dict(os.environ)
    env[FAULTS_ENV] = faults.to_env()
    env["REGATTA_PROCS_PER_MACHINE"] = str(plan.max_np)
    env["REGATTA_FAST_RECOVERY"] = "1" if plan.fast_recovery else "0"
    env["PYTHONUNBUFFERED"] = "1"
    env[agent.NAMESPACE_ENV] = agent_namespace(plan)
    return env


def agent_namespace(plan: LocalPlan) -> str:
    """One per launch (the launcher's pid), so concurrent local runs never share agents."""
    return str(os.getpid())


def run_local(plan: LocalPlan) -> dict:
    run_dir = Path(plan.run_dir)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    hosts = [Host(name, plan.slots) for name in plan.initial_hosts()]
    hosts_file = run_dir / "hosts.txt"
    hosts_file.write_text(format_discovery(hosts))
    run_discovery(f"{DISCOVER} {hosts_file}")      # fail now, clearly, not inside horovodrun
    every_host = plan.initial_hosts() + [h for h, _ in plan.add]
    log = EventLog(run_dir, "launcher", 0)
    with loopback.aliases(every_host), warm_agents(plan, every_host):
        code = _supervise(plan, hosts, hosts_file, log)
    log.close()
    report = build_report(run_dir, exit_code=code, plan=plan)
    if plan.report:
        write_report(report, Path(plan.report))
    return report


def _supervise(plan: LocalPlan, hosts: list[Host], hosts_file: Path, log: EventLog) -> int:
    """Run horovodrun, edit the discovery file at the planned steps, show progress."""
    changes = sorted([(s, "add", h) for h, s in plan.add] + [(s, "remove", h) for h, s in plan.remove])
    output = open(Path(plan.run_dir) / "horovodrun.log", "w")
    log.record("launch", None, hosts=[h.name for h in hosts], slots=plan.slots)
    proc = subprocess.Popen(horovodrun_command(plan, hosts_file), stdout=output,
                            stderr=subprocess.STDOUT, env=worker_env(plan), start_new_session=True)
    bar = tqdm(total=plan.steps, desc=f"{plan.job} (local)", unit="step", dynamic_ncols=True)
    deadline = time.monotonic() + plan.timeout
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job did not finish within {plan.timeout:.0f} s; "
                                   f"see {plan.run_dir}/horovodrun.log")
            seen = read_progress(plan.run_dir)
            if seen and seen[0] != bar.n:
                bar.n = seen[0]
                bar.set_postfix(np=seen[1], refresh=False)
                bar.refresh()
                while changes and seen[0] >= changes[0][0]:
                    step, action, host = changes.pop(0)
                    hosts = _apply(action, host, hosts, plan.slots)
                    hosts_file.write_text(format_discovery(hosts))
                    kind = {"add": "host_added", "remove": "host_removed"}[action]
                    log.record(kind, seen[0], target=host, planned_step=step)
            time.sleep(0.02)
    finally:
        bar.close()
        _stop(proc)
        output.close()
    return proc.returncode


@contextmanager
def warm_agents(plan: LocalPlan, hosts: list[str]):
    """One warm agent per simulated host, hosts still to be added included (a node's
    agent warms up while it boots, before the operator lists it for discovery)."""
    agents = []
    try:
        if plan.warm_agents:
            log = open(Path(plan.run_dir) / "agents.log", "w")
            for host in hosts:
                agents.append(subprocess.Popen(
                    [sys.executable, "-m", "elastic.launch.agent", "--host", host,
                     "--preload", worker_module(plan)],
                    stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True,
                    env={**os.environ, agent.NAMESPACE_ENV: agent_namespace(plan)}))
            for started in agents:   # each prints one line once it listens
                if not started.stdout.readline():
                    raise RuntimeError(f"a warm agent failed to start; see {log.name}")
        yield
    finally:
        for started in agents:
            _stop(started)


def _apply(action: str, name: str, hosts: list[Host], slots: int) -> list[Host]:
    if action == "add":
        return hosts + [Host(name, slots)]
    return [h for h in hosts if h.name != name]


def _stop(proc: subprocess.Popen) -> None:
    """End horovodrun and every worker it started (they share its process group)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
