"""What a ``regatta local`` run will do: hosts, steps, membership changes and faults, with
its command line. Every malformed option is a :class:`PlanError` naming it.

Two kinds of fault:

* from inside, at an exact step (``--kill``, ``--pause``, ``--slow``): the worker acts on
  the plan it finds in ``REGATTA_FAULTS``; repeatable to the step, for tests that assert
  on exact steps.
* from outside, at a random instant once STEP is reached (``--sigkill``, ``--stop``,
  ``--vanish``, ``--partition``, ``--bandwidth``): the launcher signals the training
  process the warm agent forked, or takes the host's link down, as a real fault would.
"""
from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field

from . import loopback
from .agent import REFILL_WINDOW_S
from .target import Target

OUTSIDE = ("sigkill", "stop", "vanish", "partition")
NEEDS_NETNS = ("vanish", "partition", "bandwidth")


class PlanError(ValueError):
    """A ``regatta local`` option is malformed; the message names it."""


@dataclass
class LocalPlan:
    job: str
    hosts: int = 2
    slots: int = 1
    steps: int = 100
    commit_every: int | str = 10
    kill: list = field(default_factory=list)      # [(host, step)]: the victim, at STEP
    kill_connecting: list = field(default_factory=list)   # [(host, step)]: see faults.py
    kill_syncing: list = field(default_factory=list)      # [(host, step)]: see faults.py
    kill_entering: list = field(default_factory=list)     # [(host, step)]: see faults.py
    add: list = field(default_factory=list)       # [(host, step)]
    remove: list = field(default_factory=list)    # [(host, step)]
    slow: dict = field(default_factory=dict)      # {host: factor}
    pause: list = field(default_factory=list)     # [(host, step, seconds)]
    faults: list = field(default_factory=list)    # outside faults: dicts, see fault()
    bandwidth: dict = field(default_factory=dict)  # {host: tc rate}
    network: str = "auto"   # netns | aliases | auto (netns where the kernel allows it)
    run_dir: str = "runs/local"
    report: str = ""
    db: str = ""            # metrics store for the job and the launcher's own events
    ingest: str = ""
    gloo_timeout: int = 30
    fast_recovery: bool = True
    timeout: float = 600.0
    job_args: list = field(default_factory=list)
    module: str = ""        # worker module or script; default: the job (benchmarks run a stock loop)
    warm_agents: bool = True   # fork workers from a warm agent per host (elastic.launch.agent)
    seed: int = 0           # for the instants of outside faults
    refill_window: float = REFILL_WINDOW_S   # seconds: see elastic.launch.agent.verdict
    cooldown: list = field(default_factory=list)   # [MIN, MAX] s before an excluded host returns

    def __post_init__(self) -> None:
        if self.hosts < 1 or self.slots < 1:
            raise PlanError(f"--hosts and --slots must be >= 1, got {self.hosts} and {self.slots}")
        if self.steps < 1:
            raise PlanError(f"--steps must be >= 1, got {self.steps}")
        if self.commit_every != "auto" and not (str(self.commit_every).isdigit() and int(self.commit_every) > 0):
            raise PlanError(f"--commit-every must be a positive integer or 'auto', got {self.commit_every!r}")
        if self.network not in ("auto", "netns", "aliases"):
            raise PlanError(f"network must be netns, aliases or auto, got {self.network!r}")
        steps = [("--kill", h, s) for h, s in self.kill] + [("--add", h, s) for h, s in self.add] \
            + [("--kill-connecting", h, s) for h, s in self.kill_connecting] \
            + [("--kill-syncing", h, s) for h, s in self.kill_syncing] \
            + [("--kill-entering", h, s) for h, s in self.kill_entering] \
            + [("--remove", h, s) for h, s in self.remove] \
            + [(f"--{f['fault']}", f["host"], f["step"]) for f in self.faults]
        for option, host, step in steps:
            if not 0 < step < self.steps:
                raise PlanError(f"{option} {host}@{step}: step must be between 1 and {self.steps - 1}")
        Target.parse(self.module or self.job)   # nothing to launch fails here, naming it
        known = set(self.every_host())
        for option, host, _ in steps:
            if option != "--add" and host not in known:
                raise PlanError(f"{option}: host {host} is not one of this run's hosts: "
                                f"{', '.join(sorted(known))}")
        for host in self.bandwidth:
            if host not in known:
                raise PlanError(f"--bandwidth: host {host} is not one of this run's hosts")
        if self.refill_window < 0:
            raise PlanError(f"--refill-window must be >= 0 seconds, got {self.refill_window}")
        if self.cooldown and not (len(self.cooldown) == 2 and 1 <= self.cooldown[0] <= self.cooldown[1] <= 3600):
            raise PlanError(f"--cooldown {':'.join(map(str, self.cooldown))}: must be MIN:MAX "
                            "whole seconds with 1 <= MIN <= MAX <= 3600 (horovodrun's bounds)")

    def initial_hosts(self) -> list[str]:
        return [loopback.host_name(i) for i in range(self.hosts)]

    def every_host(self) -> list[str]:
        """Each host the run may ever list, once (a host removed and added again is one
        host: one agent, one namespace)."""
        return list(dict.fromkeys(self.initial_hosts() + [h for h, _ in self.add]))

    @property
    def max_np(self) -> int:
        return len(self.every_host()) * self.slots

    def needs_netns(self) -> list[str]:
        return sorted({f"--{f['fault']}" for f in self.faults if f["fault"] in NEEDS_NETNS}
                      | ({"--bandwidth"} if self.bandwidth else set()))

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "LocalPlan":
        for key in ("kill", "kill_connecting", "kill_syncing", "kill_entering", "add", "remove",
                    "pause"):
            data[key] = [tuple(entry) for entry in data[key]]
        return cls(**data)


def fault(kind: str, host: str, step: int, slot: int | None = None,
          seconds: float | None = None, after: float | None = None) -> dict:
    """``after``: strike that many seconds after the fault listed before it (a second
    failure in the middle of the first one's recovery), not at a random instant."""
    return {"fault": kind, "host": host, "step": step, "slot": slot, "seconds": seconds,
            "after": after}


def resolve_host(text: str, plan_hosts: int, next_new: int) -> str:
    """``2`` means the second simulated host; ``""`` the next new one; else its address."""
    if text == "":
        return loopback.host_name(next_new)
    if text.isdigit():
        if not 1 <= int(text) <= plan_hosts:
            raise PlanError(f"host number {text} is outside 1..{plan_hosts}")
        return loopback.host_name(int(text) - 1)
    if not loopback.is_simulated(text):
        raise PlanError(f"host {text!r}: a simulated host is a number (1..{plan_hosts}), nothing "
                        f"(the next new one, as in '@120') or a loopback address 127.x.y.z "
                        f"from {loopback.host_name(0)} on")
    return text


def parse_at(value: str, option: str) -> tuple[str, int]:
    host, sep, step = value.rpartition("@")
    if not sep or not step.isdigit():
        raise PlanError(f"{option} {value!r} must look like HOST@STEP")
    return host, int(step)


def _number(text: str, value: str, option: str, shape: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise PlanError(f"{option} {value!r} must look like {shape}") from None


def _outside(kind: str, value: str, hosts: int) -> dict:
    """``HOST[/SLOT]@STEP[+AFTER][:SECONDS]`` for --sigkill, --stop, --vanish, --partition."""
    timed = kind in ("stop", "partition")
    shape = "HOST[/SLOT]@STEP[+AFTER]" + (":SECONDS" if timed else "")
    head, seconds = value, None
    if timed:
        head, sep, text = value.rpartition(":")
        if not sep:
            raise PlanError(f"--{kind} {value!r} must look like {shape}")
        seconds = _number(text, value, f"--{kind}", shape)
    head, plus, after = head.partition("+")
    target, step = parse_at(head, f"--{kind}")
    host, sep, slot = target.partition("/")
    if sep and not slot.isdigit():
        raise PlanError(f"--{kind} {value!r}: SLOT must be a number")
    return fault(kind, resolve_host(host, hosts, 0), step, int(slot) if sep else None, seconds,
                 _number(after, value, f"--{kind}", shape) if plus else None)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", help="a job under jobs/ (digits, charlm), a module (pkg.mod) or a script path")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--slots", type=int, default=1)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--commit-every", default="10", help="steps, or 'auto' (Young/Daly)")
    p.add_argument("--kill", action="append", default=[], metavar="HOST@STEP",
                   help="the workers of HOST (name or 1-based number) SIGKILL themselves at STEP")
    p.add_argument("--kill-connecting", action="append", default=[], metavar="HOST@STEP",
                   help="the workers of HOST SIGKILL themselves in the first recovery after STEP, "
                        "the instant Gloo connects them to the new world")
    p.add_argument("--kill-syncing", action="append", default=[], metavar="HOST@STEP",
                   help="the workers of HOST SIGKILL themselves in the first recovery after STEP, "
                        "the instant their hvd.init of the new world returns")
    p.add_argument("--kill-entering", action="append", default=[], metavar="HOST@STEP",
                   help="the workers of HOST SIGKILL themselves in the first recovery after STEP, "
                        "as they start building the new world's lifelines (after the sync)")
    p.add_argument("--sigkill", action="append", default=[], metavar="HOST[/SLOT]@STEP[+AFTER]",
                   help="SIGKILL HOST's training processes from outside, at a random instant after "
                        "STEP, or AFTER seconds after the fault listed before it")
    p.add_argument("--stop", action="append", default=[], metavar="HOST[/SLOT]@STEP:SECONDS",
                   help="SIGSTOP HOST's training processes from outside, SIGCONT after SECONDS")
    p.add_argument("--vanish", action="append", default=[], metavar="HOST@STEP",
                   help="take HOST's link down for good (no FIN, no RST; needs namespaces)")
    p.add_argument("--partition", action="append", default=[], metavar="HOST@STEP:SECONDS",
                   help="take HOST's link down, bring it back after SECONDS")
    p.add_argument("--bandwidth", action="append", default=[], metavar="HOST:RATE",
                   help="limit HOST's link to RATE (tc syntax: 10mbit) from the start")
    p.add_argument("--add", action="append", default=[], metavar="HOST@STEP",
                   help="add a host at STEP (HOST may be empty: the next free one)")
    p.add_argument("--remove", action="append", default=[], metavar="HOST@STEP")
    p.add_argument("--slow", action="append", default=[], metavar="HOST:FACTOR",
                   help="stretch HOST's compute time by FACTOR")
    p.add_argument("--pause", action="append", default=[], metavar="HOST@STEP:SECONDS",
                   help="stall HOST's workers for SECONDS at STEP (alive, not dead)")
    network = p.add_mutually_exclusive_group()
    network.add_argument("--netns", dest="network", action="store_const", const="netns",
                         help="hosts in network namespaces (the default where the kernel allows it)")
    network.add_argument("--aliases", dest="network", action="store_const", const="aliases",
                         help="hosts as loopback aliases of one network stack (needs root)")
    p.set_defaults(network="auto")
    p.add_argument("--run-dir", default="runs/local")
    p.add_argument("--report", default="", metavar="FILE")
    p.add_argument("--db", default="", help="metrics store (SQLite path) for the job and the launcher")
    p.add_argument("--ingest", default="", help="dashboard URL the job sends metrics to")
    p.add_argument("--gloo-timeout", type=int, default=30, help="seconds (Horovod's default 30)")
    p.add_argument("--stock-recovery", action="store_true",
                   help="stock Horovod behaviour: no fast failure detection, and horovodrun's "
                        "discovery once a second (not the moment the hosts file changes)")
    p.add_argument("--cold-workers", action="store_true",
                   help="start each worker as a fresh Python process (no warm agents)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0, help="for the instants of outside faults")
    p.add_argument("--refill-window", type=float, default=REFILL_WINDOW_S, metavar="SECONDS",
                   help="a crashed worker's slot gets a fresh worker while another worker of its "
                        "host lives, unless the host had a failure within SECONDS (then horovodrun "
                        "excludes the host)")
    p.add_argument("--cooldown", default="", metavar="MIN:MAX",
                   help="an excluded host may come back after MIN..MAX seconds, doubling each time "
                        "(horovodrun --blacklist-cooldown-range); default: never")
    p.add_argument("--module", default="", help=argparse.SUPPRESS)   # benchmarks' stock loop
    p.set_defaults(job_args=[])   # whatever follows `--` goes to the job


def plan_from_args(args: argparse.Namespace) -> LocalPlan:
    adds, next_new = [], args.hosts
    for value in args.add:
        host, step = parse_at(value, "--add")
        adds.append((resolve_host(host, args.hosts, next_new), step))
        next_new += 1
    every = args.hosts + len(adds)
    slow = {}
    for value in args.slow:
        host, _, factor = value.rpartition(":")
        slow[resolve_host(host, args.hosts, 0)] = _number(factor, value, "--slow", "HOST:FACTOR")
    pauses = []
    for value in args.pause:
        head, _, seconds = value.rpartition(":")
        host, step = parse_at(head, "--pause")
        pauses.append((resolve_host(host, args.hosts, 0), step,
                       _number(seconds, value, "--pause", "HOST@STEP:SECONDS")))
    bandwidth = {}
    for value in args.bandwidth:
        host, sep, rate = value.rpartition(":")
        if not sep or not rate:
            raise PlanError(f"--bandwidth {value!r} must look like HOST:RATE (e.g. 2:10mbit)")
        bandwidth[resolve_host(host, every, 0)] = rate
    faults = [_outside(kind, value, every) for kind in OUTSIDE for value in getattr(args, kind)]
    return LocalPlan(job=args.job, hosts=args.hosts, slots=args.slots, steps=args.steps,
                     commit_every=args.commit_every,
                     kill=[(resolve_host(h, args.hosts, 0), s)
                           for h, s in (parse_at(v, "--kill") for v in args.kill)],
                     kill_connecting=[(resolve_host(h, args.hosts, 0), s) for h, s in
                                      (parse_at(v, "--kill-connecting") for v in args.kill_connecting)],
                     kill_syncing=[(resolve_host(h, args.hosts, 0), s) for h, s in
                                   (parse_at(v, "--kill-syncing") for v in args.kill_syncing)],
                     kill_entering=[(resolve_host(h, args.hosts, 0), s) for h, s in
                                    (parse_at(v, "--kill-entering") for v in args.kill_entering)],
                     add=adds,
                     remove=[(resolve_host(h, args.hosts, 0), s)
                             for h, s in (parse_at(v, "--remove") for v in args.remove)],
                     slow=slow, pause=pauses, faults=faults, bandwidth=bandwidth,
                     network=args.network, run_dir=args.run_dir, report=args.report,
                     db=args.db, ingest=args.ingest, gloo_timeout=args.gloo_timeout,
                     fast_recovery=not args.stock_recovery, timeout=args.timeout,
                     job_args=args.job_args, module=args.module,
                     warm_agents=not args.cold_workers, seed=args.seed,
                     refill_window=args.refill_window, cooldown=_cooldown(args.cooldown))


def _cooldown(value: str) -> list:
    if not value:
        return []
    low, sep, high = value.partition(":")
    if not (sep and low.isdigit() and high.isdigit()):
        raise PlanError(f"--cooldown {value!r} must look like MIN:MAX (whole seconds)")
    return [int(low), int(high)]


def parse_plan(argv: list[str]) -> LocalPlan:
    """A plan from ``regatta local``'s arguments (``--`` then the job's own)."""
    parser = argparse.ArgumentParser(prog="regatta local")
    add_arguments(parser)
    passed = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:len(argv) - len(passed) - (1 if "--" in argv else 0)])
    args.job_args = passed
    return plan_from_args(args)
