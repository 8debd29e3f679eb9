"""``regatta local``: a real ``horovodrun`` elastic job on simulated hosts of this machine,
with faults injected from inside at exact steps or from outside at random instants, and
a JSON report of what happened.

    regatta local digits --hosts 3 --slots 1 --steps 200 --commit-every 10 \
        --sigkill 2@60 --add @120 --report runs/local/report.json

Hosts are network namespaces where the kernel allows it (elastic/launch/netns.py: the
whole simulation runs inside a private user, network and PID namespace, so no root is
needed and nothing outlives it), else loopback aliases of one network stack
(elastic/launch/loopback.py, needs root). Either way each simulated host is a local host
to horovodrun, which starts a shim per slot; the shim has the host's warm agent, inside
the host's namespace, fork the worker (elastic/launch/agent.py).
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack, contextmanager
from pathlib import Path

from tqdm import tqdm

from ..runtime.events import EventLog, read_progress
from ..runtime.runs import run_name
from ..failures.faults import ENV as FAULTS_ENV, FaultPlan
from . import agent, loopback, netns
from .hosts import Host, run_discovery, write_discovery
from .inject import Injector, Workers
from .plan import LocalPlan, PlanError, parse_at, resolve_host   # noqa: F401  (re-exported)
from .report import build_report, write_report
from .stopping import Stopping, stop_tree
from .warm import agent_namespace, warm_agents, warming_marker, worker_target

DISCOVER = Path(__file__).resolve().parents[2] / "hostfiles" / "discover.sh"


def network_kind(plan: LocalPlan) -> str:
    """netns or aliases: what the plan asks for, or what this machine allows."""
    if plan.network == "aliases":
        if plan.needs_netns():
            raise PlanError(f"{', '.join(plan.needs_netns())} need hosts in network namespaces "
                            "(loopback aliases share one network stack: nothing to cut)")
        return "aliases"
    if netns.inside_private():
        return "netns"
    why = netns.available() or ("the job sends metrics to --ingest, which hosts in private "
                                "namespaces cannot reach" if _ingests(plan) else "")
    if why and (plan.network == "netns" or plan.needs_netns()):
        raise PlanError(f"network namespaces are not available here: {why}")
    return "aliases" if why else "netns"


def horovodrun_command(plan: LocalPlan, hosts_file: Path, interface: str) -> list[str]:
    venv_bin = Path(sys.executable).parent
    python = [sys.executable, "-m", "elastic.launch.shim"] if plan.warm_agents else [sys.executable]
    target = worker_target(plan)
    flags = [] if target.keeps_command_line else regatta_flags(plan)
    # Regatta's own horovodrun notices an edit of the hosts file at once (stock: within 1 s).
    horovodrun = ([sys.executable, "-m", "elastic.launch.prompt_discovery", "--watch", str(hosts_file), "--"]
                  if plan.fast_recovery else [str(venv_bin / "horovodrun")])
    return [*horovodrun, "-np", str(plan.hosts * plan.slots),
            "--min-np", str(plan.slots), "--max-np", str(plan.max_np),
            "--host-discovery-script", f"{DISCOVER} {hosts_file}",
            "--network-interface", interface, "--gloo-timeout-seconds", str(plan.gloo_timeout),
            *(["--blacklist-cooldown-range", *map(str, plan.cooldown)] if plan.cooldown else []),
            *python, *target.python_args(), *flags, *plan.job_args]


def regatta_flags(plan: LocalPlan) -> list[str]:
    """What the launch tells the training script, on its command line (or, for a Horovod
    script, in REGATTA_ARGS)."""
    job = ["--db", plan.db] if plan.db else []
    job += ["--ingest", plan.ingest] if plan.ingest else []
    return ["--run-dir", plan.run_dir, "--steps", str(plan.steps),
            "--commit-every", str(plan.commit_every), "--no-progress", *job]


def worker_env(plan: LocalPlan, run_id: str, agent_dir: str) -> dict[str, str]:
    faults = FaultPlan(kill=[{"host": h, "step": s} for h, s in plan.kill],
                       kill_connecting=[{"host": h, "step": s} for h, s in plan.kill_connecting],
                       kill_syncing=[{"host": h, "step": s} for h, s in plan.kill_syncing],
                       kill_entering=[{"host": h, "step": s} for h, s in plan.kill_entering],
                       slow=dict(plan.slow),
                       pause=[{"host": h, "step": s, "seconds": t} for h, s, t in plan.pause])
    env = dict(os.environ)
    env[FAULTS_ENV] = faults.to_env()
    env["REGATTA_PROCS_PER_MACHINE"] = str(plan.max_np)
    env["REGATTA_FAST_RECOVERY"] = "1" if plan.fast_recovery else "0"
    env["REGATTA_RUN_ID"] = run_id
    env["PYTHONUNBUFFERED"] = "1"
    if worker_target(plan).keeps_command_line:
        env["REGATTA_ARGS"] = shlex.join(regatta_flags(plan))
    env[agent.NAMESPACE_ENV] = agent_namespace(plan)
    if agent_dir:
        env[agent.DIR_ENV] = agent_dir
    env[agent.WARMING_ENV] = str(warming_marker(plan))
    return env


def new_run_id(plan: LocalPlan) -> str:
    """A fresh id per launch: the job's rows and the launcher's events join under it."""
    return f"{run_name(plan.job)}-local-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def _ingests(plan: LocalPlan) -> bool:
    return bool(plan.ingest) or "--ingest" in plan.job_args


def _check_ingest(plan: LocalPlan, kind: str) -> None:
    if kind == "netns" and _ingests(plan):
        raise PlanError("--ingest: hosts in private network namespaces reach no network but "
                        "their own; pass --db (a dashboard can read that file) or --aliases")


def run_local(plan: LocalPlan) -> dict:
    """Run the plan; returns the report (also written to ``plan.report`` if set)."""
    kind = network_kind(plan)
    _check_ingest(plan, kind)
    if not netns.inside_private():
        _fresh(Path(plan.run_dir))
        if kind == "netns":
            return _run_private(plan)
    return _run_here(plan, kind)


def _replay_spools_of_the_dead(plan: LocalPlan) -> int:
    """A worker killed mid-run leaves its spool (rows it could not deliver, or an empty
    file): delivered now, every worker being gone, rather than left in the spool folder
    for a later run on the same store to find. The rows delivered."""
    if not (plan.db or plan.ingest):
        return 0
    from monitor.replay import replay
    from monitor.sink import destination_of
    replayed = replay(only=destination_of(db=plan.db or None, ingest=plan.ingest or None),
                      token=os.environ.get("REGATTA_INGEST_TOKEN"))
    return replayed.delivered


def _fresh(run_dir: Path) -> None:
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)


def _run_private(plan: LocalPlan) -> dict:
    """Run the launcher again inside private namespaces; its report comes back as a file.
    Signals reach it (Stopping forwards them), and when it ends the kernel ends the rest."""
    plan_file = Path(plan.run_dir) / "plan.json"
    plan_file.write_text(json.dumps(plan.to_json()))
    command = netns.private([sys.executable, "-m", "elastic.launch.local", str(plan_file)])
    # The agents' sockets' folder is made out here: a second signal SIGKILLs the launcher
    # inside, and this one still removes it.
    with Stopping() as stopping, tempfile.TemporaryDirectory(prefix="regatta-agents-") as sockets:
        inner = subprocess.Popen(command, env={**os.environ, netns.PRIVATE_ENV: "1", agent.DIR_ENV: sockets},
                                 start_new_session=True)   # one signal reaches it: ours
        stopping.forward_to(inner)
        code = inner.wait()
    report_file = Path(plan.run_dir) / "report.json"
    if not report_file.exists():
        raise RuntimeError(f"the launcher inside the namespaces ended ({code}) without a "
                           f"report; see {plan.run_dir}/horovodrun.log")
    report = json.loads(report_file.read_text())
    if plan.report:
        write_report(report, Path(plan.report))
    return report


def _run_here(plan: LocalPlan, kind: str) -> dict:
    # The store's modules (SQLAlchemy, 0.5 s) are imported here, not at the top: the
    # launcher outside the namespaces does not need them and delays the run by as much.
    from monitor.sink import make_sink
    run_dir = Path(plan.run_dir)
    hosts = [Host(name, plan.slots) for name in plan.initial_hosts()]
    hosts_file = run_dir / "hosts.txt"
    write_discovery(hosts_file, hosts)
    run_discovery(f"{DISCOVER} {hosts_file}")      # fail now, clearly, not inside horovodrun
    run_id = new_run_id(plan)
    sink = make_sink(db=plan.db or None, ingest=plan.ingest or None,
                     token=os.environ.get("REGATTA_INGEST_TOKEN"))
    log = EventLog(run_dir, "launcher", 0, sink=sink, run_id=run_id)
    log.record("launch", None, hosts=[h.name for h in hosts], slots=plan.slots, network=kind,
               plan=plan.to_json())
    workers = Workers(agent_namespace(plan), on_slot_failed=lambda failed: log.record(
        "slot_failed", _step_reached(plan), **failed))
    with ExitStack() as stack:
        stopping = stack.enter_context(Stopping())
        stack.enter_context(loopback.aliases(plan.every_host()))
        network = stack.enter_context(_network(plan, kind))
        agent_dir = os.environ[agent.DIR_ENV] if kind == "netns" else ""   # (_run_private)
        agents_ready = stack.enter_context(warm_agents(plan, network, workers, agent_dir, stopping))
        injector = Injector(plan.faults, workers, network, log, plan.seed)
        stack.callback(injector.stop)
        code = _supervise(plan, hosts, hosts_file, log, injector, stopping, agents_ready,
                          worker_env(plan, run_id, agent_dir), "rg0" if kind == "netns" else "lo")
    log.close()
    sink.close()
    replayed = _replay_spools_of_the_dead(plan)
    report = build_report(run_dir, exit_code=code, plan=plan)
    report["run_id"], report["network"] = run_id, kind
    report["replayed_rows"] = replayed
    write_report(report, run_dir / "report.json")
    if plan.report:
        write_report(report, Path(plan.report))
    return report


@contextmanager
def _network(plan: LocalPlan, kind: str):
    """The namespaces' bridge and hosts (with their slow links), or nothing for aliases."""
    if kind != "netns":
        yield None
        return
    with netns.Network(plan.run_dir) as network:
        for name in plan.every_host():
            network.add_host(name)
        for name, rate in plan.bandwidth.items():
            network.bandwidth(name, rate)
        yield network


def _supervise(plan: LocalPlan, hosts: list[Host], hosts_file: Path, log: EventLog,
               injector: Injector, stopping: Stopping, agents_ready, env: dict,
               interface: str) -> int:
    """Run horovodrun (while the agents warm up), edit the discovery file at the planned
    steps, arm the outside faults, show progress."""
    changes = sorted([(s, "add", h) for h, s in plan.add] + [(s, "remove", h) for h, s in plan.remove])
    output = open(Path(plan.run_dir) / "horovodrun.log", "w")
    proc = subprocess.Popen(horovodrun_command(plan, hosts_file, interface), stdout=output,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
    stopping.forward_to(proc, group=True)
    bar = tqdm(total=plan.steps, desc=f"{plan.job} (local)", unit="step", dynamic_ncols=True)
    deadline = time.monotonic() + plan.timeout
    pace, edited = Pace(), {}
    try:
        agents_ready()
        while proc.poll() is None and not stopping.requested:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job did not finish within {plan.timeout:.0f} s; "
                                   f"see {plan.run_dir}/horovodrun.log")
            seen = read_progress(plan.run_dir)
            if seen and seen[0] != bar.n:
                bar.n = seen[0]
                bar.set_postfix(np=seen[1], refresh=False)
                bar.refresh()
                injector.reached(seen[0], pace.step(seen[0]))
                hosts = apply_due_changes(changes, seen[0], hosts, plan.slots, hosts_file, log,
                                          world=seen[1], edited=edited)
            time.sleep(0.02)
    finally:
        bar.close()
        injector.stop()
        stop_tree(proc)
        output.close()
    if stopping.requested:
        log.record("stopped", None, signal=stopping.requested)
        return 128 + stopping.requested
    return proc.returncode


# The longest a change to a host waits for the job to take up the last one: a join takes
# 2-3 s here, several times that on two busy cores; only a change that moves no world
# size waits it out.
TAKE_UP_S = 30.0


def apply_due_changes(changes: list, reached: int, hosts: list[Host], slots: int,
                      hosts_file: Path, log: EventLog, world: int | None = None,
                      edited: dict | None = None) -> list[Host]:
    """Apply the planned changes due by step ``reached`` (popping them) and rewrite the
    discovery file once, so changes due at one step reach horovodrun as one change.

    A change to a host waits while the job has not re-formed since the last change to that
    host (its world size ``world`` is still the one that change saw; ``edited`` remembers,
    host -> (world, when)), at most TAKE_UP_S: a host removed at step 400 and added at 700
    was otherwise back in the file before horovodrun's discovery (about once a second) saw
    it go, whenever 300 steps took less, and the removal never happened."""
    edited = {} if edited is None else edited
    due = []
    while changes and reached >= changes[0][0]:
        last = edited.get(changes[0][2])
        if last and last[0] == world and time.monotonic() - last[1] < TAKE_UP_S:
            break
        due.append(changes.pop(0))
    for _, action, host in due:
        hosts = _apply(action, host, hosts, slots)
    # One instant for all (the report measures them as one re-forming), taken before the
    # edit: the driver may act on it before this process runs again.
    now = time.time()
    if due:
        write_discovery(hosts_file, hosts)
    for step, action, host in due:
        kind = {"add": "host_added", "remove": "host_removed"}[action]
        log.record(kind, reached, wall_time=now, target=host, planned_step=step)
        edited[host] = (world, time.monotonic())
    return hosts


class Pace:
    """Seconds per step, from the progress the launcher sees (for the faults' instants)."""

    def __init__(self) -> None:
        self.last: tuple[int, float] | None = None
        self.seconds = 0.05

    def step(self, step: int) -> float:
        now = time.monotonic()
        if self.last is not None and step > self.last[0]:
            self.seconds = 0.7 * self.seconds + 0.3 * (now - self.last[1]) / (step - self.last[0])
        self.last = (step, now)
        return self.seconds


def _step_reached(plan: LocalPlan) -> int | None:
    seen = read_progress(plan.run_dir)
    return seen[0] if seen else None


def _apply(action: str, name: str, hosts: list[Host], slots: int) -> list[Host]:
    if action == "add":
        return hosts + [Host(name, slots)]
    return [h for h in hosts if h.name != name]


def main(argv: list[str] | None = None) -> None:
    """Inside the private namespaces: run the plan the outer launcher wrote."""
    argv = sys.argv[1:] if argv is None else argv
    plan = LocalPlan.from_json(json.loads(Path(argv[0]).read_text()))
    report = run_local(plan)
    sys.exit(0 if report["exit_code"] == 0 else 1)


if __name__ == "__main__":
    main()
