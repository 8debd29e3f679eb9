"""What each failure (or host change) cost: the recovery table of a run, from its events.

A trigger is a ``failure``, ``host_added`` or ``host_removed`` event, or a ``peer_lost``
that no recorded trigger explains (a real crash records no ``failure`` of its own). Every
rank of a failed host records the failure, so triggers of one kind on one host within
GROUP_S seconds count once. For a trigger at time t, each phase is the first event of its
kind after t and before the next trigger:

    detected        first peer_lost or restore
    reset_done      first reset            (Horovod re-initialised at the new size)
    state_synced    first sync             (the survivors share rank 0's state)
    first_step_done first resumed          (a step completed in the new world)

``steps_redone`` comes from the restore events' detail (steps since the last commit).
It mirrors elastic.launch.report, which the dashboard may not import (DESIGN.md).
"""
from __future__ import annotations

from typing import Optional

TRIGGERS = ("failure", "host_added", "host_removed")
PHASES = (("detected", ("peer_lost", "restore")), ("reset_done", ("reset",)),
          ("state_synced", ("sync",)), ("first_step_done", ("resumed",)))
GROUP_S = 5.0


def _who(event: dict) -> Optional[str]:
    detail = event.get("detail") or {}
    return detail.get("target") or event.get("host")


def _first(events: list[dict], kinds: tuple, since: float, until: float) -> Optional[dict]:
    return next((e for e in events if e["kind"] in kinds and since <= e["wall_time"] < until),
                None)


def _grouped(events: list[dict], key=_who) -> list[dict]:
    """One trigger per (kind, key) burst: the earliest event, with how many ranks said so."""
    out: list[dict] = []
    for e in events:
        same = next((t for t in out if t["kind"] == e["kind"] and key(t) == key(e)
                     and e["wall_time"] - t["wall_time"] <= GROUP_S), None)
        if same is None:
            out.append(dict(e, ranks=1))
        else:
            same["ranks"] += 1
    return out


def _row(events: list[dict], trigger: dict, until: float) -> dict:
    t = trigger["wall_time"]
    row = {"kind": trigger["kind"], "host": _who(trigger), "step": trigger["step"],
           "wall_time": t, "ranks": trigger["ranks"]}
    for name, kinds in PHASES:
        hit = _first(events, kinds, t, until)
        row[name + "_s"] = None if hit is None else hit["wall_time"] - t
    restores = [e for e in events if e["kind"] == "restore" and t <= e["wall_time"] < until]
    row["steps_redone"] = max((e["detail"].get("steps_redone", 0) for e in restores), default=0)
    row["restored_to"] = min((e["step"] for e in restores if e["step"] is not None),
                             default=None)
    reset = _first(events, ("reset",), t, until)
    row["size_before"] = reset["detail"].get("size_before") if reset else None
    row["size_after"] = reset["detail"].get("size_after") if reset else None
    return row


def recoveries(events: list[dict]) -> list[dict]:
    """The recovery table of a run, oldest first; ``events`` as Store.events returns them."""
    events = sorted(events, key=lambda e: e["wall_time"])
    triggers = _grouped([e for e in events if e["kind"] in TRIGGERS])
    rows = _rows(events, triggers)
    # peer_lost outside every explained recovery window is a failure nobody announced.
    # A survivor may notice a death a little before the rank that records the failure.
    windows = [(r["wall_time"] - GROUP_S, r["wall_time"] + (r["first_step_done_s"] or GROUP_S))
               for r in rows]
    orphans = [e for e in events if e["kind"] == "peer_lost"
               and not any(lo <= e["wall_time"] <= hi for lo, hi in windows)]
    if orphans:
        # Every survivor reports the loss: one burst is one failure, whoever reported it.
        lost = [dict(e, host=f"rank {e['detail'].get('peer_rank', '?')}") for e in orphans]
        triggers = sorted(triggers + _grouped(lost, key=lambda e: None),
                          key=lambda e: e["wall_time"])
        rows = _rows(events, triggers)
    return rows


def _rows(events: list[dict], triggers: list[dict]) -> list[dict]:
    out = []
    for i, trigger in enumerate(triggers):
        until = triggers[i + 1]["wall_time"] if i + 1 < len(triggers) else float("inf")
        out.append(_row(events, trigger, until))
    return out
