"""Device plumbing of the pipeline, tested on the CPU (no test needs a GPU).

* ``choose_device``: which device a rank computes on (CUDA visibility faked).
* Host staging (the path CUDA tensors take through a transport that cannot address device
  memory), forced on CPU tensors: bytes round-trip exactly, a receive lands in the
  caller's tensor, the library only ever sees separate host buffers.
* A 2-stage pipeline run by two threads over an in-process transport: receive buffers are
  allocated on the stage's device, and training through the staging buffers gives
  bit-identical losses and gradients to the direct path (and matches one process).
* bench/gpu_pipeline_check.py --cpu-only: the prepared GPU script, run on CPU with its real
  Gloo transport, so it cannot rot between GPU runs.
"""
from __future__ import annotations

import subprocess
import sys
import threading
import types
from collections import defaultdict, deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch import nn

from elastic.config import ConfigError
from elastic.pipeline.config import PipelineConfig, make_plan
from elastic.pipeline.executor import StageExecutor, module_device
from elastic.pipeline.grid import Grid, build_stage
from elastic.pipeline.stage import PipelineStage
from elastic.pipeline.transport import Handle, Transport, mpi_cuda_aware
from elastic.runtime.device import choose_device as stage_device
from elastic.runtime.env import Env
from elastic.runtime.world import World

ROOT = Path(__file__).resolve().parents[1]


# -- which device --------------------------------------------------------------------------
def fake_cuda(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_stage_device_defaults_to_cpu_even_with_a_gpu(monkeypatch):
    fake_cuda(monkeypatch, 2)
    assert stage_device() == torch.device("cpu")
    assert stage_device(Env.read({}).device) == torch.device("cpu")
    assert stage_device("cpu", local_rank=1) == torch.device("cpu")


def test_stage_device_picks_the_ranks_gpu(monkeypatch):
    fake_cuda(monkeypatch, 4)
    assert stage_device("cuda", local_rank=6) == torch.device("cuda", 2)
    assert stage_device("auto", local_rank=1) == torch.device("cuda", 1)
    assert stage_device("cuda:3", local_rank=0) == torch.device("cuda", 3)
    env = Env.read({"LOCAL_RANK": "5", "REGATTA_DEVICE": "cuda"})
    assert env.launched.local_rank == 5
    assert stage_device(env.device, env.launched.local_rank) == torch.device("cuda", 1)
    env = Env.read({"OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_RANK": "2",
                    "OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
                    "LOCAL_RANK": "7", "REGATTA_DEVICE": "cuda"})   # mpirun's wins
    assert stage_device(env.device, env.launched.local_rank) == torch.device("cuda", 2)


def test_stage_device_without_cuda(monkeypatch):
    fake_cuda(monkeypatch, 0)
    assert stage_device("auto", local_rank=3) == torch.device("cpu")
    with pytest.raises(ConfigError, match="device 'cuda' asked for.*no CUDA device"):
        stage_device("cuda")
    with pytest.raises(ConfigError, match="must be cpu, cuda, cuda:N or auto, got 'tpu'"):
        stage_device("tpu")
    fake_cuda(monkeypatch, 2)
    with pytest.raises(ConfigError, match="'cuda:2', but only 2 CUDA devices"):
        stage_device("cuda:2")
    with pytest.raises(ConfigError, match="expected cuda:N"):
        stage_device("cuda:x")


def test_executor_device_follows_the_module():
    grid = Grid(rank=0, pp=2, dp=1)
    assert module_device(nn.ReLU()) == torch.device("cpu")
    assert StageExecutor(nn.Linear(2, 2), grid, Transport()).device == torch.device("cpu")
    assert StageExecutor(nn.ReLU(), grid, Transport(), device="cpu").device == torch.device("cpu")


@pytest.mark.parametrize("env, expected", [({}, None), ({"REGATTA_MPI_CUDA_AWARE": "1"}, True),
                                           ({"REGATTA_MPI_CUDA_AWARE": "0"}, False)])
@pytest.mark.parametrize("query, kinds", [(None, None), (None, "system,mpi,cuda:device"),
                                          (lambda: 1, None), (lambda: 0, None)])
def test_mpi_cuda_awareness(monkeypatch, env, expected, query, kinds):
    """The override wins; else Query_cuda_support where mpi4py has it; else the MPI 4.1
    memory kinds. A fake mpi4py: importing the real one would initialise MPI in pytest."""
    forced = Env.read(env).mpi_cuda_aware
    fake = types.SimpleNamespace(**({} if query is None else {"Query_cuda_support": query}))
    monkeypatch.setitem(sys.modules, "mpi4py", types.SimpleNamespace(MPI=fake))
    info = types.SimpleNamespace(Get=lambda key: kinds if key == "mpi_memory_alloc_kinds" else None)
    comm = types.SimpleNamespace(Get_info=lambda: info)
    reported = bool(query()) if query is not None else kinds is not None and "cuda" in kinds
    assert mpi_cuda_aware(comm, forced) is (reported if expected is None else expected)


# -- host staging ----------------------------------------------------------------------------
class Mailbox:
    """Messages between in-process ranks: FIFO per (source, destination, tag)."""

    def __init__(self):
        self.lock, self.queues = threading.Lock(), defaultdict(deque)

    def put(self, key, tensor):
        with self.lock:
            self.queues[key].append(tensor)

    def take(self, key):
        with self.lock:
            return self.queues[key].popleft() if self.queues[key] else None


class _Sent(Handle):
    def __init__(self, tensor):
        self.tensor, self._done, self._cap = tensor, True, 1e-4


class _Arriving(Handle):
    def __init__(self, box, key, tensor):
        self.box, self.key, self.tensor, self._done, self._cap = box, key, tensor, False, 1e-4

    def _test(self):
        message = self.box.take(self.key)
        if message is not None:
            self.tensor.copy_(message)
        return message is not None


class Loopback(Transport):
    """An in-process transport. Records what the caller hands it (``public``) and what
    reaches the "library" underneath the staging (``library``)."""

    def __init__(self, rank, size, box, stage_everything=False, replicas=1):
        self.rank, self.size, self.box, self.replicas = rank, size, box, replicas
        if stage_everything:
            self.direct_devices = frozenset()
        self.public, self.library = [], []

    def isend(self, tensor, peer, tag):
        self.public.append(tensor)
        return super().isend(tensor, peer, tag)

    def irecv(self, tensor, peer, tag):
        self.public.append(tensor)
        return super().irecv(tensor, peer, tag)

    def recv_channel(self, tensor, peer, tag):
        self.public.append(tensor)
        return super().recv_channel(tensor, peer, tag)

    def send_channel(self, tensor, peer, tag):
        self.public.append(tensor)
        return super().send_channel(tensor, peer, tag)

    def allreduce_dp(self, flat):
        self.public.append(flat)
        return super().allreduce_dp(flat)

    def _isend(self, tensor, peer, tag):
        self.library.append(tensor)
        self.box.put((self.rank, peer, tag), tensor.clone())
        return _Sent(tensor)

    def _irecv(self, tensor, peer, tag):
        self.library.append(tensor)
        return _Arriving(self.box, (peer, self.rank, tag), tensor)

    def _allreduce_dp(self, flat):
        self.library.append(flat)
        flat.mul_(self.replicas)    # as if identical replicas had been summed in


def awkward_tensors():
    generator = torch.Generator().manual_seed(0)
    floats = torch.randn(3, 5, generator=generator)
    floats[0, :4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-45])
    return [floats, floats.to(torch.bfloat16), floats.to(torch.float16), floats.double(),
            torch.randint(-2**62, 2**62, (7,), generator=generator, dtype=torch.int64),
            torch.randint(-2**31, 2**31 - 1, (2, 2, 2), generator=generator, dtype=torch.int32),
            torch.zeros(0)]


def test_staging_round_trips_every_dtype_bit_for_bit():
    box = Mailbox()
    sender, receiver = Loopback(0, 2, box, True), Loopback(1, 2, box, True)
    for tag, tensor in enumerate(awkward_tensors()):
        expected = tensor.clone()
        sent = sender.isend(tensor, 1, tag)
        tensor.zero_()                             # the sender may reuse its tensor at once
        target = torch.full_like(tensor, 7)
        received = receiver.irecv(target, 0, tag)
        assert received.wait() is target          # lands in the caller's tensor
        assert sent.wait() is tensor and received.wait() is target
        assert torch.equal(target.view(torch.uint8), expected.view(torch.uint8)), tensor.dtype
    # The library saw only separate host buffers, never the caller's tensors.
    for public, library in zip(sender.public + receiver.public, sender.library + receiver.library):
        assert library is not public and library.device.type == "cpu"
        assert library.numel() == 0 or library.data_ptr() != public.data_ptr()


def test_staged_receive_copies_only_when_waited_on():
    box = Mailbox()
    target = torch.zeros(4)
    handle = Loopback(1, 2, box, True).irecv(target, 0, 3)
    box.put((0, 1, 3), torch.arange(4.0))
    assert handle.test() and torch.equal(target, torch.zeros(4))   # arrived in the host buffer
    assert torch.equal(handle.wait(), torch.arange(4.0))
    target.zero_()
    assert torch.equal(handle.wait(), torch.zeros(4))               # copied once, not again


def test_staged_allreduce_writes_back_in_place():
    flat = torch.randn(10)
    expected = flat * 2
    transport = Loopback(0, 1, Mailbox(), True, replicas=2)
    transport.allreduce_dp(flat)
    assert torch.equal(flat, expected) and transport.library[0] is not flat
    direct = Loopback(0, 1, Mailbox(), replicas=2)
    again = expected.clone()
    direct.allreduce_dp(again)
    assert direct.library[0] is again            # CPU tensors go straight to the library


# -- a 2-stage pipeline in two threads -----------------------------------------------------
class TinyJob:
    name = "tiny"

    def build_model(self):
        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                             nn.Linear(16, 5))

    def pipeline_input(self, batch):
        return batch[0]

    def pipeline_loss(self, output, batch):
        return nn.functional.cross_entropy(output, batch[1], reduction="sum")

    def loss_count(self, batch):
        return len(batch[0])


BATCH = 8


def tiny_batch():
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(BATCH, 6, generator=generator),
            torch.randint(0, 5, (BATCH,), generator=generator))


def threaded_pipeline(schedule: str, m: int, stage_everything: bool):
    job, box, batch = TinyJob(), Mailbox(), tiny_batch()
    plan = make_plan(PipelineConfig(pp=2, schedule=schedule, microbatches=m), 2, 5, BATCH)
    stages = []
    for rank in (0, 1):
        grid = Grid.of(World(rank=rank, size=2, local_rank=rank, local_size=2, host="h"), plan)
        module = build_stage(job.build_model, plan, grid.stage, seed=11)
        stages.append(PipelineStage(job, plan, grid, Loopback(rank, 2, box, stage_everything),
                                    module, device="cpu"))

    def one(stage):
        stats = stage.forward_backward(batch, job.loss_count(batch))
        stage.reduce()
        return stats.loss_sum if stage.grid.is_last else None, {n: p.grad.clone() for n, p in stage.module.named_parameters()}

    with ThreadPoolExecutor(2) as pool:
        results = [f.result(timeout=60) for f in [pool.submit(one, s) for s in stages]]
    return stages, results[1][0] / BATCH, {**results[0][1], **results[1][1]}


@pytest.mark.parametrize("schedule, m", [("gpipe", 4), ("1f1b", 4), ("1f1b", 1)])
def test_pipeline_through_staging_is_bit_identical(schedule, m):
    torch.manual_seed(11)
    model = TinyJob().build_model()
    x, y = tiny_batch()
    reference = nn.functional.cross_entropy(model(x), y)
    reference.backward()

    stages, loss, grads = threaded_pipeline(schedule, m, stage_everything=False)
    staged_stages, staged_loss, staged_grads = threaded_pipeline(schedule, m, stage_everything=True)
    assert loss == pytest.approx(reference.item(), rel=1e-6)
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-7)
    assert staged_loss == loss
    assert set(staged_grads) == set(grads)
    for name, grad in grads.items():
        assert torch.equal(staged_grads[name], grad), name

    for stage in stages + staged_stages:
        transport = stage.transport
        assert stage.device == stage.executor.device == torch.device("cpu")
        assert all(p.device == stage.device for p in stage.module.parameters())
        # activations and gradients (and the header) arrive in tensors on the stage's
        # device; every one of them was handed to the transport by the executor
        assert transport.public and all(t.device == stage.device for t in transport.public)
    for stage in staged_stages:                # everything went through host buffers
        transport = stage.transport
        assert len(transport.library) == len(transport.public)
        assert all(lib is not pub for lib, pub in zip(transport.library, transport.public))
    for stage in stages:                       # ... and nothing did on the direct path
        assert all(lib is pub for lib, pub in zip(stage.transport.library, stage.transport.public))


def test_stage_moves_its_module_and_batch_to_its_device():
    seen = []

    class Spy(TinyJob):
        def pipeline_input(self, batch):
            seen.append(batch[0].device)
            return batch[0]

    plan = make_plan(PipelineConfig(pp=1, microbatches=2), 1, 5, BATCH)
    grid = Grid(rank=0, pp=1, dp=1)
    module = build_stage(Spy().build_model, plan, 0, seed=11)
    stage = PipelineStage(Spy(), plan, grid, Loopback(0, 1, Mailbox()), module,
                          device=torch.device("cpu"))
    stats = stage.forward_backward(tiny_batch(), BATCH)
    stage.reduce()
    loss = stats.loss_sum
    assert seen == [torch.device("cpu")] * 2 and loss > 0
    assert all(p.grad.device == stage.device for p in module.parameters())


# -- the prepared GPU script, on CPU -------------------------------------------------------
@pytest.mark.timeout(300)
def test_gpu_check_script_runs_on_cpu():
    """The CPU-only mode compares plain CPU with CPU through the staging buffers over the
    real Gloo transport: every loss must agree exactly."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_pipeline_check.py"),
                           "--cpu-only", "--small", "--steps", "2", "--microbatches", "1,4",
                           "--threads", "1", "--deadline", "200"],
                          cwd=ROOT, capture_output=True, text=True, timeout=280)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "LOSS MATCH: PASS: 8 losses compared, max rel diff 0.00e+00" in out, out[-4000:]
    assert "trained params max rel diff 0.00e+00" in out
    assert '"leaked": []' in out
