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


def build_local_plan(args):
    from elastic.launch.plan import plan_from_args
    return plan_from_args(args)


def cmd_local(args) -> int:
    from elastic.launch.local import run_local
    report = run_local(build_local_plan(args))
    summary = {k: report[k] for k in ("exit_code", "final_step", "final_world_size", "metrics")}
    print(json.dumps(summary, indent=1))
    for change in report["changes"]:
        print(f"{change['kind']} of {change['host']} at step {change['step']}: "
              f"first step at new size after {change['first_step_done_s']} s, "
              f"steps redone {change['steps_redone']}, went on from {change.get('recovered_from') or '-'}")
    return report["exit_code"]


def cmd_demo(args) -> int:
    """The dashboard plus a live elastic run on simulated hosts that loses a worker and
    gains a host while it trains; keeps serving until interrupted. SIGTERM, SIGINT or
    SIGHUP stop the run and the dashboard; a second signal forces it."""
    import os
    import secrets
    import subprocess
    import time
    import urllib.request
    from elastic.launch.local import run_local
    from elastic.launch.plan import parse_plan
    from elastic.launch.stopping import Stopping
    # The server reads the token from the environment, not from `ps`.
    os.environ["REGATTA_INGEST_TOKEN"] = secrets.token_hex(16)
    url = f"http://127.0.0.1:{args.port}"
    with Stopping() as stopping:
        server = subprocess.Popen([sys.executable, "-m", "webui.serve", "--db", args.db,
                                   "--port", str(args.port)])
        stopping.forward_to(server)
        try:
            for _ in range(100):   # wait until it answers
                try:
                    urllib.request.urlopen(url + "/api/v1/runs", timeout=1)
                    break
                except OSError:
                    time.sleep(0.2)
            print(f"\n  Dashboard: {url}   (open it now: the run appears live)\n", flush=True)
            # The workers write the store the dashboard reads: hosts in network
            # namespaces cannot reach the dashboard's 127.0.0.1.
            plan = parse_plan(["digits", "--hosts", "3", "--steps", str(args.steps),
                               "--commit-every", "20", "--sigkill", f"2@{args.steps * 3 // 10}",
                               "--add", f"@{args.steps * 6 // 10}", "--slow", "1:1.4",
                               "--run-dir", "runs/demo", "--report", "runs/demo/report.json",
                               "--db", args.db, "--timeout", "1800", "--",
                               "--set", "model.hidden=512"])
            report = run_local(plan)
            if not stopping.requested:
                for change in report["changes"]:
                    print(f"  {change['kind']} of {change['host']} at step {change['step']}: "
                          f"training again {change['first_step_done_s']:.2f} s later, "
                          f"{change['steps_redone']} steps redone")
                print(f"\n  Finished. The dashboard keeps serving at {url} until Ctrl-C.", flush=True)
            while server.poll() is None and not stopping.requested:
                time.sleep(0.2)
        except KeyboardInterrupt:
            pass
        finally:
            server.terminate()
            try:
                server.wait(5)
            except subprocess.TimeoutExpired:
                server.kill()
    return 128 + stopping.requested if stopping.requested else 0


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


def _local_parser(sub) -> None:
    from elastic.launch.plan import add_arguments
    add_arguments(sub.add_parser("local", help="run a horovodrun elastic job on simulated local hosts"))


def _check_hosts_parser(sub) -> None:
    check = sub.add_parser("check-hosts", help="validate a hostfile or a discovery script")
    group = check.add_mutually_exclusive_group(required=True)
    group.add_argument("--hostfile")
    group.add_argument("--discovery", metavar="COMMAND")


def _supervise_parser(sub) -> None:
    from elastic.pipeline.supervisor import add_arguments
    add_arguments(sub.add_parser(
        "supervise", help="run an mpirun pipeline job, relaunching it from its checkpoint "
                          "on the surviving slots when a rank dies"))


def _plan_parser(sub) -> None:
    from elastic.pipeline.planner import add_parser
    add_parser(sub)


def _ui_parser(sub) -> None:
    from webui.serve import add_parser
    add_parser(sub)


def _replay_parser(sub) -> None:
    from monitor.replay import add_parser
    add_parser(sub)


def _demo_parser(sub) -> None:
    demo = sub.add_parser("demo", help="dashboard + a live elastic run with a failure and an addition")
    demo.add_argument("--db", default="runs/regatta.db")
    demo.add_argument("--port", type=int, default=8050)
    demo.add_argument("--steps", type=int, default=3000)


def cmd_plan(args) -> int:
    from elastic.pipeline.planner import main as plan
    return plan(args)


def cmd_ui(args) -> int:
    from webui.serve import main as serve
    return serve(args)


def cmd_replay(args) -> int:
    from monitor.replay import main as replay
    return replay(args)


# Each command's options are defined by the module that owns it. Only the chosen
# command's module is imported: `regatta local` must not pay for torch and Flask,
# which the pipeline and dashboard parsers' modules import (2-3 s on two cores, on
# every launch). `regatta --help` and a mistyped command import them all.
COMMANDS = {"local": (_local_parser, cmd_local),
            "check-hosts": (_check_hosts_parser, cmd_check_hosts),
            "supervise": (_supervise_parser, cmd_supervise),
            "plan": (_plan_parser, cmd_plan),
            "ui": (_ui_parser, cmd_ui),
            "replay": (_replay_parser, cmd_replay),
            "demo": (_demo_parser, cmd_demo)}


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command and its arguments (what follows ``--`` goes to the job), or exit 2."""
    parser = argparse.ArgumentParser(prog="regatta", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = [argv[0]] if argv and argv[0] in COMMANDS else list(COMMANDS)
    for name in chosen:
        COMMANDS[name][0](sub)
    passed = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:len(argv) - len(passed) - (1 if "--" in argv else 0)])
    if passed:
        args.job_args = passed
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    from elastic.config import ConfigError
    from elastic.launch.hosts import HostsError
    from elastic.launch.plan import PlanError
    from elastic.launch.target import TargetError
    try:
        return COMMANDS[args.command][1](args)
    except (ConfigError, HostsError, PlanError, TargetError, OSError) as err:
        print(f"regatta {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
