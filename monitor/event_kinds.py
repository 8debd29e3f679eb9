"""Every kind of event a run records, defined once: its class, label and colour.

``major`` events change the run (failure, host added or removed, re-plan, rebalance,
stall, an injected fault): the dashboard draws them as labelled vertical lines naming
the host affected. ``minor`` ones happen all the time (commit, checkpoint, straggler
flags): a low rug that can be toggled. ``none`` are kept and listed, not drawn. The
dashboard's JavaScript receives this table from the server (webui serves
``/event-kinds.js``); nothing here is repeated there.

An event's ``detail`` is a JSON object; the keys the dashboard reads are noted per kind.
``fault_injected`` is recorded by a launcher that kills, stops or cuts off a process or
host from outside: detail ``fault`` (kill | vanish | partition | stop, and cont or heal when
a stop or a partition ends), ``target`` (the host), and optionally ``slot`` and ``pid``. ``kill_injected`` is recorded by a worker just
before it SIGKILLs itself. ``slot_failed`` is recorded by the local launcher when a host's
agent saw a worker crash: detail ``target``, ``slot``, ``pid``, ``code`` and ``action``
(``refilled``: a fresh worker took the slot; ``host_excluded``: left to horovodrun, which
excludes the host). ``fault_missed``: a kill or stop whose target had no live training
process when it came (it had died already, e.g. Gloo aborted it for a peer's death);
detail ``fault``, ``target``, ``slot``, ``pid``. Both fault kinds mark when the failure that follows on that host began
(monitor.recovery measures "detected" from them). ``victim_exited``: the launcher saw every
thread of the process it SIGKILLed gone (only then are its sockets closed); detail
``target``, ``victim`` (pid), ``after_s`` since the kill, and for a slow exit ``threads``
(their states, kernel wait channels and CPUs as they changed) and ``stolen_s`` (per CPU, the
seconds the hypervisor took meanwhile).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

MAJOR, MINOR, NONE = "major", "minor", "none"


@dataclass(frozen=True)
class EventKind:
    name: str
    klass: str    # major | minor | none
    label: str    # what a person reads on the chart and in tables
    color: str
    symbol: str = "circle-open"   # the rug's marker (Plotly symbol name)


_RED, _GREEN, _AMBER, _PURPLE, _CYAN, _GREY, _ORANGE = (
    "#dc2626", "#16a34a", "#ca8a04", "#a855f7", "#0891b2", "#64748b", "#f97316")

KINDS: dict[str, EventKind] = {k.name: k for k in (
    EventKind("failure", MAJOR, "failure", _RED, "x"),
    EventKind("fault_injected", MAJOR, "fault injected", _RED, "x-open"),
    EventKind("host_added", MAJOR, "host added", _GREEN, "star"),
    EventKind("host_removed", MAJOR, "host removed", _AMBER, "star-open"),
    EventKind("slot_failed", MAJOR, "slot failed", _RED, "x-thin-open"),   # refilled, or its host excluded
    EventKind("replan", MAJOR, "re-plan", _PURPLE, "diamond"),
    EventKind("rebalance", MAJOR, "rebalance", _CYAN, "bowtie"),
    EventKind("stall", MAJOR, "stall", _AMBER, "hourglass"),
    EventKind("commit", MINOR, "commit", _GREY, "line-ns-open"),
    EventKind("checkpoint", MINOR, "checkpoint", _CYAN, "square-open"),
    EventKind("straggler", MINOR, "straggler", _AMBER, "hourglass-open"),
    EventKind("kill_injected", NONE, "kill injected", _RED, "x-open"),
    EventKind("fault_missed", NONE, "fault missed", _GREY, "x-open"),
    EventKind("victim_exited", NONE, "victim exited", _GREY, "x-open"),
    EventKind("peer_lost", NONE, "peer lost", _RED, "x-open"),
    EventKind("restore", NONE, "restore", _ORANGE, "triangle-left"),
    EventKind("reset", NONE, "reset", _PURPLE, "diamond-open"),
    EventKind("sync", NONE, "sync", _PURPLE, "diamond-open"),
    EventKind("resumed", NONE, "resumed", _GREEN, "triangle-right"),
    # Which state a re-formed world went on from (detail moved_bytes, steps_redone, cost_s)
    EventKind("recovered_live", NONE, "went on from live state", _GREEN),
    EventKind("adopted", NONE, "took a peer's live state", _GREEN),
    EventKind("restored_commit", NONE, "restored the commit", _ORANGE),
    EventKind("restored_checkpoint", NONE, "restored the checkpoint", _RED),
    EventKind("blacklist", NONE, "blacklisted", _RED),
    EventKind("stall_cleared", NONE, "stall cleared", _GREEN),
    EventKind("commit_interval", NONE, "commit interval", _CYAN),
    EventKind("calibration", NONE, "calibration", _GREY),
    EventKind("lifeline", NONE, "lifelines", _GREY),
    EventKind("lifeline_failed", NONE, "lifelines failed", _RED),   # a death while they were built
    EventKind("start", NONE, "start", _GREY),
    EventKind("ready", NONE, "ready", _GREY),
    EventKind("resume", NONE, "resumed from checkpoint", _CYAN),
    EventKind("launch", NONE, "launch", _GREY),
    EventKind("finish", NONE, "finish", _GREEN),
    EventKind("state_lost", NONE, "state lost", _RED),
    EventKind("run_failed", NONE, "run failed", _RED),
    EventKind("log", NONE, "log", _GREY),
    EventKind("plan", NONE, "pipeline plan", _PURPLE),
    EventKind("supervisor_done", NONE, "supervisor done", _GREY),
    EventKind("reduce_failed", NONE, "reduction failed", _RED),   # buckets sent/summed when the world broke
    EventKind("checkpoint_failed", MINOR, "checkpoint failed", _RED, "square-x-open"),   # a background write that raised
    EventKind("cut_off", NONE, "cut off", _RED),   # a worker whose host lost the network leaves
    EventKind("restart_in_place", NONE, "restarted in place", _ORANGE),
    EventKind("handoff_loaded", NONE, "hand-off loaded", _ORANGE),
    EventKind("severed_while_recovering", NONE, "severed while recovering", _RED),
    EventKind("no_place", NONE, "no place in the world", _GREY),
    EventKind("stopped", NONE, "launcher stopped", _GREY),
    EventKind("run_stopped", MAJOR, "stopped on a signal", _GREY, "square"),   # SIGTERM: scancel, a time limit
)}


def kind_of(name: str) -> EventKind:
    """The definition of ``name``; an unknown kind is kept and listed but not drawn."""
    return KINDS.get(name) or EventKind(name, NONE, name.replace("_", " "), _GREY)


def names(klass: str) -> tuple[str, ...]:
    return tuple(k.name for k in KINDS.values() if k.klass == klass)


def as_json() -> dict:
    """The table for the dashboard's JavaScript: {name: {klass, label, color, symbol}}."""
    return {name: {k: v for k, v in asdict(kind).items() if k != "name"}
            for name, kind in KINDS.items()}
