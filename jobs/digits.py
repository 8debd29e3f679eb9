"""Handwritten-digit classifier on scikit-learn's bundled 8x8 digits (no download).

    python -m jobs.digits                                   # one process
    mpirun -np 2 --hostfile hostfiles/localhost.txt python -m jobs.digits
    horovodrun -np 2 --min-np 1 --max-np 4 --host-discovery-script \
        "hostfiles/discover.sh hostfiles/hosts.txt" python -m jobs.digits
"""
from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

import regatta
from regatta import ConfigError


@dataclass
class DigitsConfig:
    hidden: int = 128
    dropout: float = 0.1
    test_fraction: float = 0.25
    # Accelerator time to simulate per step on a CPU-only machine: a sleep the rank
    # spends "waiting for the GPU". Tests use it so that per-rank compute times are not
    # dominated by how the OS shares too few cores among the ranks.
    simulated_compute_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.hidden <= 0:
            raise ConfigError(f"model.hidden must be > 0, got {self.hidden}")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if not 0 < self.test_fraction < 1:
            raise ConfigError(f"model.test_fraction must be in (0, 1), got {self.test_fraction}")
        if self.simulated_compute_ms < 0:
            raise ConfigError(f"model.simulated_compute_ms must be >= 0, got {self.simulated_compute_ms}")


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """(images, labels): scikit-learn's bundled digits, read from its data file without
    importing scikit-learn, whose import (scipy with it) costs more than a second per
    process here, in every launch's warm-up. Falls back to scikit-learn's loader if the
    file is not where scikit-learn keeps it."""
    package = importlib.util.find_spec("sklearn")
    csv = Path(package.submodule_search_locations[0], "datasets", "data", "digits.csv.gz") \
        if package and package.submodule_search_locations else None
    if csv is None or not csv.is_file():
        from sklearn.datasets import load_digits as load
        bunch = load()
        return bunch.data, bunch.target
    table = np.loadtxt(csv, delimiter=",")
    return table[:, :-1], table[:, -1].astype(int)


class DigitsJob:
    name = "digits"

    def __init__(self, cfg: DigitsConfig):
        self.cfg = cfg
        images, labels = load_digits()
        x = torch.tensor(images, dtype=torch.float32) / 16.0
        y = torch.tensor(labels, dtype=torch.long)
        # A fixed split, independent of the training seed, so runs compare.
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(1234))
        n_test = int(len(x) * cfg.test_fraction)
        self.test = (x[order[:n_test]], y[order[:n_test]])
        self.train = (x[order[n_test:]], y[order[n_test:]])

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(64, self.cfg.hidden), nn.ReLU(), nn.Dropout(self.cfg.dropout),
                             nn.Linear(self.cfg.hidden, self.cfg.hidden), nn.ReLU(),
                             nn.Linear(self.cfg.hidden, 10))

    def train_data(self) -> tuple[torch.Tensor, ...]:
        return self.train

    def loss_sum(self, model, batch):
        x, y = batch
        if self.cfg.simulated_compute_ms:
            time.sleep(self.cfg.simulated_compute_ms / 1000)
        return nn.functional.cross_entropy(model(x), y, reduction="sum"), len(y)

    @torch.no_grad()
    def evaluate(self, model) -> dict[str, float]:
        model.eval()
        x, y = self.test
        logits = model(x)
        return {"accuracy": (logits.argmax(1) == y).float().mean().item(),
                "test_loss": nn.functional.cross_entropy(logits, y).item()}


def main(argv: list[str] | None = None) -> dict:
    config = regatta.config({"model": DigitsConfig}, argv, toml=str(Path(__file__).with_suffix(".toml")))
    return regatta.train(DigitsJob(config["model"]), config)


if __name__ == "__main__":
    main()
