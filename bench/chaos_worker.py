"""What bench_chaos trains under faults: the digits classifier through Regatta's public
API, each rank writing down the sample ids it consumed at each step, so the bench can
check that no sample was skipped or repeated across every recovery.

    regatta local bench/chaos_worker.py --hosts 4 --steps 2000 -- --set probe.out=DIR
"""
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import regatta  # noqa: E402
from jobs.digits import DigitsConfig, DigitsJob  # noqa: E402


@dataclass
class ProbeConfig:
    out: str = ""


def main() -> None:
    configs = regatta.config({"model": DigitsConfig, "probe": ProbeConfig},
                             defaults={"train": {"global_batch": 64, "lr": 0.001}})
    job = DigitsJob(configs["model"])
    x, y = job.train
    ids = torch.arange(len(x))          # the sample ids ride along with each batch
    out = Path(configs["probe"].out or configs["train"].run_dir) / "ids"
    out.mkdir(parents=True, exist_ok=True)
    (out / "dataset_size").write_text(str(len(x)))
    log = open(out / f"ids-{os.getpid()}.jsonl", "a", buffering=1)

    def loss(model, batch):
        images, labels, taken = batch
        ctx = regatta.context()
        log.write(json.dumps({"step": ctx.step, "t": time.time(), "rank": ctx.world.rank,
                              "size": ctx.world.size, "ids": taken.tolist()}) + "\n")
        if job.cfg.simulated_compute_ms:
            time.sleep(job.cfg.simulated_compute_ms / 1000)
        return F.cross_entropy(model(images), labels)

    torch.manual_seed(configs["train"].seed)
    regatta.fit(model=job.build_model(), data=(x, y, ids), loss=loss, evaluate=job.evaluate,
                config=configs, name="chaos")


if __name__ == "__main__":
    main()
