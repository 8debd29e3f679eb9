"""Pipeline schedules and transport, measured side by side in one mpirun launch.

    .venv/bin/python bench/bench_pipeline.py [--dim 512] [--batch 256] [--steps 10] [--repeats 3]

Starts ``mpirun -np 2`` on itself (2 stages, one rank each) and prints:

* measured bubble fraction (1 - busy/elapsed over back-to-back steps, mean of both
  stages) against the ideal (p-1)/(m+p-1) for p = 2 and m = 1, 2, 4, 8, under GPipe and
  1F1B, with each rank's CPU time per busy second (below 1: it was descheduled while
  computing, so the two stages' work did not overlap as it should). Beside it the bubble
  the same steps would have had with free messages (each forward's and backward's measured
  time replayed through the schedule): the gap to the measured one is what the transport
  costs, the gap to the ideal what unequal or varying compute times cost. The measured
  bubble is also split into the time spent waiting for messages and the rest (the
  executor's own work between actions, zeroing the gradients between steps). The model is
  a stack of equal Linear+Tanh layers cut in two equal halves (the last stage also
  computes the loss); the global batch stays fixed and is split into m microbatches.
* the same table for every case run again by a stage whose forwards and backwards take
  fixed times, the case's median times averaged over both stages (a trial run measures
  what each stage adds around the wait, the last stage's loss among it, and the waits are
  set so that the actions come out equal): the machine's compute jitter and the stages'
  imbalance are gone, messages keep their sizes, so its excess over the ideal is the
  engine's own cost (messages, the executor's work between actions, the step's start and
  end).
* peak autograd-saved activation bytes held on a stage, 1F1B / GPipe (ideal at stage 0:
  min(p, m) / m).
* the time to move a 16 MB float32 tensor to the other rank over the MPI transport (and the
  Gloo one) divided by the time of a 16 MB memory copy (``Tensor.copy_``), both measured
  in this run.

Each rank runs one thread; on a shared machine the numbers move with the load.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MICROBATCHES = (1, 2, 4, 8)
MB16 = 16 * 2 ** 20


def options(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=512, help="width of every Linear layer")
    parser.add_argument("--layers", type=int, default=8, help="Linear+Tanh layers (even)")
    parser.add_argument("--batch", type=int, default=256, help="samples per step (all microbatches)")
    parser.add_argument("--steps", type=int, default=10, help="measured steps per case (after 1 warm-up)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over all the cases (interleaved)")
    parser.add_argument("--progress-thread", choices=("auto", "on", "off"), default="auto",
                        help="the MPI transport's progress thread (auto: where a core is free)")
    parser.add_argument("--allocator", choices=("kept", "glibc"), default="kept",
                        help="kept: the ranks keep freed memory, as Regatta's runtime does "
                             "(elastic/runtime/memory.py); glibc: glibc's default")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# -- worker side (inside mpirun) ------------------------------------------------------------
def schedule_case(transport, grid, module, opts, schedule: str, m: int) -> dict:
    import torch
    from elastic.pipeline.executor import StageExecutor
    from elastic.pipeline.schedule import make_schedule
    executor = StageExecutor(module, grid, transport, loss_fn=lambda out, mb: out.pow(2).sum())
    actions = make_schedule(schedule, grid.stage, 2, m)
    size = opts.batch // m
    torch.manual_seed(0)
    # Inputs that need a gradient: stage 0 then computes its first layer's input gradient
    # as stage 1 does, and the two stages stay balanced as the ideal formula assumes.
    micro = [torch.randn(size, opts.dim, requires_grad=True) for _ in range(m)]
    run = lambda: executor.run(actions, inputs=micro if grid.is_first else None,  # noqa: E731
                               targets=micro if grid.is_last else None)
    run()                            # warm-up: allocators, and the one-time shape header
    transport.barrier()
    # Steps back to back, as in training: a stage's idle time at the end of one step (the
    # last stage waits for stage 0 to drain its backwards) shows up as waiting at the
    # start of the next, so busy / elapsed over many steps is each stage's true share.
    busy, waited, peak, started, cpu = 0.0, 0.0, 0, time.perf_counter(), time.process_time()
    compute = []
    for _ in range(opts.steps):
        module.zero_grad(set_to_none=True)
        stats = run()
        busy += stats.busy_time
        waited += stats.recv_wait + stats.send_wait
        peak = max(peak, stats.peak_activation_bytes)
        compute.append(stats.compute_times)
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    transport.barrier()
    # cpu / busy < 1: the rank was descheduled while computing (other load on the cores),
    # which stretches busy phases that should overlap and inflates the bubble.
    return {"bubble": 1 - busy / elapsed, "waiting": waited / elapsed, "peak": peak,
            "cpu_per_busy": cpu / busy, "compute": compute}


def wait_until(deadline: float) -> None:
    """Spin to ``deadline``, giving the GIL up on every turn (``sleep(0)``) so that a
    progress thread still runs: a wall-clock duration that a sleep's late wake-up on a busy
    machine does not stretch."""
    while time.perf_counter() < deadline:
        time.sleep(0)


def fixed_time_stage(forward_s: float, backward_s: float):
    """A stage whose forward waits ``forward_s`` and backward ``backward_s`` seconds (its
    ``durations``, which may be changed) and which passes its input's shape on
    (activations and gradients keep their size)."""
    import torch
    from torch import nn

    class Timed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, stage):
            wait_until(time.perf_counter() + stage.durations[0])
            ctx.stage = stage
            return x * weight

        @staticmethod
        def backward(ctx, grad):
            wait_until(time.perf_counter() + ctx.stage.durations[1])
            return grad.clone(), None, None    # a new tensor, as a Linear's input gradient is

    class FixedTimeStage(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(()))
            self.durations = (forward_s, backward_s)

        def forward(self, x):
            return Timed.apply(x, self.weight, self)

    return FixedTimeStage()


def action_medians(case: dict, schedule: str, stage: int, m: int) -> list[float]:
    """A stage's median forward and backward seconds in ``case``."""
    from elastic.pipeline.schedule import make_schedule
    kinds = [a.kind for a in make_schedule(schedule, stage, 2, m) if a.kind in ("fwd", "bwd")]
    return [statistics.median(t for step in case["compute"] for k, t in zip(kinds, step) if k == kind)
            for kind in ("fwd", "bwd")]


def fixed_time_case(transport, grid, opts, schedule: str, m: int, case: dict, comm) -> dict:
    """``case`` again with every forward and every backward taking one time on both stages:
    the case's medians averaged over the stages. A trial run measures what each stage adds
    around the wait (the last stage's loss, autograd's own work) and the waits are set so
    that the actions come out equal, as the ideal formula assumes."""
    target = [statistics.mean(column) for column in
              zip(*comm.allgather(action_medians(case, schedule, grid.stage, m)))]
    stage = fixed_time_stage(*target)
    trial = action_medians(schedule_case(transport, grid, stage, opts, schedule, m), schedule, grid.stage, m)
    added = [t - d for t, d in zip(trial, stage.durations)]
    stage.durations = tuple(max(0.0, t - a) for t, a in zip(target, added))
    return schedule_case(transport, grid, stage, opts, schedule, m)


def ping(transport, peer: int, rank: int, tensor, repeats: int = 10) -> float:
    """Median one-way time of ``tensor`` to ``peer`` (half a round trip)."""
    times = []
    for _ in range(repeats + 1):
        transport.barrier()
        started = time.perf_counter()
        if rank == 0:
            transport.isend(tensor, peer, 1).wait()
            transport.irecv(tensor, peer, 2).wait()
        else:
            transport.irecv(tensor, peer, 1).wait()
            transport.isend(tensor, peer, 2).wait()
        times.append((time.perf_counter() - started) / 2)
    return statistics.median(times[1:])


def copy_time(tensor, repeats: int = 10) -> float:
    import torch
    dst = torch.empty_like(tensor)
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        dst.copy_(tensor)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def worker(opts) -> None:
    import torch
    from torch import nn
    from mpi4py import MPI
    from elastic.pipeline.grid import Grid, cut
    from elastic.pipeline.gloo_transport import GlooTransport
    from elastic.runtime.torch_group import free_port
    from elastic.pipeline.transport import MpiTransport
    from elastic.runtime.memory import keep_freed_memory
    torch.set_num_threads(1)
    kept = opts.allocator == "kept" and keep_freed_memory()
    rank = MPI.COMM_WORLD.Get_rank()
    transport = MpiTransport(dp_color=rank, dp_key=0,
                             progress_thread={"on": True, "off": False}.get(opts.progress_thread))
    grid = Grid(rank=rank, pp=2, dp=1)
    torch.manual_seed(0)
    layers = [m for _ in range(opts.layers) for m in (nn.Linear(opts.dim, opts.dim), nn.Tanh())]
    module = cut(nn.Sequential(*layers), *((0, opts.layers), (opts.layers, 2 * opts.layers))[rank])
    result = {"schedules": {}, "fixed": {}, "progress_thread": transport.progress_thread,
              "kept": kept}
    for _ in range(opts.repeats):   # rounds over every case: load that comes and goes hits all
        for schedule in ("gpipe", "1f1b"):
            for m in MICROBATCHES:
                case = schedule_case(transport, grid, module, opts, schedule, m)
                result["schedules"].setdefault(f"{schedule}:{m}", []).append(case)
                result["fixed"].setdefault(f"{schedule}:{m}", []).append(
                    fixed_time_case(transport, grid, opts, schedule, m, case, MPI.COMM_WORLD))
    tensor = torch.randn(MB16 // 4)
    result["copy_s"] = copy_time(tensor)
    result["mpi_s"] = ping(transport, 1 - rank, rank, tensor)
    init = MPI.COMM_WORLD.bcast(f"tcp://127.0.0.1:{free_port()}" if rank == 0 else None, root=0)
    gloo = GlooTransport(rank, 2, init, [[0], [1]], rank)
    result["gloo_s"] = ping(gloo, 1 - rank, rank, tensor)
    gloo.close()
    everyone = transport.gather_object(result)
    if rank == 0:
        print("RESULT " + json.dumps(everyone))
    transport.close()


# -- launcher side ----------------------------------------------------------------------------
def replayed_bubble(cases: list[dict], schedule: str, m: int) -> float:
    """The bubble of the same steps with each stage's measured compute times and free
    messages (schedule.simulate): what the schedule and the compute times alone make."""
    from elastic.pipeline.schedule import make_schedule, simulate
    lists = [make_schedule(schedule, stage, len(cases), m) for stage in range(len(cases))]
    busy = span = 0.0
    for step in zip(*(case["compute"] for case in cases)):
        span += max(simulate(lists, durations=list(step))["finish"])
        busy += statistics.mean(sum(times) for times in step)
    return 1 - busy / span


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):5.2f} [{min(values):4.2f}-{max(values):4.2f}]"


def bubble_table(ranks: list[dict], stage: str) -> None:
    """One row per schedule and m for the runs under ``stage`` ("schedules": the model,
    "fixed": the fixed-time stage)."""
    p = 2
    print(f"{'schedule':8} {'m':>2} {'ideal':>6} {'bubble':>6}   {'bubble / ideal':>16}   "
          f"{'replayed / ideal':>16}   waiting  other   peak activations   cpu/busy")
    for schedule in ("gpipe", "1f1b"):
        for m in MICROBATCHES:
            ideal = (p - 1) / (m + p - 1)
            rounds = list(zip(*(r[stage][f"{schedule}:{m}"] for r in ranks)))
            measured = [statistics.mean(case["bubble"] for case in cases) for cases in rounds]
            replayed = [replayed_bubble(list(cases), schedule, m) for cases in rounds]
            peak = max(case["peak"] for cases in rounds for case in cases)
            cpu = min(case["cpu_per_busy"] for cases in rounds for case in cases)
            waiting = [statistics.mean(case["waiting"] for case in cases) for cases in rounds]
            other = [b - w for b, w in zip(measured, waiting)]   # per round, then the median
            print(f"{schedule:8} {m:2d} {ideal:6.3f} {statistics.median(measured):6.3f}   "
                  f"{spread([b / ideal for b in measured]):>16}   "
                  f"{spread([b / ideal for b in replayed]):>16}   {statistics.median(waiting):7.3f} "
                  f"{statistics.median(other):6.3f}   {peak / 2 ** 20:8.2f} MiB   {cpu:8.2f}")


def report(ranks: list[dict]) -> None:
    p = 2
    repeats = len(ranks[0]["schedules"]["gpipe:1"])
    print(f"MPI transport's progress thread: {'on' if ranks[0]['progress_thread'] else 'off'}; "
          f"freed memory: {'kept' if ranks[0]['kept'] else 'glibc default'}; "
          f"median [min-max] over {repeats} rounds")
    print("\nstages of the model:")
    bubble_table(ranks, "schedules")
    print("\nstages of fixed forward and backward times (each case's median times, equal on "
          "both stages):")
    bubble_table(ranks, "fixed")
    print("replayed: the same steps' measured compute times with messages that cost nothing; "
          "bubble - replayed is the transport's share, replayed - ideal the compute times' "
          "(stages of unequal or varying speed); with fixed times that share is the engine's "
          "own cost; the bubble split into waiting for messages "
          "(and for the step's sends) and the other time that was not compute (the executor's "
          "own work between actions, zeroing gradients)")
    print("\npeak activation bytes held, 1F1B / GPipe (stage 0; ideal min(p, m) / m):")
    for m in MICROBATCHES:
        one = ranks[0]["schedules"][f"1f1b:{m}"][0]["peak"]
        gp = ranks[0]["schedules"][f"gpipe:{m}"][0]["peak"]
        print(f"  m={m}: {one / gp:.3f} (ideal {min(p, m) / m:.3f})")
    copy_s = ranks[0]["copy_s"]
    print(f"\n16 MB transfer / 16 MB memory copy ({copy_s * 1e3:.2f} ms, {MB16 / copy_s / 1e9:.1f} GB/s):")
    for name in ("mpi", "gloo"):
        t = ranks[0][f"{name}_s"]
        print(f"  {name:4}: {t * 1e3:7.2f} ms  ({MB16 / t / 1e9:5.2f} GB/s)  ratio {t / copy_s:6.2f}")


def main(argv=None) -> None:
    opts = options(argv)
    if opts.worker:
        return worker(opts)
    if opts.layers % 2 or opts.batch % max(MICROBATCHES):
        raise SystemExit(f"--layers ({opts.layers}) must be even and --batch ({opts.batch}) "
                         f"divisible by {max(MICROBATCHES)}")
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    command = ["mpirun", *root, "--oversubscribe", "--bind-to", "none", "-np", "2", sys.executable,
               __file__, "--worker", *(argv if argv is not None else sys.argv[1:])]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise SystemExit(f"mpirun failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    report(json.loads(lines[0][len("RESULT "):]))


if __name__ == "__main__":
    main()
