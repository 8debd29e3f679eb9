"""Pipeline schedules as explicit per-rank action lists.

A schedule is a plain list of :class:`Action` for one stage and one optimizer step, e.g.
for stage 1 of 2 under 1F1B with 2 microbatches::

    recv_act 0, fwd 0, bwd 0, send_grad 0, recv_act 1, fwd 1, bwd 1, send_grad 1

The executor (executor.py) runs any such list, so GPipe and 1F1B differ only here, and
``simulate`` can prove a set of lists deadlock-free without running a model.

* GPipe: all m forwards, then all m backwards. Stage s holds m microbatches of
  activations at its peak.
* 1F1B (PipeDream-flush): stage s runs ``p - s - 1`` warm-up forwards, then alternates one
  forward and one backward, then drains the remaining backwards. Same bubble as GPipe,
  but at most ``p - s`` microbatches are in flight on stage s.
"""
from __future__ import annotations

from dataclasses import dataclass

KINDS = ("recv_act", "fwd", "send_act", "recv_grad", "bwd", "send_grad")


@dataclass(frozen=True)
class Action:
    kind: str        # one of KINDS
    microbatch: int

    def __repr__(self) -> str:
        return f"{self.kind} {self.microbatch}"


def _forward(stage: int, stages: int, i: int) -> list[Action]:
    return ([Action("recv_act", i)] if stage > 0 else []) + [Action("fwd", i)] + \
           ([Action("send_act", i)] if stage < stages - 1 else [])


def _backward(stage: int, stages: int, i: int) -> list[Action]:
    return ([Action("recv_grad", i)] if stage < stages - 1 else []) + [Action("bwd", i)] + \
           ([Action("send_grad", i)] if stage > 0 else [])


def gpipe(stage: int, stages: int, microbatches: int) -> list[Action]:
    actions = []
    for i in range(microbatches):
        actions += _forward(stage, stages, i)
    for i in range(microbatches):
        actions += _backward(stage, stages, i)
    return actions


def one_f_one_b(stage: int, stages: int, microbatches: int) -> list[Action]:
    warmup = min(stages - stage - 1, microbatches)
    actions = []
    for i in range(warmup):
        actions += _forward(stage, stages, i)
    for j in range(microbatches - warmup):
        actions += _forward(stage, stages, warmup + j)
        actions += _backward(stage, stages, j)
    for j in range(microbatches - warmup, microbatches):
        actions += _backward(stage, stages, j)
    return actions


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def make_schedule(name: str, stage: int, stages: int, microbatches: int) -> list[Action]:
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; known: {', '.join(SCHEDULES)}")
    return SCHEDULES[name](stage, stages, microbatches)


def simulate(lists: list[list[Action]], durations: list[list[float]] | None = None) -> dict:
    """Run every stage's list against the others with non-blocking sends and blocking
    receives (the executor's semantics). Returns {"peak_in_flight": [per stage]};
    raises RuntimeError naming the stuck actions on a deadlock and ValueError when a list
    sends or receives something its neighbour never matches.

    ``durations``, per stage the seconds of its fwd and bwd actions in list order (as
    StageStats.compute_times measures them): the step is also replayed with those compute
    times and messages that cost nothing, and "finish" gives each stage's end, so a
    measured step can be split into what the schedule and the compute times make
    inevitable and what the transport added."""
    stages = len(lists)
    sent: dict = {}             # (kind, microbatch, from_stage) delivered -> when
    received: set = set()
    clock, computed = [0.0] * stages, [0] * stages
    pos = [0] * stages
    in_flight, peak = [0] * stages, [0] * stages
    while any(pos[s] < len(lists[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while pos[s] < len(lists[s]):
                a = lists[s][pos[s]]
                if a.kind in ("recv_act", "recv_grad"):
                    kind = a.kind[5:]
                    message = (kind, a.microbatch, s - 1 if kind == "act" else s + 1)
                    if message not in sent:
                        break
                    received.add(message)
                    clock[s] = max(clock[s], sent[message])
                if durations is not None and a.kind in ("fwd", "bwd"):
                    clock[s] += durations[s][computed[s]]
                    computed[s] += 1
                if a.kind == "send_act":
                    sent["act", a.microbatch, s] = clock[s]
                elif a.kind == "send_grad":
                    sent["grad", a.microbatch, s] = clock[s]
                elif a.kind == "fwd":
                    in_flight[s] += 1
                    peak[s] = max(peak[s], in_flight[s])
                elif a.kind == "bwd":
                    in_flight[s] -= 1
                pos[s] += 1
                progressed = True
        if not progressed:
            stuck = {s: lists[s][pos[s]] for s in range(stages) if pos[s] < len(lists[s])}
            raise RuntimeError(f"schedule deadlocks; stages wait at {stuck}")
    if set(sent) != received:
        raise ValueError(f"sent but never received: {sorted(set(sent) - received)}")
    if any(in_flight):
        raise ValueError(f"microbatches left without a backward: {in_flight}")
    return {"peak_in_flight": peak, "finish": clock}
