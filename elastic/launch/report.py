"""The JSON report of a local run: outcome, every event, and what each change cost."""
from __future__ import annotations

import json
from pathlib import Path

from ..events import read_events

# A recovery's phases, each the first event of that kind after the trigger.
PHASES = (("reset_done", "reset"), ("state_synced", "sync"), ("first_step_done", "resumed"))


def _first_after(events: list[dict], kind: str, since: float, until: float) -> dict | None:
    return next((e for e in events if e["kind"] == kind and since <= e["wall_time"] < until), None)


def recovery(events: list[dict], trigger: dict, until: float) -> dict:
    """Seconds from ``trigger`` to each recovery phase, and steps redone."""
    start = trigger["wall_time"]
    detected = (_first_after(events, "peer_lost", start, until)
                or _first_after(events, "restore", start, until)
                or _first_after(events, "reset", start, until))
    out = {"detected_s": None if detected is None else detected["wall_time"] - start}
    for name, kind in PHASES:
        event = _first_after(events, kind, start, until)
        out[name + "_s"] = None if event is None else event["wall_time"] - start
    resumed = _first_after(events, "resumed", start, until)
    out["size_after"] = None if resumed is None else resumed["size"]
    redone = [e["steps_redone"] for e in events
              if e["kind"] == "restore" and start <= e["wall_time"] < until]
    out["steps_redone"] = max(redone) if redone else 0
    return out


def build_report(run_dir: Path, exit_code: int, plan=None) -> dict:
    events = read_events(run_dir)
    result_path = Path(run_dir) / "result.json"
    result = json.loads(result_path.read_text()) if result_path.exists() else {}
    # Triggers come from who caused them: the injected kill, the launcher's edits.
    triggers = [e for e in events if e["kind"] == "kill_injected"
                or (e["host"] == "launcher" and e["kind"] in ("host_added", "host_removed"))]
    changes = []
    for i, trigger in enumerate(triggers):
        until = triggers[i + 1]["wall_time"] if i + 1 < len(triggers) else float("inf")
        kind = "failure" if trigger["kind"] == "kill_injected" else trigger["kind"]
        changes.append({"kind": kind, "step": trigger["step"],
                        "host": trigger.get("target", trigger["host"]),
                        "wall_time": trigger["wall_time"], **recovery(events, trigger, until)})
    return {"exit_code": exit_code, "final_step": result.get("step"),
            "final_world_size": result.get("world_size"), "metrics": result.get("metrics", {}),
            "plan": None if plan is None else {k: v for k, v in vars(plan).items()},
            "changes": changes, "events": events}


def write_report(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str))
