"""Pipeline runs in real mpirun processes equal the single-process model.

One 4-rank mpirun launch runs the whole PROGRAM, each (transport, pp, dp) group on a
sub-communicator and every (schedule, microbatches) case in a loop, then a few steps of
the full trainer. This file is also the worker:

    PYTHONPATH=. mpirun -np 4 --oversubscribe python tests/test_pipeline_mpi.py OUT_DIR

Each rank writes its loss, gradients and post-step parameters to OUT_DIR; the tests compare
them with the same model, batch and optimizer step computed in the test process.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elastic.config import TrainConfig  # noqa: E402
from jobs.charlm import CharLMConfig, CharLMJob  # noqa: E402

MODEL = dict(context=16, dim=32, heads=4, layers=4)
BATCH, SEED, LR = 16, 3, 0.05
CASES = [(s, m) for s in ("gpipe", "1f1b") for m in (1, 4, 8)]
RTOL = 1e-5


def batch_indices() -> torch.Tensor:
    return torch.arange(BATCH) * 37 + 5   # fixed, spread over the data


# -- the worker (one process of the mpirun launch) -----------------------------------------
# (transport, pp, dp, cases): each group runs on world ranks 0 .. pp*dp-1 of one launch
# (sub-communicator), so one interpreter start-up serves the whole matrix.
PROGRAM = [("mpi", 2, 1, CASES), ("mpi", 3, 1, CASES), ("mpi", 2, 2, [("1f1b", 4), ("gpipe", 2)]),
           ("gloo", 2, 1, [("1f1b", 4), ("gpipe", 8)]), ("gloo", 2, 2, [("1f1b", 4)]),
           ("mpi", 1, 2, [("1f1b", 2)])]
TRAIN = dict(steps=3, global_batch=BATCH, optimizer="sgd", lr=LR, seed=SEED, progress=False,
             commit_every=2, checkpoint_every=1)
RANKS = 4


def label(transport: str, pp: int, dp: int, schedule: str, m: int) -> str:
    return f"{transport}-pp{pp}-dp{dp}-{schedule}-{m}"


def run_cases(world, kind: str, transport, pp: int, dp: int, cases, out: Path) -> None:
    from elastic.pipeline.config import PipelineConfig, make_plan
    from elastic.pipeline.grid import Grid, build_stage
    from elastic.pipeline.stage import PipelineStage
    from elastic.optim import make_optimizer
    from elastic.data.sampler import rank_share
    job = CharLMJob(CharLMConfig(**MODEL))
    train = TrainConfig(global_batch=BATCH, optimizer="sgd", lr=LR, seed=SEED)
    for schedule, m in cases:
        cfg = PipelineConfig(pp=pp, dp=dp, schedule=schedule, microbatches=m)
        plan = make_plan(cfg, world.size, MODEL["layers"] + 2, BATCH)
        grid = Grid.of(world, plan)
        module = build_stage(job.build_model, plan, grid.stage, SEED)
        optimizer = make_optimizer(module.parameters(), train)
        stage = PipelineStage(job, plan, grid, transport, module)
        indices = batch_indices()
        batch = (job.train[rank_share(indices, grid.replica, plan.dp)],)
        count = job.loss_count((job.train[indices],))
        stats = stage.forward_backward(batch, count)
        stage.reduce()
        loss_sum = torch.tensor([stats.loss_sum])     # the replicas' summed loss, as the trainer's
        transport.allreduce_dp(loss_sum)              # agreement computes it
        loss_sum = loss_sum.item() if grid.is_last else None
        grads = {n: p.grad.clone() for n, p in module.named_parameters()}
        optimizer.step()
        torch.save({"loss": None if loss_sum is None else loss_sum / count, "grads": grads,
                    "params": {n: p.detach().clone() for n, p in module.named_parameters()},
                    "replica": grid.replica, "stage": grid.stage,
                    "peak": stats.peak_activation_bytes, "busy": stats.busy_time,
                    "compute": stats.compute_times},
                   out / f"{label(kind, pp, dp, schedule, m)}-rank{world.rank}.pt")


def worker(out: Path) -> None:
    from mpi4py import MPI
    from elastic.pipeline.gloo_transport import GlooTransport
    from elastic.runtime.torch_group import free_port
    from elastic.pipeline.transport import MpiTransport
    from elastic.runtime.waiting import poll
    from elastic.runtime.world import World
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    for kind, pp, dp, cases in PROGRAM:
        size = pp * dp
        init = comm.bcast(f"tcp://127.0.0.1:{free_port()}" if rank == 0 else None, root=0)
        sub = comm.Split(0 if rank < size else MPI.UNDEFINED, rank)
        if rank < size:
            world = World(rank=rank, size=size, local_rank=rank, local_size=size, host="local")
            groups = [[r * pp + s for r in range(dp)] for s in range(pp)]
            if kind == "mpi":
                transport = MpiTransport(dp_color=rank % pp, dp_key=rank, comm=sub)
            else:
                transport = GlooTransport(rank, size, init, groups, rank % pp)
            run_cases(world, kind, transport, pp, dp, cases, out)
            transport.close()
            sub.Free()
        poll(comm.Ibarrier().Test)     # idle ranks sleep instead of spinning
    train_loop(out)


def train_loop(out: Path) -> None:
    """The whole trainer (elastic.train) for a few steps on all ranks, metrics collected."""
    import json
    from elastic.pipeline.config import PipelineConfig
    from elastic.train import train
    rows = []
    train(CharLMJob(CharLMConfig(**MODEL)),
          {"train": TrainConfig(run_dir=str(out / "train"), db=str(out / "m.db"), **TRAIN),
           "pipeline": PipelineConfig(pp=2, dp=2, schedule="1f1b", microbatches=4, transport="mpi")},
          callbacks=[rows.append])
    (out / f"metrics-rank{rows[0]['rank']}.json").write_text(json.dumps(rows))


# -- the test side -------------------------------------------------------------------------
def reference():
    """Loss, gradients and post-step parameters of the single-process model."""
    job = CharLMJob(CharLMConfig(**MODEL))
    torch.manual_seed(SEED)
    model = job.build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    loss_sum, count = job.loss_sum(model, (job.train[batch_indices()],))
    (loss_sum / count).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    optimizer.step()
    return loss_sum.item() / count, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def ref():
    return reference()


pytestmark = pytest.mark.timeout(400)   # the shared launch may start slowly on a busy machine


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One mpirun launch of RANKS processes runs the whole PROGRAM; returns its folder."""
    out = tmp_path_factory.mktemp("pipeline")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    command = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(RANKS),
               sys.executable, __file__, str(out)]
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)    # mpirun and every rank it started
        output, _ = proc.communicate()
        pytest.fail(f"mpirun did not finish in 300 s: {output[-3000:]}")
    assert proc.returncode == 0, output[-6000:]
    return out


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    # Microbatching only reorders float32 sums: elementwise relative 1e-5, with an absolute
    # floor at 1e-5 of the tensor's largest entry for entries that are nearly zero.
    floor = RTOL * expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=floor, msg=lambda m: f"{what}: {m}")


def check_case(out: Path, name: str, ranks: int, ref) -> list[dict]:
    loss_ref, grads_ref, params_ref = ref
    parts = [torch.load(out / f"{name}-rank{r}.pt") for r in range(ranks)]
    seen = set()
    for part in parts:
        if part["loss"] is not None:
            assert part["loss"] == pytest.approx(loss_ref, rel=RTOL), name
        for key, grad in part["grads"].items():
            close(grad, grads_ref[key], f"{name} grad {key}")
            close(part["params"][key], params_ref[key], f"{name} param {key}")
            seen.add(key)
    assert seen == set(grads_ref), f"{name}: parameters missing {set(grads_ref) - seen}"
    return parts


@pytest.mark.parametrize("pp", [2, 3])
def test_pipeline_matches_single_process(runs, ref, pp):
    peaks = {}
    for schedule, m in CASES:
        parts = check_case(runs, label("mpi", pp, 1, schedule, m), pp, ref)
        peaks[schedule, m] = parts[0]["peak"]    # stage 0 holds the most under 1F1B
        for part in parts:   # one forward and one backward time per microbatch, summing to busy
            assert len(part["compute"]) == 2 * m and min(part["compute"]) > 0
            assert sum(part["compute"]) == pytest.approx(part["busy"], rel=1e-9)
    # 1F1B keeps at most pp microbatches in flight on stage 0; GPipe keeps all m.
    assert peaks["1f1b", 8] * 8 == pytest.approx(peaks["gpipe", 8] * pp, rel=0.01)
    assert peaks["1f1b", 1] == peaks["gpipe", 1]


def test_hybrid_dp2_pp2_matches_combined_batch(runs, ref):
    for schedule, m in (("1f1b", 4), ("gpipe", 2)):
        parts = check_case(runs, label("mpi", 2, 2, schedule, m), 4, ref)
        assert {(p["replica"], p["stage"]) for p in parts} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    # One stage per replica (what the supervisor falls back to on too few slots).
    check_case(runs, label("mpi", 1, 2, "1f1b", 2), 2, ref)


def test_gloo_transport_matches_single_process(runs, ref):
    for schedule, m in (("1f1b", 4), ("gpipe", 8)):
        check_case(runs, label("gloo", 2, 1, schedule, m), 2, ref)
    check_case(runs, label("gloo", 2, 2, "1f1b", 4), 4, ref)


def train_reference(losses: list | None = None) -> torch.nn.Module:
    """TRAIN's steps on one process: same cursor, same global batches, same optimizer;
    each step's mean loss goes to ``losses``."""
    from elastic.data.sampler import Cursor, global_batch
    job = CharLMJob(CharLMConfig(**MODEL))
    torch.manual_seed(SEED)
    model = job.build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    cursor = Cursor()
    for _ in range(TRAIN["steps"]):
        indices = global_batch(cursor, len(job.train), BATCH, SEED)
        optimizer.zero_grad()
        loss_sum, count = job.loss_sum(model, (job.train[indices],))
        (loss_sum / count).backward()
        if losses is not None:
            losses.append(loss_sum.item() / count)
        optimizer.step()
        cursor = cursor.advance(len(indices), len(job.train))
    return model


def test_trainer_end_to_end_matches_single_process_and_reports_metrics(runs):
    import json
    from elastic.pipeline.checkpoint import load_full, read_manifest
    run_dir = runs / "train"
    result = json.loads((run_dir / "result.json").read_text())
    assert (result["step"], result["world_size"], result["pipeline"]["dp"]) == (3, 4, 2)
    assert [s["children"] for s in result["stages"]] == [[0, 3], [3, 6]]
    assert read_manifest(run_dir / "checkpoint")["step"] == 3
    job = CharLMJob(CharLMConfig(**MODEL))
    model = job.build_model()
    load_full(run_dir / "checkpoint", model)
    losses = []
    expected = train_reference(losses).state_dict()
    for key, tensor in model.state_dict().items():
        close(tensor, expected[key], f"trained {key}")
    activation = 4 * (BATCH // 2 // 4) * MODEL["context"] * MODEL["dim"] * 4   # m x mb x T x D x 4 B
    for rank in range(RANKS):
        rows = json.loads((runs / f"metrics-rank{rank}.json").read_text())
        assert [r["step"] for r in rows] == [1, 2, 3]
        last = rows[-1]
        assert last["stage"] == rank % 2 and last["replica"] == rank // 2
        assert 0 < last["busy_time"] <= last["schedule_time"] <= last["step_time"]
        assert 0 <= last["bubble"] < 1 and last["peak_activation_bytes"] > 0
        assert last["activation_bytes"] == activation      # the shape header went only in step 1
        # Every stage learns the global loss from the step's agreement.
        assert [r["loss"] for r in rows] == pytest.approx(losses, rel=RTOL)
        assert last["allreduce_bytes"] > 0


def test_a_message_moves_while_its_sender_computes_with_the_progress_thread():
    # Without single-copy (as in containers that forbid CMA) a 4 MB message moves through
    # shared buffers only while its sender is inside MPI: sent before a 0.5 s forward, it
    # arrives after it, unless the progress thread keeps MPI moving.
    from conftest import mpirun
    arrived = {}
    for mode in ("off", "on"):
        done = mpirun(2, "--mca", "btl_vader_single_copy_mechanism", "none",
                      sys.executable, str(ROOT / "tests/workers/mpi_progress_worker.py"), mode,
                      timeout=60)
        for kind in ("ARRIVED", "SENT"):
            # two ranks' lines can reach mpirun's output run together: find, don't split
            arrived[kind, mode] = [float(t) for t in
                                   re.findall(rf"{kind} {mode} (\d+\.\d+)", done.stdout)]
            assert len(arrived[kind, mode]) == 3, done.stdout + done.stderr
    assert min(arrived["ARRIVED", "off"]) >= 0.45, arrived      # the stall the thread exists for
    assert max(arrived["ARRIVED", "on"]) < 0.25, arrived
    # The same when the receiver computes: a send posted 0.2 s into its 0.5 s forward ends
    # after the forward without the thread, soon after it is posted with it (the thread
    # runs while the receive is outstanding, however long that is).
    assert min(arrived["SENT", "off"]) >= 0.45, arrived
    assert max(arrived["SENT", "on"]) < 0.4, arrived


def test_ranks_that_disagree_about_the_progress_thread_all_go_without_it():
    # Rank 0 asks for it, rank 1 does not: both go without (neither waits in the other's
    # collective), and REGATTA_MPI_PROGRESS is what the engine asks with.
    from conftest import mpirun
    from elastic.runtime.env import Env
    done = mpirun(2, sys.executable, str(ROOT / "tests/workers/mpi_progress_worker.py"), "disagree",
                  timeout=60)
    assert sorted(re.findall(r"PROGRESS \d (?:True|False)", done.stdout)) == \
        ["PROGRESS 0 False", "PROGRESS 1 False"], done.stdout   # lines may run together
    assert [Env.read(env).mpi_progress for env in ({}, {"REGATTA_MPI_PROGRESS": "1"},
                                                   {"REGATTA_MPI_PROGRESS": "0"})] == [None, True, False]


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
