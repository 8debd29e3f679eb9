"""Chaos: minutes of faults from outside the training processes, at random instants, for
Regatta and for a stock Horovod elastic loop alike, on simulated hosts in namespaces.

    .venv/bin/python bench/bench_chaos.py [--minutes 3] [--every 20] [--hosts 4] [--seed 0]
        [--kinds kill,kill_rank0,double,during_recovery,vanish] [--engines regatta,stock] [--keep DIR]
        [--set train.gradient_sums=gloo ...]

Faults, one every EVERY seconds on average, of these kinds in turn (random order): a
SIGKILL of a training process (any rank), of rank 0's, two kills 50-300 ms apart, a kill
0.3-0.8 s after another (during its recovery), a host vanishing (link down for good).
Every host lost is replaced by a new one (added back) a few seconds later. Prints per
fault kind the time from the fault to the first step done in the new world (p50, p95,
max; for a pair also from its second kill; for kills also from the instant the victim's
last thread exited, before which no peer can see it die), where the median and slowest
went (victim exited, detected, reset, synced, first step, restarts in place), steps
redone, samples skipped or repeated (Regatta's workers record the ids they consume; the
stock loop samples at random, so it has none to check), final accuracy, and
goodput: useful steps per second over the run divided by the same engine's fault-free
steps per second (fault-free runs just before and just after, averaged), split in two by
the run's pace away from faults (commits 2 s clear of every fault, addition and recovery):
what the faults cost, and what the rest of the run (its other processes) cost the pace.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.percentiles import percentile   # noqa: E402
from elastic.launch.loopback import host_name   # noqa: E402
from monitor.recovery import phases   # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
REGATTA = [sys.executable, "-m", "regatta", "local"]
ENGINES = {"regatta": ["bench/chaos_worker.py"],
           "stock": ["digits", "--module", "bench.stock_elastic", "--stock-recovery",
                     "--cold-workers"]}
KINDS = ("kill", "kill_rank0", "double", "during_recovery", "vanish")
ADD_BACK_S = 4.0
CALM_STEPS = 2400   # about a minute fault-free; 600 steps (12 s) put one run's goodput at 1.05


def launch(engine: str, args: list[str], run_dir: Path, timeout: float,
           settings: list[str] = ()) -> dict:
    """``settings``: Regatta's config overrides (``SECTION.KEY=VALUE``), for its worker."""
    report = run_dir.with_suffix(".json")
    command = REGATTA + ENGINES[engine] + args + [
        "--commit-every", "10", "--run-dir", str(run_dir), "--report", str(report),
        "--db", str(run_dir.with_suffix(".db")), "--timeout", str(timeout)]   # not the user's store
    if engine == "regatta" and settings:
        command += ["--", *(f"--set={pair}" for pair in settings)]
    subprocess.run(command, cwd=ROOT, capture_output=True, timeout=timeout + 120)
    return json.loads(report.read_text())


def final_step(report: dict) -> int:
    """The step training ended at (the stock loop writes no result file: its events)."""
    return report["final_step"] or max([e["step"] or 0 for e in report["events"]
                                        if e["kind"] == "finish"], default=0)


def pace(report: dict) -> tuple[float, float]:
    """(useful steps, seconds) from the first step done to the end of training."""
    times = [e["wall_time"] for e in report["events"] if e["kind"] in ("resumed", "finish")]
    return float(final_step(report)), max(times) - min(times) if times else float("nan")


def quiet_pace(report: dict, clear_s: float = 2.0) -> float | None:
    """Steps per second between commits more than ``clear_s`` from any fault, addition or
    recovery: the run's pace when nothing happens. Beside the fault-free run's, it splits
    goodput into what the faults cost and what the run's other processes cost (idle agents
    polling took 0.3 of 2 cores once)."""
    events = sorted(report["events"], key=lambda e: e["wall_time"])
    marks = [e["wall_time"] for e in events if e["kind"] in
             ("fault_injected", "host_added", "peer_lost", "reset", "resumed")]
    commits = {}
    for e in events:
        if e["kind"] == "commit":
            commits.setdefault(e["step"], e["wall_time"])
    steps = sorted(commits)
    done = took = 0.0
    for a, b in zip(steps, steps[1:]):
        start, end = commits[a] - clear_s, commits[b] + clear_s
        if not any(start <= t <= end for t in marks):
            done, took = done + b - a, took + commits[b] - commits[a]
    return done / took if took else None


def stopped_seconds(report: dict) -> float:
    """Seconds in which no rank trained on: from each fault (its strike) and each addition
    (rank 0's notice, where the survivors stop) to the first step done after it, time
    covered twice counted once. Unlike goodput, it does not depend on the pace of the
    smaller world between a loss and its replacement (on 2 cores, 3 ranks step 40 % faster
    than 4 at the same global batch, which hides the faults' cost in goodput)."""
    events = sorted(report["events"], key=lambda e: e["wall_time"])
    resumed = [e["wall_time"] for e in events if e["kind"] == "resumed"]
    starts = [e["wall_time"] for e in events
              if (e["kind"] == "fault_injected" and e["fault"] in ("kill", "vanish"))
              or (e["kind"] == "host_added" and e["host"] != "launcher")]
    spans = sorted((t, next(r for r in resumed if r > t))
                   for t in starts if resumed and resumed[-1] > t)
    stopped, reached = 0.0, float("-inf")
    for start, end in spans:
        if end > reached:
            stopped, reached = stopped + end - max(start, reached), end
    return stopped


def plan(minutes: float, every: float, steps_per_s: float, hosts: int,
         rng: random.Random, chosen: tuple[str, ...] = KINDS) -> tuple[list[str], list[str], int]:
    """The regatta-local options of one chaos run, the kind of each struck fault in order,
    and the number of steps."""
    alive, next_host, args, struck = [host_name(i) for i in range(hosts)], hosts, [], []
    kinds = [chosen[i % len(chosen)] for i in range(int(minutes * 60 / every))]
    rng.shuffle(kinds)
    for n, kind in enumerate(kinds):
        step = int(((n + 1) * every + rng.uniform(-every / 4, every / 4)) * steps_per_s)
        pool = alive[1:] if kind != "kill_rank0" else alive[:1]
        victims = rng.sample(pool, 2 if kind in ("double", "during_recovery") else 1)
        gap = rng.uniform(0.05, 0.3) if kind == "double" else rng.uniform(0.3, 0.8)
        for i, victim in enumerate(victims):
            option = "--vanish" if kind == "vanish" else "--sigkill"
            args += [option, f"{victim}@{step}" + (f"+{gap:.3f}" if i else "")]
            struck.append(kind)
            alive.remove(victim)
        for _ in victims:      # a new host takes each lost one's place
            args += ["--add", f"{host_name(next_host)}@{step + int(ADD_BACK_S * steps_per_s)}"]
            alive.append(host_name(next_host))
            next_host += 1
    steps = int((minutes * 60 + every) * steps_per_s)
    return ["--hosts", str(hosts), "--steps", str(steps), *args], struck, steps


def recoveries(report: dict, struck: list[str]) -> dict[str, list[dict]]:
    """Per fault kind, one row per fault: ``seconds`` from the fault to the first step done
    after it, ``redone`` steps, the seconds to each of monitor.recovery's phases, and the
    ``restarts`` in place and ``lifelines_failed`` on the way (where a tail goes). A pair of
    kills counts once, from the first that struck. A fault whose target was already gone (a
    chained kill's target Gloo aborted, say) is recorded as missed: it keeps its place in
    the plan, or every later fault would be paired with the wrong one."""
    events = sorted(report["events"], key=lambda e: e["wall_time"])
    faults = [e for e in events if e["kind"] in ("fault_injected", "fault_missed")
              and e["fault"] in ("kill", "vanish")]
    resumed = [e for e in events if e["kind"] == "resumed"]
    found, i = defaultdict(list), 0
    while i < len(faults) and i < len(struck):
        kind = struck[i]
        pair = kind in ("double", "during_recovery") and i + 1 < len(faults)
        strikes = [e for e in faults[i:i + (2 if pair else 1)] if e["kind"] == "fault_injected"]
        i += 2 if pair else 1
        if not strikes:
            continue     # nothing struck: nothing to recover from
        start, last = strikes[0], strikes[-1]
        after = [e for e in resumed if e["wall_time"] > last["wall_time"]]
        end = after[0]["wall_time"] if after else float("inf")
        on_the_way = [e["kind"] for e in events if start["wall_time"] <= e["wall_time"] <= end]
        exits = [e["wall_time"] for e in events if e["kind"] == "victim_exited"
                 and e["victim"] in {s["pid"] for s in strikes}]
        exited = max(exits) if len(exits) == len(strikes) and start["fault"] == "kill" else None
        found[kind].append({
            "seconds": end - start["wall_time"],
            "from_last": end - last["wall_time"],   # a pair: the second kill's own recovery
            # the kernel's share: until the last victim's threads had all exited, its
            # sockets were open and no peer could see it die
            "exited_s": None if exited is None else exited - start["wall_time"],
            "from_exit": None if exited is None else end - exited,
            "redone": max(0, start["step"] - after[0]["step"] + 1) if after else 0,
            **phases(events, start["wall_time"], end + 1e-6),
            "restarts": on_the_way.count("restart_in_place"),
            "lifelines_failed": on_the_way.count("lifeline_failed")})
    return found


def print_tails(engine: str, found: dict[str, list[dict]]) -> None:
    """Per fault kind, the phases of its median and of its slowest recovery: seconds from
    the fault to the first peer_lost/restore (detected), reset, sync and step done."""
    print(f"\n{engine}: where recoveries went, seconds from the fault (median row / slowest row)")
    print(f"{'fault kind':16s} {'victim exited':>13s} {'detected':>13s} {'reset':>13s} "
          f"{'synced':>13s} {'first step':>13s} {'restarts':>9s}")
    cell = lambda v: "-" if v is None else f"{v:.2f}"   # noqa: E731
    for kind, rows in sorted(found.items()):
        ordered = sorted(rows, key=lambda r: r["seconds"])
        middle, slowest = ordered[len(ordered) // 2], ordered[-1]
        print(f"{kind:16s} " + " ".join(
            f"{cell(middle[k]):>6s}/{cell(slowest[k]):>6s}"
            for k in ("exited_s", "detected_s", "reset_done_s", "state_synced_s",
                      "first_step_done_s"))
            + f" {middle['restarts']:>4d}/{slowest['restarts']:<4d}")


def sample_errors(run_dir: Path) -> tuple[int, int] | None:
    """(skipped, repeated) sample ids over every epoch the run finished, counting for each
    step only its last execution, every rank of one world (a step redone after a restore
    replaces the first)."""
    records = [json.loads(line) for path in (run_dir / "ids").glob("ids-*.jsonl")
               for line in path.read_text().splitlines() if line.strip()]
    if not records:
        return None
    dataset = int((run_dir / "ids" / "dataset_size").read_text())
    by_step = defaultdict(list)
    for r in records:
        by_step[r["step"]].append(r)
    taken = {}
    for step, found in by_step.items():   # latest first, until one whole world's worth
        ranks, ids, size = set(), [], None
        for r in sorted(found, key=lambda r: -r["t"]):
            if r["rank"] not in ranks and size in (None, r["size"]):
                size = r["size"]
                ranks.add(r["rank"])
                ids += r["ids"]
            if len(ranks) == size:
                break
        taken[step] = ids
    order = [i for step in sorted(taken) for i in sorted(taken[step])]
    skipped = repeated = 0
    for epoch in range(len(order) // dataset):
        seen = order[epoch * dataset:(epoch + 1) * dataset]
        repeated += len(seen) - len(set(seen))
        skipped += dataset - len(set(seen))
    return skipped, repeated


def print_outcome(engine: str, report: dict, struck: list[str], steps: int, run_dir: Path,
                  fault_free: float) -> None:
    """The run's end, its goodput, and goodput split: the pace away from faults, and the
    time no rank trained on."""
    useful, seconds = pace(report)
    errors = sample_errors(run_dir)
    print(f"{engine:8s} exit {report['exit_code']}, step {final_step(report)} of {steps}, "
          f"accuracy {report['metrics'].get('accuracy', float('nan')):.3f}, "
          f"goodput {useful / seconds / fault_free:.3f}, samples skipped/repeated: "
          f"{'n/a (random sampling)' if errors is None else '%d/%d' % errors}")
    quiet = quiet_pace(report)
    if not quiet:
        return
    print(f"{engine:8s} away from faults {quiet:.1f} steps/s ({quiet / fault_free:.3f} of "
          f"fault-free); at that pace the faults and additions cost "
          f"{seconds - useful / quiet:.1f} s of {seconds:.1f}")
    redone = sum(r["redone"] for rows in recoveries(report, struck).values() for r in rows)
    stopped = stopped_seconds(report)
    print(f"{engine:8s} stopped {stopped:.1f} s (faults, additions) and redid {redone} steps: "
          f"{1 - (stopped + redone / quiet) / seconds:.3f} of the time trained on")


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):6.2f} {percentile(values, 0.95):6.2f} {max(values):6.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--every", type=float, default=20.0, help="seconds between faults, on average")
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engines", default="regatta,stock")
    parser.add_argument("--keep", metavar="DIR", help="keep the runs (reports, logs) in DIR")
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help="the fault kinds to strike, in turn (default: all; "
                             "kill,kill_rank0 for one kill every EVERY seconds)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a config override for Regatta's runs (e.g. train.gradient_sums=gloo)")
    args = parser.parse_args()
    kinds = tuple(args.kinds.split(","))
    if not kinds or not set(kinds) <= set(KINDS):
        parser.error(f"--kinds: each of {', '.join(KINDS)}, got {args.kinds!r}")
    print(f"load average before: {open('/proc/loadavg').read().strip()}", flush=True)
    engines = args.engines.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep or tmp)
        def calm(engine: str, when: str) -> float:
            report = launch(engine, ["--hosts", str(args.hosts), "--steps", str(CALM_STEPS)],
                            work / f"calm-{when}-{engine}", 900, args.set)
            rate = (lambda s, t: s / t)(*pace(report))
            print(f"{engine}: fault-free {rate:.1f} steps/s ({when})", flush=True)
            return rate
        before = {e: calm(e, "before") for e in engines}
        results = {}
        for engine in engines:   # the same fault plan for both, in steps of each one's pace
            options, struck, steps = plan(args.minutes, args.every, before[engine], args.hosts,
                                          random.Random(args.seed), kinds)
            report = launch(engine, options + ["--seed", str(args.seed)], work / f"chaos-{engine}",
                            args.minutes * 60 * 6 + 300, args.set)
            results[engine] = (report, struck, steps, work / f"chaos-{engine}")
        # the machine's pace drifts by 10-20 % over minutes: fault-free on both sides
        rates = {e: (before[e] + calm(e, "after")) / 2 for e in engines}
        print(f"\nload average after: {open('/proc/loadavg').read().strip()}")
        print(f"one fault every {args.every:.0f} s on average, {args.minutes:.1f} min, "
              f"{args.hosts} hosts (each lost host replaced)\n")
        print(f"{'engine':8s} {'fault kind':16s} {'n':>3s} {'recovery s: p50    p95    max':>30s} "
              f"{'from the last strike':>21s} {'from its exit':>21s} {'steps redone':>13s}")
        for engine, (report, struck, steps, run_dir) in results.items():
            for kind, found in sorted(recoveries(report, struck).items()):
                seconds = [r["seconds"] for r in found]
                last = [r["from_last"] for r in found]
                exits = [r["from_exit"] for r in found if r["from_exit"] is not None]
                print(f"{engine:8s} {kind:16s} {len(found):3d} {spread(seconds):>30s} "
                      f"{spread(last):>21s} {spread(exits):>21s} "
                      f"{sum(r['redone'] for r in found):13d}")
            missed = sum(e["kind"] == "fault_missed" for e in report["events"])
            print(f"{engine:8s} faults whose target was already gone: {missed}")
        for engine, (report, struck, steps, run_dir) in results.items():
            print_tails(engine, recoveries(report, struck))
        print()
        for engine, (report, struck, steps, run_dir) in results.items():
            print_outcome(engine, report, struck, steps, run_dir, rates[engine])


if __name__ == "__main__":
    main()
