"""The warm agents of a ``regatta local`` launch: one process warms up (torch, Horovod, the
job) and forks an agent per simulated host from it, each inside its host's namespaces
(elastic/launch/agent.py), while horovodrun starts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from . import agent
from .inject import Workers
from .plan import LocalPlan
from .stopping import Stopping, stop_tree
from .target import Target



def warming_marker(plan: LocalPlan) -> Path:
    """The file that exists while the launch's agents warm up (shims wait for theirs)."""
    return Path(plan.run_dir) / "agents.warming"


def worker_target(plan: LocalPlan) -> Target:
    return Target.parse(plan.module or plan.job)


def preload(target: Target) -> list[str]:
    """A job module is imported ahead by the agent; a script is not (importing it would run
    whatever it does at top level), only the runtime it uses."""
    return ["--preload", target.value] if target.kind == "module" else []


def agent_namespace(plan: LocalPlan) -> str:
    """One per launch (the launcher's pid), so concurrent local runs never share agents."""
    return str(os.getpid())


@contextmanager
def warm_agents(plan: LocalPlan, network, workers: Workers, agent_dir: str,
                stopping: Stopping | None = None):
    """A warm agent per simulated host, hosts still to be added included (a node's agent
    warms up while it boots, before the operator lists it for discovery); with namespaces,
    each inside its host's namespaces. All are forked from one warm process: the imports
    are paid once, not once per host on the same cores.

    Yields ``ready()``, which waits until every agent answers. Until then a marker file
    (:data:`agent.WARMING_ENV`) tells the shims to wait for their agent rather than start
    cold, so horovodrun can start (about 2 s) while the agents warm up (3-4 s)."""
    agents = []
    marker = warming_marker(plan)

    def ready() -> None:
        try:
            trouble = workers.wait_ready(len(hosts) + 1)   # the warm process, each host's agent
        finally:
            marker.unlink(missing_ok=True)
        if trouble:
            raise RuntimeError(f"a warm agent failed to start: {trouble}; see {log.name}")

    try:
        if not plan.warm_agents:
            yield lambda: None
            return
        marker.touch()
        log = open(Path(plan.run_dir) / "agents.log", "w")
        env = {**os.environ, agent.NAMESPACE_ENV: agent_namespace(plan)}
        if agent_dir:
            env[agent.DIR_ENV] = agent_dir
        command = [sys.executable, "-m", "elastic.launch.agent", "--hosts-on-stdin",
                   *preload(worker_target(plan))]
        agents.append(subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=log, text=True, start_new_session=True, env=env))
        if stopping is not None:   # a signal reaches the agents and their workers at once
            stopping.forward_to(agents[-1], group=True)
        hosts = plan.every_host()
        for host in hosts:
            holder = network.hosts[host].holder.pid if network is not None else None
            agents[0].stdin.write(json.dumps({"host": host, "netns": holder,
                                              "refill_window": plan.refill_window}) + "\n")
        agents[0].stdin.flush()
        workers.follow(agents[0].stdout)
        yield ready
    finally:
        marker.unlink(missing_ok=True)
        stop_tree(*agents)
