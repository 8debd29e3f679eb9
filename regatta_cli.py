"""The ``regatta`` command: the one place that knows every part.

    regatta local digits --hosts 3 --steps 200 --kill 2@60 --add @120 --report r.json
    regatta check-hosts --hostfile hostfiles/localhost.txt
    regatta check-hosts --discovery "hostfiles/discover.sh hostfiles/hosts.txt"
    regatta supervise charlm --hostfile hostfiles/pipeline.txt --pp 2 -- --steps 400
    regatta plan charlm --np 4 -- --config jobs/charlm_pipeline.toml
    regatta ui --db runs/regatta.db                      # the dashboard, 127.0.0.1:8050
    regatta demo                                         # dashboard + a live elastic run
"""
from __future__ import annotations

import argparse
import json
import sys


def _local_parser(sub) -> None:
    p = sub.add_parser("local", help="run a horovodrun elastic job on simulated local hosts")
    p.add_argument("job", help="job module under jobs/ (digits, charlm)")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--slots", type=int, default=1)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--commit-every", default="10", help="steps, or 'auto' (Young/Daly)")
    p.add_argument("--kill", action="append", default=[], metavar="HOST@STEP",
                   help="SIGKILL the workers of HOST (name or 1-based number) at STEP")
    p.add_argument("--add", action="append", default=[], metavar="HOST@STEP",
                   help="add a host at STEP (HOST may be empty: the next free one)")
    p.add_argument("--remove", action="append", default=[], metavar="HOST@STEP")
    p.add_argument("--slow", action="append", default=[], metavar="HOST:FACTOR",
                   help="stretch HOST's compute time by FACTOR")
    p.add_argument("--pause", action="append", default=[], metavar="HOST@STEP:SECONDS",
                   help="stall HOST's workers for SECONDS at STEP (alive, not dead)")
    p.add_argument("--run-dir", default="runs/local")
    p.add_argument("--report", default="", metavar="FILE")
    p.add_argument("--gloo-timeout", type=int, default=30, help="seconds (Horovod's default 30)")
    p.add_argument("--stock-recovery", action="store_true",
                   help="turn off fast failure detection (stock Horovod behaviour)")
    p.add_argument("--cold-workers", action="store_true",
                   help="start each worker as a fresh Python process (no warm agents)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--module", default="", help=argparse.SUPPRESS)   # benchmarks' stock loop
    p.set_defaults(job_args=[])   # whatever follows `--` goes to the job


def build_local_plan(args):
    from elastic.launch.local import LocalPlan, parse_at, resolve_host, PlanError
    kills = [parse_at(v, "--kill") for v in args.kill]
    adds, next_new = [], args.hosts
    for value in args.add:
        host, step = parse_at(value, "--add")
        adds.append((resolve_host(host, args.hosts, next_new), step))
        next_new += 1
    slow = {}
    for value in args.slow:
        host, sep, factor = value.rpartition(":")
        try:
            slow[resolve_host(host, args.hosts, 0)] = float(factor)
        except ValueError:
            raise PlanError(f"--slow {value!r} must look like HOST:FACTOR") from None
    pauses = []
    for value in args.pause:
        head, sep, seconds = value.rpartition(":")
        host, step = parse_at(head, "--pause")
        try:
            pauses.append((resolve_host(host, args.hosts, 0), step, float(seconds)))
        except ValueError:
            raise PlanError(f"--pause {value!r} must look like HOST@STEP:SECONDS") from None
    return LocalPlan(job=args.job, hosts=args.hosts, slots=args.slots, steps=args.steps,
                     commit_every=args.commit_every,
                     kill=[(resolve_host(h, args.hosts, 0), s) for h, s in kills], add=adds,
                     remove=[(resolve_host(h, args.hosts, 0), s)
                             for h, s in (parse_at(v, "--remove") for v in args.remove)],
                     slow=slow, pause=pauses, run_dir=args.run_dir, report=args.report,
                     gloo_timeout=args.gloo_timeout, fast_recovery=not args.stock_recovery,
                     timeout=args.timeout, job_args=args.job_args,
                     module=args.module, warm_agents=not args.cold_workers)


def cmd_local(args) -> int:
    from elastic.launch.local import run_local
    report = run_local(build_local_plan(args))
    summary = {k: report[k] for k in ("exit_code", "final_step", "final_world_size", "metrics")}
    print(json.dumps(summary, indent=1))
    for change in report["changes"]:
        print(f"{change['kind']} of {change['host']} at step {change['step']}: "
              f"first step at new size after {change['first_step_done_s']} s, "
              f"steps redone {change['steps_redone']}")
    return report["exit_code"]


def cmd_demo(args) -> int:
    """The dashboard plus a live elastic run on simulated hosts that loses a worker and
    gains a host while it trains; keeps serving until interrupted."""
    import os
    import secrets
    import subprocess
    import time
    import urllib.request
    from elastic.launch.local import run_local
    token = secrets.token_hex(16)
    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen([sys.executable, "-m", "webui.serve", "--db", args.db,
                               "--port", str(args.port), "--token", token])
    try:
        for _ in range(100):   # wait until it answers
            try:
                urllib.request.urlopen(url + "/api/v1/runs", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        print(f"\n  Dashboard: {url}   (open it now: the run appears live)\n", flush=True)
        os.environ["REGATTA_INGEST_TOKEN"] = token
        plan = build_local_plan(argparse.Namespace(
            job="digits", hosts=3, slots=1, steps=args.steps, commit_every=20,
            kill=[f"2@{args.steps * 3 // 10}"], add=[f"@{args.steps * 6 // 10}"], remove=[],
            slow=["1:1.4"], pause=[], run_dir="runs/demo", report="runs/demo/report.json",
            gloo_timeout=30, stock_recovery=False, cold_workers=False, timeout=1800.0,
            module="", job_args=["--ingest", url, "--set", "model.hidden=512"]))
        report = run_local(plan)
        for change in report["changes"]:
            print(f"  {change['kind']} of {change['host']} at step {change['step']}: training "
                  f"again {change['first_step_done_s']:.2f} s later, {change['steps_redone']} steps redone")
        print(f"\n  Finished. The dashboard keeps serving at {url} until Ctrl-C.", flush=True)
        server.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.terminate()
        server.wait(10)
    return 0


def cmd_supervise(args) -> int:
    from elastic.pipeline.supervisor import from_args, supervise
    report = supervise(from_args(args))
    for attempt in report["attempts"]:
        print(f"attempt: pp={attempt['pp']} dp={attempt['dp']} exit={attempt['exit_code']} "
              f"resumed from step {attempt['resumed_from']}")
    return 0 if report["exit_code"] == 0 else 1


def cmd_check_hosts(args) -> int:
    from elastic.launch.hosts import parse_hostfile, run_discovery
    if args.hostfile:
        with open(args.hostfile) as handle:
            hosts = parse_hostfile(handle.read(), args.hostfile)
    else:
        hosts = run_discovery(args.discovery)
    for host in hosts:
        print(f"{host.name}\t{host.slots} slots")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="regatta", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _local_parser(sub)
    check = sub.add_parser("check-hosts", help="validate a hostfile or a discovery script")
    group = check.add_mutually_exclusive_group(required=True)
    group.add_argument("--hostfile")
    group.add_argument("--discovery", metavar="COMMAND")
    from elastic.pipeline.supervisor import add_arguments as add_supervise_arguments
    add_supervise_arguments(sub.add_parser(
        "supervise", help="run an mpirun pipeline job, relaunching it from its checkpoint "
                          "on the surviving slots when a rank dies"))
    from elastic.pipeline.planner import add_parser as add_plan_parser, main as cmd_plan
    add_plan_parser(sub)
    from webui.serve import add_parser as add_ui_parser, main as cmd_ui
    add_ui_parser(sub)
    demo = sub.add_parser("demo", help="dashboard + a live elastic run with a failure and an addition")
    demo.add_argument("--db", default="runs/regatta.db")
    demo.add_argument("--port", type=int, default=8050)
    demo.add_argument("--steps", type=int, default=3000)
    argv = list(sys.argv[1:] if argv is None else argv)
    passed = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:len(argv) - len(passed) - (1 if "--" in argv else 0)])
    if passed:
        args.job_args = passed
    from elastic.config import ConfigError
    from elastic.launch.hosts import HostsError
    from elastic.launch.local import PlanError
    handlers = {"local": cmd_local, "check-hosts": cmd_check_hosts, "ui": cmd_ui, "demo": cmd_demo,
                "supervise": cmd_supervise, "plan": cmd_plan}
    try:
        return handlers[args.command](args)
    except (ConfigError, HostsError, PlanError, OSError) as err:
        print(f"regatta {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
