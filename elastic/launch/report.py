"""The JSON report of a local run: outcome, every event, and what each change cost."""
from __future__ import annotations

import json
from pathlib import Path

from monitor.recovery import phases, window_ends

from ..runtime.events import read_events

# Outside faults that change the membership, and what the report calls them.
CHANGES = {"kill": "failure", "vanish": "vanish", "partition": "partition"}


def recovery(events: list[dict], trigger: dict, until: float) -> dict:
    """Seconds from ``trigger`` to each recovery phase and steps redone, measured as the
    dashboard measures them (monitor.recovery.phases), and the world size after."""
    out = phases(events, trigger["wall_time"], until)
    resumed = next((e for e in events if e["kind"] == "resumed"
                    and trigger["wall_time"] <= e["wall_time"] < until), None)
    out["size_after"] = None if resumed is None else resumed["size"]
    # what the host's agent made of it (elastic.launch.agent): the slot refilled, or the
    # whole host left to horovodrun to exclude
    failed = next((e for e in events if e["kind"] == "slot_failed" and e.get("target") == trigger.get("target", trigger["host"])
                   and trigger["wall_time"] <= e["wall_time"] < until), None)
    out["slot_action"] = None if failed is None else failed["action"]
    if trigger["kind"] in ("host_added", "host_removed"):   # an edit: detected when rank 0 noticed
        noticed = next((e for e in events if e["kind"] == trigger["kind"] and e["host"] != "launcher"
                        and trigger["wall_time"] <= e["wall_time"] < until), None)
        out["detected_s"] = None if noticed is None else noticed["wall_time"] - trigger["wall_time"]
    return out


def build_report(run_dir: Path, exit_code: int, plan=None) -> dict:
    events = read_events(run_dir)
    result_path = Path(run_dir) / "result.json"
    result = json.loads(result_path.read_text()) if result_path.exists() else {}
    # Triggers come from who caused them: the injected kill, the launcher's edits and
    # faults (a stop, a resumption or a healed link changes no membership).
    triggers = [e for e in events if e["kind"] == "kill_injected"
                or (e["host"] == "launcher" and e["kind"] in ("host_added", "host_removed"))
                or (e["kind"] == "fault_injected" and e["fault"] in CHANGES)]
    changes = []
    for trigger, until in zip(triggers, window_ends([t["wall_time"] for t in triggers])):
        kind = CHANGES.get(trigger.get("fault"), "failure" if trigger["kind"] == "kill_injected"
                           else trigger["kind"])
        changes.append({"kind": kind, "step": trigger["step"],
                        "host": trigger.get("target", trigger["host"]),
                        "slot": trigger.get("slot"), "pid": trigger.get("pid")
                        if trigger["kind"] == "fault_injected" else None,
                        "wall_time": trigger["wall_time"], **recovery(events, trigger, until)})
    return {"exit_code": exit_code, "final_step": result.get("step"),
            "final_world_size": result.get("world_size"), "metrics": result.get("metrics", {}),
            "plan": None if plan is None else {k: v for k, v in vars(plan).items()},
            "changes": changes, "events": events}


def write_report(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str))
