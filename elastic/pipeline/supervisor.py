"""Keep an mpirun pipeline job going through rank failures.

    python -m elastic.pipeline.supervisor charlm --hostfile hostfiles/pipeline.txt --pp 2 \
        --run-dir runs/pipeline -- --steps 400 --microbatches 8 --commit-every 10

A dead rank ends a whole MPI job (mpirun tears the rest down). The supervisor then drops
what failed (the slot of a rank killed by a signal; the whole host when mpirun lost its
daemon or a probe launch there fails), re-plans the grid on what is left (same number of
stages while enough slots remain, fewer otherwise; as many replicas as fit) and relaunches.
The job resumes from its last durable checkpoint, which loads under any partition
(checkpoint.py). A rank that exits with an error (not a signal) is retried on the same
plan; a configuration error (exit status 2) is not retried.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from elastic.config import ConfigError
from elastic.runtime.events import EventLog
from elastic.runtime.runs import run_name
from elastic.launch.stopping import Stopping, stop_tree
from elastic.launch.hosts import Host, parse_hostfile
from elastic.launch.target import Target

from .checkpoint import read_manifest

KILLED = re.compile(r"process rank (\d+) with PID \d+ on node (\S+) exited on signal (\d+)")
LOST = re.compile(r"Remote daemon: \S+ on node (\S+)")
FORWARD_ENV = ("OMP_NUM_THREADS", "PYTHONPATH", "REGATTA_PROCS_PER_MACHINE", "REGATTA_FAULTS",
               "REGATTA_RUN_ID")


@dataclass
class SupervisorConfig:
    job: str                          # a job under jobs/, a module or a script path
    hostfile: str
    pp: int = 2
    microbatches: int = 0             # 0: the job's config decides
    run_dir: str = "runs/pipeline"
    max_restarts: int = 3
    timeout: float = 3600.0           # seconds for the whole supervised run
    probe: bool = True                # check every host with a one-process launch before a relaunch
    mpirun: str = "mpirun"
    mpirun_args: list = field(default_factory=list)
    job_args: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.pp < 1:
            raise ConfigError(f"--pp must be >= 1, got {self.pp}")
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        Target.parse(self.job)    # fails now, naming it, if there is nothing to launch
        if not Path(self.hostfile).exists():
            raise ConfigError(f"--hostfile {self.hostfile} does not exist")


def replan(hosts: list[Host], pp: int) -> tuple[int, int]:
    """(pp, dp) for the slots left: keep the stage count if it fits, else one stage per slot."""
    slots = sum(h.slots for h in hosts)
    if slots == 0:
        raise RuntimeError("no slots left to run on")
    pp = min(pp, slots)
    return pp, slots // pp


def rank_hosts(hosts: list[Host], np_: int) -> list[str]:
    """Host of every rank under ``--map-by slot``: each host's slots filled in order."""
    names = [h.name for h in hosts for _ in range(h.slots)]
    return names[:np_]


def drop_failed(hosts: list[Host], output: str, placed: list[str]) -> tuple[list[Host], list[dict]]:
    """Hosts minus what the mpirun output says failed: a signalled rank's slot, a lost
    daemon's whole host. Returns (hosts left, what was dropped)."""
    slots = {h.name: h.slots for h in hosts}
    dropped = []
    for rank, node, signum in KILLED.findall(output):
        host = placed[int(rank)] if int(rank) < len(placed) else node
        if slots.get(host, 0) > 0:
            slots[host] -= 1
            dropped.append({"rank": int(rank), "host": host, "signal": int(signum), "lost": "slot"})
    for node in LOST.findall(output):
        if slots.pop(node, None) is not None:
            dropped.append({"host": node, "lost": "host"})
    return [Host(name, n) for name, n in slots.items() if n > 0], dropped


def probe(cfg: SupervisorConfig, hosts: list[Host]) -> list[Host]:
    """Hosts where a one-process launch still works (a dead machine fails or hangs)."""
    alive = []
    for host in hosts:
        try:
            done = subprocess.run([cfg.mpirun, *_root(), "-np", "1", "--host", host.name, "true"],
                                  capture_output=True, timeout=30)
            if done.returncode == 0:
                alive.append(host)
        except subprocess.TimeoutExpired:
            pass
    return alive


def _root() -> list[str]:
    return ["--allow-run-as-root"] if os.geteuid() == 0 else []


def command(cfg: SupervisorConfig, hostfile: Path, pp: int, dp: int, resume: bool = False) -> list[str]:
    """The mpirun command of one attempt; every attempt joins the run REGATTA_RUN_ID names,
    and the ones after a checkpoint resume from it."""
    forward = [arg for name in FORWARD_ENV if name in os.environ for arg in ("-x", name)]
    # After the user's job arguments, so that the re-plan wins over them.
    job = ["--pp", str(pp), "--dp", str(dp), "--run-dir", cfg.run_dir,
           "--set", "pipeline.engine=pipeline"] + (["--resume", "auto"] if resume else [])
    if pp != cfg.pp:
        job += ["--boundaries", ""]     # hand-set boundaries were for the old stage count
    if cfg.microbatches:
        job += ["--microbatches", str(cfg.microbatches)]
    return [cfg.mpirun, *_root(), "--hostfile", str(hostfile), "-np", str(pp * dp),
            "--map-by", "slot", "--bind-to", "none", *forward, *cfg.mpirun_args,
            sys.executable, *Target.parse(cfg.job).python_args(), *cfg.job_args, *job]


def attempt(cfg: SupervisorConfig, hosts: list[Host], number: int, deadline: float) -> dict:
    folder = Path(cfg.run_dir) / "supervisor"
    folder.mkdir(parents=True, exist_ok=True)
    pp, dp = replan(hosts, cfg.pp)
    hostfile = folder / f"hostfile-{number}.txt"
    hostfile.write_text("".join(f"{h.name} slots={h.slots}\n" for h in hosts))
    log_path = folder / f"attempt-{number}.log"
    manifest = read_manifest(_checkpoint_dir(cfg))
    started = time.monotonic()
    with open(log_path, "w") as log, Stopping() as stopping:
        # Its own process group, so that stopping it reaches every rank mpirun started.
        proc = subprocess.Popen(command(cfg, hostfile, pp, dp, resume=manifest is not None),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        stopping.forward_to(proc, group=True)   # SIGTERM, SIGINT, SIGHUP; a second one forces
        try:
            code = _wait(proc, deadline, stopping)
        finally:
            if proc.poll() is None:
                stop_tree(proc)
        if stopping.requested:
            raise SystemExit(128 + stopping.requested)
    return {"attempt": number, "hosts": [[h.name, h.slots] for h in hosts], "pp": pp, "dp": dp,
            "np": pp * dp, "exit_code": code, "resumed_from": manifest["step"] if manifest else 0,
            "duration_s": round(time.monotonic() - started, 3), "log": str(log_path)}


def _wait(proc: subprocess.Popen, deadline: float, stopping: Stopping) -> int | None:
    """mpirun's exit code; None when the deadline passed or a signal asked to stop."""
    while not stopping.requested and time.monotonic() < deadline:
        try:
            return proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            continue
    return None


def _checkpoint_dir(cfg: SupervisorConfig) -> Path:
    """Where the job keeps checkpoints: --checkpoint-dir if passed through, else the
    TrainConfig default under the run dir."""
    args = cfg.job_args
    if "--checkpoint-dir" in args:
        return Path(args[args.index("--checkpoint-dir") + 1])
    return Path(cfg.run_dir) / "checkpoint"


def supervise(cfg: SupervisorConfig) -> dict:
    """Run the job to completion through up to ``max_restarts`` relaunches; return a
    report (also written to <run_dir>/supervisor/report.json)."""
    hosts = parse_hostfile(Path(cfg.hostfile).read_text(), cfg.hostfile)
    # One run across every relaunch (the workers read it from the environment mpirun forwards).
    os.environ.setdefault("REGATTA_RUN_ID", f"{run_name(cfg.job)}-{secrets.token_hex(5)}")
    events = EventLog(cfg.run_dir, "supervisor", 0)
    deadline = time.monotonic() + cfg.timeout
    attempts = []
    while True:
        events.record("launch", None, hosts=[[h.name, h.slots] for h in hosts], attempt=len(attempts))
        result = attempt(cfg, hosts, len(attempts), deadline)
        attempts.append(result)
        code = result["exit_code"]
        if code in (0, 2, None) or len(attempts) > cfg.max_restarts:
            break
        output = Path(result["log"]).read_text(errors="replace")
        hosts, dropped = drop_failed(hosts, output, rank_hosts(hosts, result["np"]))
        result["dropped"] = dropped
        if cfg.probe:
            hosts = probe(cfg, hosts)
        events.record("failure", None, exit_code=code, dropped=dropped,
                      hosts_left=[[h.name, h.slots] for h in hosts])
        if not hosts:
            break
    report = {"exit_code": attempts[-1]["exit_code"], "attempts": attempts,
              "restarts": len(attempts) - 1, "result": _result(cfg)}
    (Path(cfg.run_dir) / "supervisor" / "report.json").write_text(json.dumps(report, indent=1))
    events.record("supervisor_done", report["result"].get("step") if report["result"] else None,
                  exit_code=report["exit_code"], restarts=report["restarts"])
    events.close()
    return report


def _result(cfg: SupervisorConfig) -> dict | None:
    try:
        return json.loads((Path(cfg.run_dir) / "result.json").read_text())
    except FileNotFoundError:
        return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m elastic.pipeline.supervisor`` (for ``regatta``'s parser)."""
    parser.add_argument("job", help="a job under jobs/ (e.g. charlm), a module or a script path")
    parser.add_argument("--hostfile", required=True, help="OpenMPI hostfile: HOST slots=N")
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages")
    parser.add_argument("--microbatches", type=int, default=0)
    parser.add_argument("--run-dir", default="runs/pipeline")
    parser.add_argument("--max-restarts", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--no-probe", action="store_true", help="do not probe hosts before a relaunch")
    parser.add_argument("--mpirun-arg", action="append", default=[], metavar="ARG",
                        help="extra mpirun argument (repeatable)")
    parser.set_defaults(job_args=[])   # what follows `--` goes to the job (split by the caller)


def from_args(args: argparse.Namespace) -> SupervisorConfig:
    return SupervisorConfig(job=args.job, hostfile=args.hostfile, pp=args.pp,
                            microbatches=args.microbatches, run_dir=args.run_dir,
                            max_restarts=args.max_restarts, timeout=args.timeout,
                            probe=not args.no_probe, mpirun_args=args.mpirun_arg,
                            job_args=list(args.job_args))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m elastic.pipeline.supervisor",
                                     description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    args.job_args = argv[cut + 1:]
    try:
        report = supervise(from_args(args))
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    print(json.dumps({k: report[k] for k in ("exit_code", "restarts")} |
                     {"attempts": [{k: a[k] for k in ("pp", "dp", "exit_code", "resumed_from")}
                                   for a in report["attempts"]]}, indent=1))
    return 0 if report["exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
