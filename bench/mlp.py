"""A communication-heavy job for the throughput bench and the in-flight kill test: a
~26M-parameter MLP (about 105 MB of float32 gradients per step) on a fixed synthetic
classification task, so the gradient allreduce, not the compute, dominates a step.

    python -m bench.mlp --steps 20
    regatta local mlp --module bench.mlp --hosts 2 --steps 40
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import regatta
from regatta import ConfigError

CONFIG = Path(__file__).with_name("mlp.toml")


@dataclass
class MLPConfig:
    inputs: int = 512
    width: int = 2048
    layers: int = 7          # Linear layers before the head: 512->2048, then 2048->2048
    classes: int = 16
    samples: int = 4096

    def __post_init__(self) -> None:
        for name in ("inputs", "width", "layers", "classes", "samples"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name} must be > 0, got {getattr(self, name)}")


class MLPJob:
    name = "mlp"

    def __init__(self, cfg: MLPConfig):
        self.cfg = cfg
        generator = torch.Generator().manual_seed(4321)   # data independent of the run's seed
        x = torch.randn(cfg.samples, cfg.inputs, generator=generator)
        teacher = torch.randn(cfg.inputs, cfg.classes, generator=generator)
        y = (x @ teacher).argmax(1)
        cut = cfg.samples * 7 // 8
        self.train, self.test = (x[:cut], y[:cut]), (x[cut:], y[cut:])

    def build_model(self) -> nn.Module:
        cfg, layers = self.cfg, []
        for index in range(cfg.layers):
            layers += [nn.Linear(cfg.inputs if index == 0 else cfg.width, cfg.width), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(cfg.width, cfg.classes))

    def train_data(self) -> tuple[torch.Tensor, ...]:
        return self.train

    def loss_sum(self, model, batch):
        x, y = batch
        return nn.functional.cross_entropy(model(x), y, reduction="sum"), len(y)

    @torch.no_grad()
    def evaluate(self, model) -> dict[str, float]:
        model.eval()
        x, y = self.test
        logits = model(x)
        return {"accuracy": (logits.argmax(1) == y).float().mean().item(),
                "test_loss": nn.functional.cross_entropy(logits, y).item()}


def parse_config(argv: list[str] | None = None) -> dict:
    return regatta.config({"model": MLPConfig}, argv, toml=str(CONFIG))


def main(argv: list[str] | None = None) -> dict:
    config = parse_config(argv)
    return regatta.train(MLPJob(config["model"]), config)


if __name__ == "__main__":
    main()
