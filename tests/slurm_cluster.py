"""A real Slurm cluster for the tests: munged, slurmctld and one slurmd per simulated node,
each node in its own network and UTS namespace (elastic/launch/netns.py: its own host
name, sim-hostN, which the private /etc/hosts maps to its address), and the scenarios
tests/test_slurm.py runs against it with Slurm's own commands (sbatch, scontrol, scancel).

    unshare --net --pid --mount --fork --mount-proc --kill-child \
        env REGATTA_PRIVATE_NETWORK=1 python tests/slurm_cluster.py SCENARIO WORKDIR

Run as root (slurmctld and slurmd drop supplementary groups, which a user namespace
forbids); everything lives in WORKDIR and in namespaces the kernel removes with their
last process. A scenario writes what it saw to WORKDIR/observed.json.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from elastic.launch.netns import Network  # noqa: E402

NODES = 3
START_S = 30.0
SBATCH = ROOT / "examples" / "slurm" / "elastic.sbatch"
FIXED = ROOT / "examples" / "slurm" / "fixed.sbatch"


def slurm_conf(folder: Path, nodes: int) -> str:
    last = nodes - 1
    return f"""ClusterName=regatta-test
SlurmctldHost={socket.gethostname()}(10.77.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={folder}/munge.sock
CredType=cred/munge
StateSaveLocation={folder}/ctld
SlurmdSpoolDir={folder}/slurmd-%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
KillWait=30
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
NodeName=sim-host[0-{last}] NodeAddr=10.77.0.1[0-{last}] CPUs=1 RealMemory=1000 State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def command(*argv: str, check: bool = True) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()}")
    return done.stdout


class Cluster:
    """munged + slurmctld in the hub namespace, a slurmd in each node's."""

    def __init__(self, folder: Path, nodes: int = NODES):
        self.folder, self.nodes = folder, nodes
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "Cluster":
        f = self.folder
        os.environ["PATH"] = f"/usr/sbin:{os.environ.get('PATH', '')}"   # the daemons
        (f / "ctld").mkdir(parents=True, exist_ok=True)
        (f / "slurm.conf").write_text(slurm_conf(f, self.nodes))
        os.environ["SLURM_CONF"] = str(f / "slurm.conf")
        key = f / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.network = Network(str(f)).__enter__()
        self.hosts = [self.network.add_host(f"node{i}") for i in range(self.nodes)]
        command("munged", "--force", f"--key-file={key}", f"--socket={f}/munge.sock",
                f"--pid-file={f}/munged.pid", f"--log-file={f}/munged.log", f"--seed-file={f}/munge.seed")
        self._start(["slurmctld", "-D", "-i"], "slurmctld")
        for host in self.hosts:
            self._start(host.command(["slurmd", "-D"]), f"slurmd-{host.hostname}")
        self.wait_idle()
        return self

    def _start(self, argv: list[str], name: str) -> None:
        log = open(self.folder / f"{name}.out", "w")
        self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))

    def wait_idle(self) -> None:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            states = command("sinfo", "--noheader", "--Node", "--format=%N %t", check=False).split()
            if states.count("idle") == self.nodes:
                return
            time.sleep(0.2)
        raise RuntimeError(f"the nodes did not come up: {states}")

    def __exit__(self, *exc) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.network.__exit__(*exc)


# -- what the scenarios look at ----------------------------------------------------------------
def progress(run_dir: Path) -> tuple[int, int]:
    try:
        step, size = (run_dir / "progress").read_text().split()
        return int(step), int(size)
    except (FileNotFoundError, ValueError):
        return 0, 0


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise RuntimeError(f"timed out after {timeout} s waiting for {what}")


def job_processes(job_id: str) -> list[int]:
    """Every process Slurm started for the job, on any node (SLURM_JOB_ID in its environment)."""
    mark = f"SLURM_JOB_ID={job_id}".encode()
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if mark in (proc / "environ").read_bytes().split(b"\0"):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def trainer_on(hostname: str, job_id: str) -> int | None:
    """The training process horovodrun started on a node."""
    for pid in job_processes(job_id):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"HOROVOD_HOSTNAME={hostname}".encode() in environ and b"jobs.digits" in cmdline \
                and not any(b"horovodrun" in part or b"elastic.launch.shim" in part for part in cmdline):
            return pid
    return None


def job_state(job_id: str) -> dict:
    text = command("scontrol", "show", "job", job_id, check=False)
    return dict(re.findall(r"(JobState|ExitCode)=(\S+)", text))


def submit(workdir: Path, name: str, steps: int, extra: list[str] = ()) -> str:
    env = {**os.environ, "REGATTA_ROOT": str(ROOT), "REGATTA_RUN_DIR": str(workdir / "run"),
           "REGATTA_DB": str(workdir / "m.db"), "REGATTA_IFACE": "rg0", "OMP_NUM_THREADS": "1",
           "REGATTA_PROCS_PER_MACHINE": str(NODES), "REGATTA_AUDIT": "1"}
    out = subprocess.run(["sbatch", "--parsable", "-N", str(NODES), f"--job-name={name}",
                          f"--output={workdir}/{name}-%j.out", str(SBATCH), "jobs.digits",
                          "--steps", str(steps), "--commit-every", "10", *extra],
                         capture_output=True, text=True, env=env, timeout=30, check=True)
    return out.stdout.strip().split(";")[0]


def finished(job_id: str) -> bool:
    return not command("squeue", "--noheader", "--jobs", job_id, check=False).strip()


# -- the scenarios ------------------------------------------------------------------------------
def drain_and_kill(workdir: Path) -> dict:
    """Trains to the end while one node is drained and another's worker is SIGKILLed."""
    run_dir = workdir / "run"
    job = submit(workdir, "regatta-drain", 360)
    wait_for(lambda: progress(run_dir)[0] >= 60, 120, "step 60")
    drained_at = time.time()
    command("scontrol", "update", "nodename=sim-host2", "state=drain", "reason=regatta-test")
    wait_for(lambda: progress(run_dir)[1] == 2, 60, "the world at 2 after the drain")
    step = progress(run_dir)[0]
    wait_for(lambda: progress(run_dir)[0] >= step + 40, 60, "40 steps at 2")
    victim = wait_for(lambda: trainer_on("sim-host1", job), 10, "the worker on sim-host1")
    parent = Path(f"/proc/{victim}/status").read_text().split("PPid:")[1].split()[0]
    started_by = Path(f"/proc/{parent}/cmdline").read_bytes().decode().split("\0")
    os.kill(victim, signal.SIGKILL)
    killed_at = time.time()
    wait_for(lambda: finished(job), 180, "the job's end")
    return {"job": job, "drained_at": drained_at, "killed_at": killed_at, "victim": victim,
            "started_by": started_by, "state": job_state(job)}


def scancel_and_resume(workdir: Path) -> dict:
    """scancel mid-run, then the same job submitted again goes on from its checkpoint."""
    run_dir = workdir / "run"
    job = submit(workdir, "regatta-cancel", 100000)
    wait_for(lambda: progress(run_dir)[0] >= 50, 120, "step 50")
    assert job_processes(job)
    cancelled_at = time.time()
    command("scancel", job)
    wait_for(lambda: not job_processes(job), 30, "every process of the cancelled job to end")
    gone_s = time.time() - cancelled_at
    wait_for(lambda: finished(job), 30, "the cancelled job to leave the queue")
    stopped_step = progress(run_dir)[0]
    status = sqlite3.connect(workdir / "m.db").execute("select status from run").fetchone()[0]
    again = submit(workdir, "regatta-cancel", stopped_step + 30)
    wait_for(lambda: finished(again), 180, "the resubmitted job's end")
    return {"job": job, "gone_s": gone_s, "stopped_progress": stopped_step, "again": again,
            "status_after_cancel": status,
            "state": job_state(again), "left": job_processes(job) + job_processes(again)}


def fixed_world(workdir: Path) -> dict:
    """examples/slurm/fixed.sbatch: one rank per task under srun, trained to the end."""
    env = {**os.environ, "REGATTA_ROOT": str(ROOT), "REGATTA_RUN_DIR": str(workdir / "run"),
           "REGATTA_DB": str(workdir / "m.db"), "OMP_NUM_THREADS": "1"}
    job = subprocess.run(["sbatch", "--parsable", "-N", "2", "--ntasks-per-node=1",
                          f"--output={workdir}/fixed-%j.out", str(FIXED), "jobs.digits", "--steps", "60"],
                         capture_output=True, text=True, env=env, timeout=30, check=True).stdout.strip()
    wait_for(lambda: finished(job), 180, "the fixed job's end")
    return {"job": job, "state": job_state(job)}


SCENARIOS = {"drain_and_kill": drain_and_kill, "scancel_and_resume": scancel_and_resume,
             "fixed_world": fixed_world}


def main() -> None:
    scenario, workdir = sys.argv[1], Path(sys.argv[2])
    observed: dict = {}
    try:
        with Cluster(workdir / "slurm"):
            observed = SCENARIOS[scenario](workdir)
    except Exception as err:  # noqa: BLE001 - reported to the test, which fails with it
        observed["error"] = f"{type(err).__name__}: {err}"
    (workdir / "observed.json").write_text(json.dumps(observed, indent=1))


if __name__ == "__main__":
    main()
