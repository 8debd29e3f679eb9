"""Every environment variable that changes a worker's behaviour, read once at start.

``Env.read()`` is called once per process by the runtime and the typed result is passed
down; nothing below it reads ``os.environ``. The README lists each variable.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import socket
from dataclasses import dataclass, field

from elastic.failures.faults import FaultPlan
from elastic.failures.restart import HANDOFF_ENV

from .memory import user_tuned

# Where launchers put a process's index among the ranks of its machine.
LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "HOROVOD_LOCAL_RANK", "LOCAL_RANK",
                   "MPI_LOCALRANKID", "SLURM_LOCALID")
MPIRUN_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")


class EnvError(ValueError):
    """An environment variable holds a value the runtime cannot use; the message names it."""


@dataclass(frozen=True)
class LaunchedWorld:
    """The fixed world a launcher started, before any library is initialised."""
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1


@dataclass(frozen=True)
class Env:
    launcher: str = "single"        # horovodrun | mpirun | single
    elastic: bool = False           # HOROVOD_ELASTIC=1: horovodrun with a discovery script
    host: str = ""                  # HOROVOD_HOSTNAME, else this machine's name
    launched: LaunchedWorld = field(default_factory=LaunchedWorld)
    procs_per_machine: int = 0      # REGATTA_PROCS_PER_MACHINE (0: the local size)
    threads: int = 0                # OMP_NUM_THREADS: torch threads per rank (0: share the cores)
    fast_recovery: bool = True      # REGATTA_FAST_RECOVERY (0: stock Horovod detection)
    audit: bool = False             # REGATTA_AUDIT=1: parameter hashes on commit/restore/sync
    run_id: str = ""                # REGATTA_RUN_ID: join this run (set by launchers)
    ingest_token: str | None = None  # REGATTA_INGEST_TOKEN: bearer token for --ingest
    device: str = ""                # REGATTA_DEVICE: cpu | cuda | cuda:N | auto ("" = default)
    faults: FaultPlan = field(default_factory=FaultPlan)   # REGATTA_FAULTS (JSON)
    slow_ranks: tuple = ()          # REGATTA_SLOW_RANKS=RANK:FACTOR,...: ((rank, factor), ...)
    mpi_cuda_aware: bool | None = None   # REGATTA_MPI_CUDA_AWARE=0|1 (None: ask MPI)
    mpi_progress: bool | None = None     # REGATTA_MPI_PROGRESS=0|1 (None: where a core is free)
    pipe_init: str = ""             # REGATTA_PIPE_INIT: torch.distributed init method
    launch_key: str = ""            # what every process of one launch shares (run ids)
    replacing: bool = False         # REGATTA_HANDOFF set: this worker takes a failed one's place
    horovod_cycle_time: float | None = None   # HOROVOD_CYCLE_TIME (ms), when set
    horovod_autotune: bool = False  # HOROVOD_AUTOTUNE > 0, Horovod's reading (a set cycle pins it)
    horovod_wake: bool | None = None   # HOROVOD_WAKE_ON_ENQUEUE=0|1 (None: on where Horovod can)
    horovod_controller: str = ""    # HOROVOD_CONTROLLER (horovodrun's Gloo sets "gloo"; "": MPI)
    horovod_fusion_threshold: int | None = None   # HOROVOD_FUSION_THRESHOLD (bytes), when set
    gloo_iface: str = ""            # HOROVOD_GLOO_IFACE: horovodrun's --network-interface
    gloo_timeout_s: float = 30.0    # HOROVOD_GLOO_TIMEOUT_SECONDS: horovodrun's, Horovod's 30 s
    keep_freed_memory: bool = True  # REGATTA_KEEP_FREED_MEMORY=0, or glibc's MALLOC_* set: not
    args: tuple = ()                # REGATTA_ARGS: Regatta's flags for a script whose command
                                    # line is its own (regatta.horovod), shell-quoted

    @classmethod
    def read(cls, environ: dict | None = None) -> "Env":
        env = os.environ if environ is None else environ
        launcher = ("horovodrun" if "HOROVOD_RANK" in env or env.get("HOROVOD_ELASTIC") == "1"
                    else "mpirun" if any(k in env for k in MPIRUN_VARS) else "single")
        return cls(launcher=launcher, elastic=env.get("HOROVOD_ELASTIC") == "1",
                   host=env.get("HOROVOD_HOSTNAME") or socket.gethostname(),
                   launched=_launched(env), procs_per_machine=_int(env, "REGATTA_PROCS_PER_MACHINE", 0),
                   threads=_threads(env),
                   fast_recovery=env.get("REGATTA_FAST_RECOVERY", "1") == "1",
                   audit=env.get("REGATTA_AUDIT") == "1", run_id=env.get("REGATTA_RUN_ID", ""),
                   ingest_token=env.get("REGATTA_INGEST_TOKEN") or None,
                   device=env.get("REGATTA_DEVICE", "").strip().lower(),
                   faults=_faults(env), slow_ranks=_slow_ranks(env),
                   mpi_cuda_aware=_flag(env, "REGATTA_MPI_CUDA_AWARE"),
                   mpi_progress=_flag(env, "REGATTA_MPI_PROGRESS"),
                   pipe_init=env.get("REGATTA_PIPE_INIT", ""), launch_key=_launch_key(env),
                   replacing=bool(env.get(HANDOFF_ENV)),
                   horovod_cycle_time=_milliseconds(env, "HOROVOD_CYCLE_TIME"),
                   horovod_autotune=_strtol(env.get("HOROVOD_AUTOTUNE", "")) > 0,
                   horovod_wake=_flag(env, "HOROVOD_WAKE_ON_ENQUEUE"),
                   horovod_controller=env.get("HOROVOD_CONTROLLER", "").strip().lower(),
                   horovod_fusion_threshold=_bytes(env, "HOROVOD_FUSION_THRESHOLD"),
                   gloo_iface=env.get("HOROVOD_GLOO_IFACE", "").strip(),
                   gloo_timeout_s=_seconds(env, "HOROVOD_GLOO_TIMEOUT_SECONDS", cls.gloo_timeout_s),
                   keep_freed_memory=_flag(env, "REGATTA_KEEP_FREED_MEMORY") is not False
                   and not user_tuned(env), args=_args(env))

    def slow_factor(self, rank: int, host: str) -> float:
        """The slowdown injected into this rank: by rank, else the fault plan's by host."""
        return dict(self.slow_ranks).get(rank, float(self.faults.slow.get(host, 1.0)))


def _int(env, name: str, default: int) -> int:
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise EnvError(f"{name} must be an integer, got {text!r}") from None


def _threads(env) -> int:
    """OpenMP's first level of ``OMP_NUM_THREADS`` (it may list one per nesting level)."""
    text = env.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if not text:
        return 0
    if not text.isdigit() or int(text) < 1:
        raise EnvError(f"OMP_NUM_THREADS must be a positive integer (or a comma-separated "
                       f"list of them), got {env['OMP_NUM_THREADS']!r}")
    return int(text)


def _milliseconds(env, name: str) -> float | None:
    return _number(env, name, "milliseconds >= 0", lambda value: value >= 0)


def _seconds(env, name: str, default: float) -> float:
    value = _number(env, name, "seconds > 0", lambda value: value > 0)
    return default if value is None else value


def _number(env, name: str, what: str, valid) -> float | None:
    """``name``'s value, None when unset; an ``EnvError`` naming ``what`` unless ``valid``."""
    text = env.get(name, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not valid(value):
        raise EnvError(f"{name} must be a number of {what}, got {text!r}")
    return value


def _bytes(env, name: str) -> int | None:
    text = env.get(name, "").strip()
    if not text:
        return None
    if not text.isdigit():
        raise EnvError(f"{name} must be a whole number of bytes >= 0, got {text!r}")
    return int(text)


def _strtol(text: str) -> int:
    """The integer C's ``strtol`` reads at the start of ``text`` (0 where none), as Horovod
    reads its switches: ``HOROVOD_AUTOTUNE=true`` is off there."""
    found = re.match(r"\s*([+-]?\d+)", text)
    return int(found.group(1)) if found else 0


def _flag(env, name: str) -> bool | None:
    text = env.get(name, "").strip().lower()
    return None if not text else text in ("1", "true", "yes")


def _launched(env) -> LaunchedWorld:
    for prefix in ("OMPI_COMM_WORLD_", "HOROVOD_"):
        if prefix + "SIZE" in env:
            return LaunchedWorld(rank=_int(env, prefix + "RANK", 0), size=_int(env, prefix + "SIZE", 1),
                                 local_rank=_int(env, prefix + "LOCAL_RANK", 0),
                                 local_size=_int(env, prefix + "LOCAL_SIZE", 1))
    local = next((int(env[n]) for n in LOCAL_RANK_VARS if env.get(n, "").strip().isdigit()), 0)
    return LaunchedWorld(local_rank=local, local_size=local + 1)


def _faults(env) -> FaultPlan:
    text = env.get("REGATTA_FAULTS", "")
    try:
        return FaultPlan(**json.loads(text)) if text else FaultPlan()
    except (ValueError, TypeError) as err:
        raise EnvError(f"REGATTA_FAULTS is not a fault plan: {err}") from None


def _slow_ranks(env) -> tuple:
    pairs = []
    for item in filter(None, env.get("REGATTA_SLOW_RANKS", "").split(",")):
        rank, _, factor = item.partition(":")
        try:
            pairs.append((int(rank), float(factor)))
        except ValueError:
            raise EnvError(f"REGATTA_SLOW_RANKS item {item!r} must look like RANK:FACTOR") from None
    return tuple(pairs)


def _args(env) -> tuple:
    try:
        return tuple(shlex.split(env.get("REGATTA_ARGS", "")))
    except ValueError as err:
        raise EnvError(f"REGATTA_ARGS is not a shell-quoted list of flags: {err}") from None


def _launch_key(env) -> str:
    """A value every process of one launch sees and the next launch does not: horovodrun's
    rendezvous address, mpirun's job id; empty for a single process."""
    if env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"):
        return f"{env['HOROVOD_GLOO_RENDEZVOUS_ADDR']}:{env.get('HOROVOD_GLOO_RENDEZVOUS_PORT', '')}"
    return env.get("PMIX_NAMESPACE") or env.get("OMPI_MCA_ess_base_jobid", "")
