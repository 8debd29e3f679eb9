"""A user's script that logs scalars of its own: a callback passed to ``regatta.fit`` logs
twice the step's loss with ``regatta.log`` every step, and ``train.eval_every`` logs the
evaluation as ``eval/<metric>``. Writes what it logged and what evaluate returned to
OUT_JSON, for the test to compare with what the store and the dashboard show.

    python tests/workers/log_worker.py OUT_JSON --steps 30 --db M.DB --run-dir DIR
"""
import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import regatta


def main(out: Path, argv: list[str]) -> None:
    configs = regatta.config(argv=argv, defaults={"train": {
        "steps": 30, "global_batch": 32, "lr": 0.05, "eval_every": 10, "commit_every": 10}})
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=generator)
    y = (x[:, :2].sum(1) > 0).long()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    logged, evaluated = [], []

    def log_double_loss(record: dict) -> None:
        value = 2 * record["loss"]
        regatta.log({"train/double_loss": value})    # at the current step
        logged.append({"step": regatta.context().step, "value": value})

    @torch.no_grad()
    def evaluate(model) -> dict:
        result = {"accuracy": (model(x).argmax(1) == y).float().mean().item(),
                  "loss": F.cross_entropy(model(x), y).item()}
        evaluated.append({"step": regatta.context().step, **result})
        return result

    regatta.fit(model=model, data=(x, y), loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                evaluate=evaluate, config=configs, name="log_worker", callbacks=[log_double_loss])
    out.write_text(json.dumps({"logged": logged, "evaluated": evaluated}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
