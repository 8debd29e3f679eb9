"""What each failure (or host change) cost: the recovery table of a run, from its events.

``recoveries(events)`` is pure: the dashboard calls it on the store's events and the
launcher's report on the workers' JSONL files. An event is a dict with ``kind``,
``wall_time``, ``step``, ``host`` and ``rank``, and its detail either under ``detail`` (a
dict: the store's shape) or flat beside them (the JSONL files' shape: ``target``,
``steps_redone``, ``size_before``, ... at the top level). Keys read from the detail:
``target`` (the host an event is about), ``fault``, ``steps_redone``, ``size_before``,
``size_after``, ``size`` and ``peer_rank``.

A trigger is a ``failure``, ``host_added`` or ``host_removed`` event, or a ``peer_lost``
that no recorded trigger explains (a real crash records no ``failure`` of its own). Every
rank of a host records the same failure, so triggers of one kind about one host within
GROUP_S seconds count once (HOST_CHANGE_S for host changes: the launcher records one
when it edits the host list, the workers another once they have re-formed).

When the failure was caused on purpose, its start is known: a ``kill_injected`` (the
victim, just before it SIGKILLs itself) or ``fault_injected`` (a launcher that killed,
stopped or cut off a host from outside: detail ``fault``, ``target``) event is the start
of the first failure that follows about that host, and every phase is measured from it.
Otherwise the failure event itself is the start (then "detected" is near 0 by
construction: a failure is recorded when it is noticed). For a start at time t each phase
is the first event of its kinds after t and before the next trigger:

    detected        first peer_lost or restore
    reset_done      first reset            (Horovod re-initialised at the new size)
    state_synced    first sync             (the survivors share rank 0's state)
    first_step_done first resumed          (a step completed in the new world)

Which state the re-formed world went on from is the costliest recovery event of the
window (``RECOVERY_PATHS``, cheapest first: the survivors' live state, a live state some
ranks took from the others, the in-memory commit, the durable checkpoint), with the bytes
it moved; its ``steps_redone`` is the window's, where it was recorded (a worker restarted
in place records a restore that assumes the commit).
"""
from __future__ import annotations

from typing import Optional

TRIGGERS = ("failure", "host_added", "host_removed")
FAULTS = ("kill_injected", "fault_injected")
PHASES = (("detected", ("peer_lost", "restore")), ("reset_done", ("reset",)),
          ("state_synced", ("sync",)), ("first_step_done", ("resumed",)))
RECOVERY_PATHS = ("recovered_live", "adopted", "restored_commit", "restored_checkpoint")
KINDS = TRIGGERS + FAULTS + ("peer_lost", "restore", "reset", "sync", "resumed") + RECOVERY_PATHS
GROUP_S = 5.0
HOST_CHANGE_S = 60.0
FAULT_MATCH_S = 600.0   # a failure noticed this long after a fault on its host is its


def detail(event: dict) -> dict:
    """An event's detail, whichever shape it came in."""
    inner = event.get("detail")
    return inner if isinstance(inner, dict) else event


def who(event: dict) -> Optional[str]:
    """The host an event is about: its ``target`` if it names one, else where it was
    recorded."""
    target = detail(event).get("target")
    return target if isinstance(target, str) else event.get("host")


def _number(value, default=None):
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def _first(events: list[dict], kinds: tuple, since: float, until: float) -> Optional[dict]:
    return next((e for e in events if e["kind"] in kinds and since <= e["wall_time"] < until),
                None)


def _grouped(events: list[dict], key=who, window=lambda kind: GROUP_S,
             kind_of=lambda e: e["kind"]) -> list[dict]:
    """One trigger per (kind, key) burst: the earliest event, with how many ranks said so."""
    out: list[dict] = []
    for e in events:
        kind = kind_of(e)
        same = next((t for t in out if t["kind"] == kind and t["who"] == key(e)
                     and e["wall_time"] - t["wall_time"] <= window(kind)), None)
        if same is None:
            out.append({"kind": kind, "who": key(e), "wall_time": e["wall_time"],
                        "step": e.get("step"), "ranks": 1, "event": e, "fault": None})
        else:
            same["ranks"] += 1
    return out


def _fault_name(event: dict) -> str:
    if event["kind"] == "kill_injected":
        return "kill"
    name = detail(event).get("fault")
    return name if isinstance(name, str) else "fault"


def _with_faults(triggers: list[dict], faults: list[dict]) -> list[dict]:
    """Move each failure's start back to the fault that caused it; a fault that no
    failure event follows becomes a failure trigger of its own."""
    for fault in faults:
        later = [f["wall_time"] for f in faults if f["who"] == fault["who"]
                 and f["wall_time"] > fault["wall_time"]]
        until = min(later + [fault["wall_time"] + FAULT_MATCH_S])
        match = next((t for t in triggers if t["kind"] == "failure" and t["fault"] is None
                      and t["who"] == fault["who"]
                      and fault["wall_time"] - GROUP_S <= t["wall_time"] < until), None)
        name = _fault_name(fault["event"])
        if match is None:
            triggers.append(dict(fault, kind="failure", fault=name))
        else:
            match.update(wall_time=min(fault["wall_time"], match["wall_time"]), fault=name,
                         step=match["step"] if match["step"] is not None else fault["step"])
    return sorted(triggers, key=lambda t: t["wall_time"])


def phases(events: list[dict], start: float, until: float) -> dict:
    """Seconds from ``start`` to each recovery phase (None if not reached before
    ``until``), the steps redone and the step restored to. ``events`` in wall-time order.
    The launcher's report measures its changes with this too."""
    out = {}
    for name, kinds in PHASES:
        hit = _first(events, kinds, start, until)
        out[name + "_s"] = None if hit is None else hit["wall_time"] - start
    restores = [e for e in events if e["kind"] == "restore" and start <= e["wall_time"] < until]
    paths = [e for e in events if e["kind"] in RECOVERY_PATHS and start <= e["wall_time"] < until]
    out["steps_redone"] = max((_number(detail(e).get("steps_redone"), 0) for e in paths or restores),
                              default=0)
    costliest = max(paths, key=lambda e: RECOVERY_PATHS.index(e["kind"]), default=None)
    out["recovered_from"] = costliest and costliest["kind"]
    out["moved_bytes"] = max((_number(detail(e).get("moved_bytes"), 0) for e in paths), default=None)
    out["restored_to"] = min((e["step"] for e in restores if _number(e.get("step")) is not None),
                             default=None)
    return out


def _row(events: list[dict], trigger: dict, until: float) -> dict:
    t = trigger["wall_time"]
    row = {"kind": trigger["kind"], "host": trigger["who"], "step": trigger["step"],
           "wall_time": t, "ranks": trigger["ranks"], "fault": trigger["fault"],
           **phases(events, t, until)}
    reset = _first(events, ("reset",), t, until)
    resumed = _first(events, ("resumed",), t, until)
    before = detail(reset).get("size_before") if reset else None
    after = detail(reset).get("size_after") if reset else None
    row["size_before"] = _number(before, _number(detail(trigger["event"]).get("size_before")))
    row["size_after"] = _number(after, _number(detail(resumed).get("size")) if resumed else None)
    return row


def window_ends(times: list[float]) -> list[float]:
    """Where each change's window ends (``times`` ascending): at the next change made at a
    later instant. Changes made at one instant (two hosts added at one step) share one
    re-forming, so each is measured over it."""
    return [next((later for later in times[i + 1:] if later > t), float("inf"))
            for i, t in enumerate(times)]


def _rows(events: list[dict], triggers: list[dict]) -> list[dict]:
    ends = window_ends([t["wall_time"] for t in triggers])
    return [_row(events, trigger, until) for trigger, until in zip(triggers, ends)]


def _usable(event) -> bool:
    return (isinstance(event, dict) and isinstance(event.get("kind"), str)
            and _number(event.get("wall_time")) is not None)


def recoveries(events: list[dict]) -> list[dict]:
    """The recovery table of a run, oldest first (see the module docstring): per trigger
    its kind, host, step, wall_time, ranks, fault (None, "kill", ...), the seconds to
    each phase (None if not reached), steps_redone, restored_to, size_before/after."""
    events = sorted((e for e in events if _usable(e)), key=lambda e: e["wall_time"])
    window = lambda kind: HOST_CHANGE_S if kind.startswith("host_") else GROUP_S  # noqa: E731
    triggers = _grouped([e for e in events if e["kind"] in TRIGGERS], window=window)
    faults = _grouped([e for e in events if e["kind"] in FAULTS], kind_of=lambda e: "fault")
    triggers = _with_faults(triggers, faults)
    rows = _rows(events, triggers)
    # peer_lost outside every explained recovery window is a failure nobody announced.
    # A survivor may notice a death a little before the rank that records the failure.
    windows = [(r["wall_time"] - GROUP_S, r["wall_time"] + (r["first_step_done_s"] or GROUP_S))
               for r in rows]
    orphans = [e for e in events if e["kind"] == "peer_lost"
               and not any(lo <= e["wall_time"] <= hi for lo, hi in windows)]
    if orphans:
        # Every survivor reports the loss: one burst is one failure, whoever reported it.
        key = lambda e: (detail(e).get("target") if isinstance(detail(e).get("target"), str)  # noqa: E731
                         else f"rank {detail(e).get('peer_rank', '?')}")
        lost = _grouped(orphans, key=key, kind_of=lambda e: "failure")
        triggers = sorted(triggers + lost, key=lambda t: t["wall_time"])
        rows = _rows(events, triggers)
    return rows

