"""One rank of bench_state: measures the elastic state operations of one flavour on a
model of a given size, and writes what it measured as JSON (rank 0 also the step times).

    horovodrun --gloo -np 3 -H localhost:3 python -m bench.state_worker \
        --flavour regatta --params 10000000 --out /tmp/state-regatta.json

* stock: Horovod's ``hvd.elastic.TorchState`` over a ``DistributedOptimizer`` (Adam),
  committed with ``state.save()``; after a failure Horovod runs ``restore()`` then, after
  the reset, ``sync()``; a durable checkpoint is rank 0's ``torch.save`` in the loop.
* regatta: the data-parallel engine inside Regatta's runtime (its own step, sharded
  commits, background checkpoints); a restore is ``restore_committed()`` then the sync:
  the survivors agree their live states match and go on from them (nothing restored).
* regatta-commit: the same with ``train.recover_from = "commit"``: every restore goes back
  to the last commit, reassembled from the shares the ranks hold.

A new worker's sync is simulated in a fixed world: one rank (the last) gives up its state
(it goes back to the commit, and holds no live state), so the whole state travels to it
as it would to a newcomer: for regatta a stripe from each other rank's live state, for
regatta-commit from the commit's shares, for stock Horovod's broadcast from rank 0.
The commit's memory is RSS after ``malloc_trim`` (so freed pages are not counted), on
every rank, before and after the first commit (stock: ``TorchState(...)``, which saves;
regatta: the first sync, which places the shares and commits), both after two steps so
that Adam's moments exist. At the end each rank reports its high-water mark (VmHWM), the
shared memory it maps for checkpoint snapshots and its checkpoint writer process's own
memory (rank 0's: USS and VmHWM). Step times are rank 0's. Each checkpoint round is
``--steps`` steps with no write in flight, the checkpoint, then every step while its
background write is in flight (stock: none, its write is in the loop); each is followed by
its control, the same round with nothing written (A/B, A/B, ...), so that the bias of
comparing a round's later steps with its first shows and is divided out.

The newcomer's transfer (regatta: the bytes it received over the seconds they took, from
the sync's own account) is held against a bound measured in the same job: one TCP
stream over loopback from rank 0 to the last rank (the link Gloo's connections use here),
GB/s, times the senders the machine can run at once (a core for each sender beside the
receiver's: ``min(senders, cores - 1)``, at least 1).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import horovod.torch as hvd
import psutil
import torch
from torch import nn

LIBC = ctypes.CDLL("libc.so.6")
GLOBAL_BATCH = 24        # samples per step over all ranks (dp = 2 and 3 both divide it)
WIDTH = {10_000_000: 1000, 100_000_000: 3160, 300_000_000: 5477}
MAX_WRITING_STEPS = 100   # a bound on a round whose write never ends


def rss() -> int:
    LIBC.malloc_trim(0)
    return psutil.Process().memory_info().rss


class MlpJob:
    """An MLP of ``layers`` square layers, about ``params`` parameters, regressing noise."""
    name = "bench_state"

    def __init__(self, params: int, layers: int = 10, samples: int = 240):
        self.width = WIDTH.get(params) or int((params / layers) ** 0.5)
        self.layers = layers
        generator = torch.Generator().manual_seed(0)
        self.data = (torch.randn(samples, self.width, generator=generator),
                     torch.randn(samples, self.width, generator=generator))

    def build_model(self) -> nn.Module:
        return nn.Sequential(*[nn.Linear(self.width, self.width) for _ in range(self.layers)])

    def train_data(self):
        return self.data

    def loss_sum(self, model, batch):
        x, y = batch
        return nn.functional.mse_loss(model(x), y, reduction="sum"), len(x)

    def evaluate(self, model) -> dict:
        return {}


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


class Stock:
    def __init__(self, job: MlpJob, folder: Path):
        torch.manual_seed(0)
        self.model = job.build_model()
        self.optimizer = hvd.DistributedOptimizer(torch.optim.Adam(self.model.parameters(), lr=1e-4),
                                                  named_parameters=self.model.named_parameters())
        self.job, self.path, self.step_count = job, folder / "stock.pt", 0
        self.state = None

    def step(self) -> None:
        x, y = self.job.data
        share = GLOBAL_BATCH // hvd.size()
        start = (self.step_count * GLOBAL_BATCH + hvd.rank() * share) % (len(x) - share)
        self.optimizer.zero_grad()
        loss, _ = self.job.loss_sum(self.model, (x[start:start + share], y[start:start + share]))
        loss.backward()
        self.optimizer.step()
        self.step_count += 1

    def first_commit(self) -> None:
        self.state = hvd.elastic.TorchState(model=self.model, optimizer=self.optimizer, step=0)

    def commit(self) -> None:
        self.state.save()

    def restore(self, me: bool, newcomer: bool = False) -> dict:
        if me:
            self.state.restore()
        self.state.sync()
        return {}

    def checkpoint(self) -> None:
        if hvd.rank() == 0:
            with open(self.path, "wb") as handle:
                torch.save({"model": self.model.state_dict(),
                            "optimizer": self.optimizer.state_dict()}, handle)
                handle.flush()
                os.fsync(handle.fileno())

    def writing(self) -> bool:
        return False

    def written(self) -> dict:
        return {}

    def wait(self) -> None:
        pass


class Regatta:
    def __init__(self, job: MlpJob, folder: Path, recover_from: str = "live"):
        from elastic.config import TrainConfig
        from elastic.dataparallel.engine import DataParallelEngine
        from elastic.runtime.control import Pending
        from elastic.runtime.env import Env
        from elastic.runtime.worker import Runtime
        from elastic.training import from_job
        cfg = TrainConfig(steps=10 ** 6, global_batch=GLOBAL_BATCH, lr=1e-4,
                          run_dir=str(folder / "run"), db=str(folder / "m.db"), progress=False,
                          recover_from=recover_from)
        self.runtime = Runtime(Env.read(), cfg, job.name, {})
        self.engine = DataParallelEngine(from_job(job), cfg)
        self.runtime.init(self.engine)
        self.state = self.runtime.state = self.engine.build(self.runtime)
        self.engine.enter(self.state)
        self.pending = Pending()

    @property
    def model(self):
        return self.state.model

    def step(self) -> None:
        self.engine.step(self.state, self.pending)

    def first_commit(self) -> None:
        self.state.sync()

    def commit(self) -> None:
        self.state.save()

    def restore(self, me: bool, newcomer: bool = False) -> dict:
        cfg = self.runtime.cfg
        configured = cfg.recover_from
        if newcomer:
            cfg.recover_from = "commit"    # this rank goes back to the commit: no live state
        if me:
            self.state.restore_committed()
        detail = self.state.sync_state()
        cfg.recover_from = configured
        self.engine.enter(self.state)      # the loader restarts from the restored cursor
        return detail

    def checkpoint(self) -> None:
        self.runtime.checkpoint(self.state)

    def writing(self) -> bool:
        return self.runtime.writing is not None and not self.runtime.writing.done()

    def written(self) -> dict:
        return self.runtime.writing.result() if self.runtime.writing is not None else {}

    def wait(self) -> None:
        if self.runtime.writing is not None:
            self.runtime.writing.hurry()     # paced to land before the next checkpoint
            self.runtime.writing.result()


def measure(flavour, repeats: int, steps: int) -> dict:
    out = {"rank": hvd.rank(), "size": hvd.size()}
    for _ in range(2):
        flavour.step()       # Adam's moments exist from here on
    for param in flavour.model.parameters():
        param.grad = None    # as a restore leaves them: not counted for either flavour
    before = rss()
    flavour.first_commit()
    out["commit_rss"] = rss() - before
    out["commit_s"], out["restore_s"], out["sync_new_s"], out["newcomer"] = [], [], [], []
    for _ in range(repeats):
        flavour.step()
        hvd.allreduce(torch.zeros(1), name="bench.barrier")
        out["commit_s"].append(timed(flavour.commit))
        flavour.step()
        out["restore_s"].append(timed(lambda: flavour.restore(True)))
        last = hvd.rank() == hvd.size() - 1
        detail = {}
        out["sync_new_s"].append(timed(lambda: detail.update(flavour.restore(last, newcomer=last))))
        if last and detail.get("transfer_s"):
            senders = detail.get("senders") or {owner for owner, _, _ in detail.get("parts", [])}
            out["newcomer"].append({"bytes": detail["moved_bytes"], "seconds": detail["transfer_s"],
                                    "senders": len(senders)})
    out["plain_s"], out["writing_s"], out["checkpoint_s"], out["write_s"] = [], [], [], []
    out["control_plain_s"], out["control_after_s"] = [], []
    for _ in range(repeats):
        write_round(flavour, steps, out)
        # The control (B after A): the same round with nothing written, as many steps after
        # as the write overlapped, so what the method itself does to the second half shows
        out["control_plain_s"].append([timed(flavour.step) for _ in range(steps)])
        hvd.allreduce(torch.zeros(1), name="bench.barrier")
        after = max(len(out["writing_s"][-1]), steps)
        out["control_after_s"].append([timed(flavour.step) for _ in range(after)])
        hvd.allreduce(torch.zeros(1), name="bench.barrier")
    out.update(memory_at_end())
    return out


def write_round(flavour, steps: int, out: dict) -> None:
    """Plain steps, the checkpoint, then every step while its write is in flight."""
    out["plain_s"].append([timed(flavour.step) for _ in range(steps)])   # no write in flight
    out["checkpoint_s"].append(timed(flavour.checkpoint))
    out["writing_s"].append([])
    # Every step the write overlaps is measured, however long the pacing spreads it;
    # rank 0 alone knows, and says so outside the timed step.
    while hvd.broadcast_object(flavour.writing(), root_rank=0, name="bench.writing"):
        out["writing_s"][-1].append(timed(flavour.step))
        if len(out["writing_s"][-1]) >= MAX_WRITING_STEPS:
            break
    flavour.wait()
    hvd.allreduce(torch.zeros(1), name="bench.barrier")
    out["write_s"].append(flavour.written().get("write_s", out["checkpoint_s"][-1]))


def p2p_gbps(nbytes: int = 256 << 20, repeats: int = 3) -> list[float]:
    """GB/s of one TCP stream over loopback from rank 0 to the last rank, ``repeats``
    times ``nbytes`` (on those two ranks; an empty list elsewhere)."""
    last = hvd.size() - 1
    listener = None
    if hvd.rank() == 0:
        listener = socket.create_server(("127.0.0.1", 0))
    port = hvd.broadcast_object(listener.getsockname()[1] if listener else None, name="bench.p2p.port")
    rates = []
    if hvd.rank() in (0, last) and last > 0:
        buffer = bytearray(nbytes)    # touched, so page faults are not timed
        if hvd.rank() == 0:
            peer, _ = listener.accept()
            with peer:
                for _ in range(repeats):
                    peer.sendall(buffer)
                    peer.recv(1)       # the receiver has it all
        else:
            with socket.create_connection(("127.0.0.1", port)) as peer:
                view = memoryview(buffer)
                for _ in range(repeats):
                    started, got = time.perf_counter(), 0
                    while got < nbytes:
                        got += peer.recv_into(view[got:])
                    rates.append(nbytes / (time.perf_counter() - started) / 1e9)
                    peer.sendall(b"k")
    if listener is not None:
        listener.close()
    hvd.allreduce(torch.zeros(1), name="bench.p2p.done")
    return rates


def memory_at_end() -> dict:
    """This process's high-water mark (VmHWM: its peak resident memory, shared-memory pages
    it touched included), the shared memory it maps for checkpoint snapshots, and what its
    checkpoint writer process holds on its own (USS: pages no other process maps) and at
    its peak."""
    hwm = int(next(line for line in Path("/proc/self/status").read_text().splitlines()
                   if line.startswith("VmHWM:")).split()[1]) * 1024
    snapshot = 0
    for line in Path("/proc/self/maps").read_text().splitlines():
        if "memfd:regatta-checkpoint" in line:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            snapshot += end - start
    writer_uss = writer_hwm = 0
    for child in psutil.Process().children(recursive=True):
        if any("checkpoint_writer" in part for part in child.cmdline()):
            writer_uss += child.memory_full_info().uss
            status = Path(f"/proc/{child.pid}/status").read_text().splitlines()
            writer_hwm += int(next(l for l in status if l.startswith("VmHWM:")).split()[1]) * 1024
    return {"peak_rss": hwm, "snapshot_bytes": snapshot, "writer_uss": writer_uss, "writer_hwm": writer_hwm}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavour", choices=["stock", "regatta", "regatta-commit"], required=True)
    parser.add_argument("--params", type=int, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="steps without a write per checkpoint round")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    job = MlpJob(args.params)
    with tempfile.TemporaryDirectory(prefix="bench-state-") as folder:
        if args.flavour == "stock":
            flavour = Stock(job, Path(folder))
        else:
            flavour = Regatta(job, Path(folder), "commit" if args.flavour == "regatta-commit" else "live")
        p2p = p2p_gbps()
        out = measure(flavour, args.repeats, args.steps)
        out["p2p_gbps"], out["cores"] = p2p, os.cpu_count()
        out["params"] = sum(p.numel() for p in flavour.model.parameters())
        if args.flavour != "stock":
            flavour.runtime.close()
    everyone = hvd.allgather_object(out, name="bench.results")
    if hvd.rank() == 0:
        Path(args.out).write_text(json.dumps(everyone))
    print(f"rank {hvd.rank()}: commit p50 {statistics.median(out['commit_s']):.3f} s", flush=True)


if __name__ == "__main__":
    main()
