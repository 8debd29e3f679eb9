"""The charlm pipeline (pp=2) trained on CUDA and on CPU in one run; losses compared.

On a machine with a GPU (one is enough: both ranks share cuda:0):

    PYTHONUNBUFFERED=1 python3 bench/gpu_pipeline_check.py 2>&1 | tee $OUT/gpu.log

Here, without one (the second "device" is the CPU with every message forced through the
transport's host staging buffers, the path CUDA tensors take):

    .venv/bin/python bench/gpu_pipeline_check.py --cpu-only --small

It starts its own 2 ranks (torch.multiprocessing, spawn) joined by the pipeline's
torch.distributed Gloo transport, so it needs neither mpirun nor Horovod, and it imports
nothing from monitor/ or webui/ (each rank checks that horovod, sqlalchemy and flask were
never imported). For every schedule (gpipe, 1f1b) and microbatch count (1, 4, 8) both
ranks build their stage from the same seed, train ``--steps`` SGD steps on the same
batches on each device, and report per step: the loss (last stage), the step time (the
slower rank's, device synchronised) and the bubble. Printed at the end:

* per case and step: loss on each device and their relative difference; PASS when every
  difference is within ``--rtol`` (fp32; TF32 is switched off), and the largest relative
  difference of the trained parameters;
* per case: median step time on each device after ``--warmup`` steps, and CPU / CUDA;
* the first step's loss against the single-process model (same weights and batch, CPU).

Exit status: 0 when every compared loss is within tolerance, 1 when not, 2 when a rank
failed or the run passed ``--deadline`` seconds (whatever finished is still printed).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCHEDULES = ("gpipe", "1f1b")
MICROBATCHES = (1, 4, 8)
SEED, LR = 3, 0.05
FORBIDDEN = ("horovod", "sqlalchemy", "flask", "monitor", "webui")


def options(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-only", action="store_true",
                        help="no CUDA: compare CPU with CPU through the staging buffers")
    parser.add_argument("--small", action="store_true",
                        help="a tiny model and batch (for 2 shared cores)")
    parser.add_argument("--steps", type=int, default=5, help="SGD steps per case and device")
    parser.add_argument("--warmup", type=int, default=1, help="steps left out of the step time")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (+ embed, head)")
    parser.add_argument("--batch", type=int, default=64, help="global batch (windows per step)")
    parser.add_argument("--microbatches", default=",".join(map(str, MICROBATCHES)))
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per rank (0: half the cores)")
    parser.add_argument("--rtol", type=float, default=1e-4,
                        help="largest relative loss difference between the devices")
    parser.add_argument("--deadline", type=float, default=240.0,
                        help="seconds before the ranks are killed")
    opts = parser.parse_args(argv)
    if opts.small:
        opts.context, opts.dim, opts.heads, opts.layers, opts.batch = 16, 32, 4, 2, 16
    opts.microbatches = [int(m) for m in str(opts.microbatches).split(",") if m.strip()]
    return opts


def batch_indices(step: int, n: int, batch: int):
    import torch
    generator = torch.Generator().manual_seed(SEED * 7919 + step)
    return torch.randperm(n, generator=generator)[:batch]


def cases(opts) -> list[tuple[str, int]]:
    return [(s, m) for s in SCHEDULES for m in opts.microbatches]


# -- one rank ------------------------------------------------------------------------------
def worker(rank: int, opts: argparse.Namespace, init: str, out: str) -> None:
    import torch
    torch.set_num_threads(opts.threads or max(1, (os.cpu_count() or 2) // 2))
    torch.set_float32_matmul_precision("highest")   # the default, said out loud: no TF32
    from elastic.pipeline.config import PipelineConfig, make_plan
    from elastic.pipeline.grid import Grid, build_stage
    from elastic.pipeline.stage import PipelineStage
    from elastic.runtime.device import choose_device
    from elastic.pipeline.gloo_transport import GlooTransport
    from elastic.runtime.world import World
    from jobs.charlm import CharLMConfig, CharLMJob

    out = Path(out)
    transport = GlooTransport(rank, 2, init, [[0], [1]], rank, timeout_s=120)
    world = World(rank=rank, size=2, local_rank=rank, local_size=2, host="local")
    job = CharLMJob(CharLMConfig(context=opts.context, dim=opts.dim, heads=opts.heads,
                                 layers=opts.layers))
    devices = [("cpu", "cpu"), ("cpu-staged", "cpu")] if opts.cpu_only else \
        [("cuda", "cuda"), ("cpu", "cpu")]          # CUDA first: a failure shows at once
    for name, request in devices:
        device = choose_device(request, local_rank=rank)
        transport.direct_devices = frozenset() if name == "cpu-staged" else frozenset({"cpu"})
        for schedule, m in cases(opts):
            plan = make_plan(PipelineConfig(pp=2, schedule=schedule, microbatches=m), 2,
                             opts.layers + 2, opts.batch)
            grid = Grid.of(world, plan)
            module = build_stage(job.build_model, plan, grid.stage, SEED)
            stage = PipelineStage(job, plan, grid, transport, module, device=device)
            assert all(p.device == device for p in module.parameters()), "stage not on its device"
            optimizer = torch.optim.SGD(module.parameters(), lr=LR, momentum=0.9)
            module.train()
            rows = []
            transport.barrier()
            for step in range(opts.steps):
                indices = batch_indices(step, len(job.train), opts.batch)
                batch = (job.train[indices],)
                count = job.loss_count(batch)
                sync(device)
                started = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                stats = stage.forward_backward(batch, count)
                stage.reduce()
                loss_sum = stats.loss_sum if grid.is_last else None   # dp = 1: this replica's
                optimizer.step()
                sync(device)
                rows.append({"step": step + 1, "time": time.perf_counter() - started,
                             "busy": stats.busy_time, "bubble": stats.bubble,
                             "loss": None if loss_sum is None else loss_sum / count})
            params = {k: v.detach().to("cpu") for k, v in module.state_dict().items()}
            torch.save({"rows": rows, "params": params, "device": str(device)},
                       out / f"{name}-{schedule}-{m}-rank{rank}.pt")
    leaked = sorted({k.split(".")[0] for k in sys.modules} & set(FORBIDDEN))
    info = {"rank": rank, "leaked": leaked, "torch": torch.__version__,
            "cuda": torch.version.cuda, "threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name(0) if not opts.cpu_only else None,
            "max_mem": torch.cuda.max_memory_allocated(0) if not opts.cpu_only else 0}
    (out / f"info-rank{rank}.json").write_text(json.dumps(info))
    transport.barrier()
    transport.close()


def sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def entry(rank: int, opts, init: str, out: str) -> None:
    try:
        worker(rank, opts, init, out)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        raise


# -- the launching process ----------------------------------------------------------------
def launch(opts, out: Path) -> str | None:
    """Run both ranks; None when they finished, else why not."""
    import torch.multiprocessing as mp
    from elastic.runtime.torch_group import free_port
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")   # no network on the GPU machine
    init = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    context = mp.spawn(entry, args=(opts, init, str(out)), nprocs=2, join=False)
    deadline = time.monotonic() + opts.deadline
    try:
        while not context.join(timeout=2):
            if time.monotonic() > deadline:
                for proc in context.processes:
                    if proc.is_alive():
                        proc.kill()
                return f"ranks killed after --deadline {opts.deadline:.0f} s"
    except Exception as err:   # noqa: BLE001 - a rank raised; its traceback is above
        for proc in context.processes:
            if proc.is_alive():
                proc.kill()
        return f"a rank failed: {str(err).strip().splitlines()[0] if str(err).strip() else err!r}"
    return None


def reference_loss(opts) -> float:
    """Step 1's loss from the single-process model (same seed and batch), on the CPU."""
    import torch
    from jobs.charlm import CharLMConfig, CharLMJob
    job = CharLMJob(CharLMConfig(context=opts.context, dim=opts.dim, heads=opts.heads,
                                 layers=opts.layers))
    torch.manual_seed(SEED)
    model = job.build_model()
    with torch.no_grad():
        first = job.train[batch_indices(0, len(job.train), opts.batch)]
        loss_sum, count = job.loss_sum(model, (first,))
    return loss_sum.item() / count


def load_case(out: Path, name: str, schedule: str, m: int) -> dict | None:
    import torch
    parts = [out / f"{name}-{schedule}-{m}-rank{r}.pt" for r in (0, 1)]
    if not all(p.exists() for p in parts):
        return None
    ranks = [torch.load(p, weights_only=False) for p in parts]
    times = [max(a["time"], b["time"]) for a, b in zip(ranks[0]["rows"], ranks[1]["rows"])]
    return {"loss": [r["loss"] for r in ranks[1]["rows"]], "time": times,
            "bubble": [statistics.mean(r["bubble"] for r in part["rows"]) for part in ranks],
            "params": {**ranks[0]["params"], **ranks[1]["params"]},
            "devices": [part["device"] for part in ranks]}


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def report(opts, out: Path, failure: str | None) -> int:
    first, second = ("cpu-staged", "cpu") if opts.cpu_only else ("cuda", "cpu")
    print(f"\n== losses: {first} vs {second} (rtol {opts.rtol:g}) ==")
    worst, compared, missing, param_worst = 0.0, 0, [], 0.0
    timing = []
    for schedule, m in cases(opts):
        a, b = load_case(out, first, schedule, m), load_case(out, second, schedule, m)
        if a is None or b is None:
            missing.append(f"{schedule} m={m}")
            continue
        for step, (la, lb) in enumerate(zip(a["loss"], b["loss"]), 1):
            diff = rel(la, lb)
            worst, compared = max(worst, diff), compared + 1
            print(f"{schedule:5s} m={m} step {step}: {first} {la:.7f}  {second} {lb:.7f}  "
                  f"rel diff {diff:.2e}")
        pdiff = max(((a["params"][k] - b["params"][k]).abs().max() /
                     b["params"][k].abs().max().clamp_min(1e-30)).item() for k in b["params"])
        param_worst = max(param_worst, pdiff)
        ta = statistics.median(a["time"][opts.warmup:] or a["time"])
        tb = statistics.median(b["time"][opts.warmup:] or b["time"])
        timing.append((schedule, m, ta, tb, a["bubble"], b["bubble"], a["devices"], pdiff))
    print(f"\n== step time (median of steps {opts.warmup + 1}..{opts.steps}, slower rank) ==")
    print(f"{'case':12s} {first + ' s':>11s} {second + ' s':>11s} {second + '/' + first:>12s}"
          f"  bubble {first} (rank0, rank1) / {second}   param rel diff")
    for schedule, m, ta, tb, ba, bb, devs, pdiff in timing:
        print(f"{schedule + ' m=' + str(m):12s} {ta:11.4f} {tb:11.4f} {tb / ta:12.2f}  "
              f"({ba[0]:.2f}, {ba[1]:.2f}) / ({bb[0]:.2f}, {bb[1]:.2f})   {pdiff:.2e}   "
              f"[{first} on {', '.join(devs)}]")
    for path in sorted(out.glob("info-rank*.json")):
        print("rank info:", path.read_text())
    leaked = [json.loads(p.read_text())["leaked"] for p in out.glob("info-rank*.json")]
    ref = reference_loss(opts)
    step1 = [load_case(out, second, s, m) for s, m in cases(opts)]
    step1 = [c["loss"][0] for c in step1 if c is not None]
    ref_diff = max((rel(v, ref) for v in step1), default=float("nan"))
    print(f"\nsingle-process {second} step-1 loss {ref:.7f}; pipeline ({second}) rel diff "
          f"{ref_diff:.2e} (max over cases)")
    ok = failure is None and not missing and compared > 0 and worst <= opts.rtol \
        and not any(leaked) and (ref_diff <= opts.rtol)
    print(f"\nLOSS MATCH: {'PASS' if ok else 'FAIL'}: {compared} losses compared, max rel diff "
          f"{worst:.2e} (rtol {opts.rtol:g}); trained params max rel diff {param_worst:.2e}"
          + (f"; missing cases: {', '.join(missing)}" if missing else "")
          + (f"; imported {leaked}" if any(leaked) else "")
          + (f"; {failure}" if failure else ""))
    if failure:
        return 2
    return 0 if ok else 1


def main(argv=None) -> int:
    opts = options(argv)
    import torch
    if not opts.cpu_only:
        if not torch.cuda.is_available():
            print("no CUDA device visible to torch; run with --cpu-only", file=sys.stderr)
            return 2
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), "
          f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} GPU(s), "
          f"{os.cpu_count()} cores; model context {opts.context} dim {opts.dim} heads "
          f"{opts.heads} layers {opts.layers}; batch {opts.batch}; {opts.steps} steps per case; "
          f"cases {cases(opts)}", flush=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-pipeline-") as folder:
        failure = launch(opts, Path(folder))
        print(f"ranks done in {time.perf_counter() - started:.1f} s"
              + (f" ({failure})" if failure else ""), flush=True)
        return report(opts, Path(folder), failure)


if __name__ == "__main__":
    sys.exit(main())
