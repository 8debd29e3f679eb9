"""examples/files_cnn.py as a test runs it: the same parts, plus a record of which sample
ids each rank consumed at each step and a dump of the first steps' reduced gradients.

    regatta local tests/workers/files_cnn_worker.py --hosts 3 ... -- --set data.folder=DIR \
        --set probe.out=OUT
    python tests/workers/files_cnn_worker.py --steps 2 --set probe.out=OUT   # the reference
"""
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import regatta  # noqa: E402
from examples.files_cnn import DataConfig, loss_fn, parts  # noqa: E402


@dataclass
class ProbeConfig:
    out: str = ""
    grad_steps: int = 2        # dump the reduced gradients of this many first steps (rank 0)


class RecordLoaderWorker:
    """A worker_init_fn of the user's own (Regatta's runs before it): each loader worker
    start, with the training process it serves."""

    def __init__(self, out: Path):
        self.path = out / "loader-workers.jsonl"

    def __call__(self, worker_id: int) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "rank_pid": os.getppid(), "worker": worker_id}) + "\n")


def main() -> None:
    configs = regatta.config({"data": DataConfig, "probe": ProbeConfig}, defaults={"train": {
        "global_batch": 32, "lr": 0.003, "accumulate": 2, "clip_grad_norm": 1.0,
        "loader_workers": 2}})
    out = Path(configs["probe"].out)
    out.mkdir(parents=True, exist_ok=True)
    pieces = parts(configs)
    log = open(out / f"ids-{os.getpid()}.jsonl", "a", buffering=1)

    def recording_loss(model, batch):
        ctx = regatta.context()
        log.write(json.dumps({"step": ctx.step, "generation": ctx.world.generation,
                              "rank": ctx.world.rank, "ids": batch[2].tolist()}) + "\n")
        return loss_fn(model, batch)

    def dump_gradients(optimizer, args, kwargs):
        ctx = regatta.context()
        if ctx.world.rank == 0 and ctx.world.generation == 0 and ctx.step < configs["probe"].grad_steps:
            grads = {n: p.grad.clone() for n, p in pieces["model"].named_parameters()}
            torch.save(grads, out / f"grads-step{ctx.step}.pt")

    pieces["optimizer"].register_step_pre_hook(dump_gradients)
    regatta.fit(**{**pieces, "loss": recording_loss}, loader={"worker_init_fn": RecordLoaderWorker(out)},
                config=configs, name="files_cnn")


if __name__ == "__main__":
    main()
