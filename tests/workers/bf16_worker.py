"""Training with bfloat16 parameters, and with bf16 autocast over float32 parameters, on
whatever world the launcher made; writes each rank's results.

    mpirun -np 2 python tests/workers/bf16_worker.py OUT_DIR
"""
import json
import sys
from pathlib import Path

import torch
from torch import nn

import regatta
from regatta import TrainConfig


def data():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=generator)
    return x, (x[:, :4].sum(1) > 0).long()


def one(out: Path, name: str, dtype: torch.dtype, autocast: str) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2)).to(dtype)
    x, y = data()
    losses = []
    config = TrainConfig(steps=40, global_batch=32, lr=0.01, optimizer="adamw", autocast=autocast,
                         run_dir=str(out / name), db=str(out / "m.db"), progress=False,
                         commit_every=10, checkpoint_every=2)
    result = regatta.fit(model=model, data=(x.to(dtype), y),
                         loss=lambda m, b: nn.functional.cross_entropy(m(b[0]).float(), b[1]),
                         config=config, name=name, callbacks=[lambda r: losses.append(r["loss"])])
    return {"losses": losses, "param_hash": result["param_hash"],
            "dtypes": sorted({str(p.dtype) for p in model.parameters()})}


def main(out: Path) -> None:
    results = {"bf16_params": one(out, "bf16_params", torch.bfloat16, ""),
               "bf16_autocast": one(out, "bf16_autocast", torch.float32, "bf16")}
    import horovod.torch as hvd
    (out / f"rank{hvd.rank()}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
