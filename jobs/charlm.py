"""Character-level transformer language model on the documentation text that ships with
Python itself (``pydoc_data.topics``, about 465k characters): real text, no download.

    python -m jobs.charlm
    mpirun -np 2 --hostfile hostfiles/localhost.txt python -m jobs.charlm
    horovodrun -np 2 --min-np 1 --max-np 4 --host-discovery-script \
        "hostfiles/discover.sh hostfiles/hosts.txt" python -m jobs.charlm
    mpirun -np 4 --hostfile hostfiles/pipeline.txt python -m jobs.charlm \
        --pp 2 --dp 2 --schedule 1f1b --microbatches 8        # dp x pp pipeline

The model is an ``nn.Sequential`` (embedding, blocks, head) so a pipeline can cut it
between any two of its children.
"""
from __future__ import annotations

import math
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import regatta
from regatta import ConfigError


@dataclass
class CharLMConfig:
    context: int = 64
    dim: int = 96
    heads: int = 4
    layers: int = 3
    dropout: float = 0.0
    test_fraction: float = 0.1

    def __post_init__(self) -> None:
        for name in ("context", "dim", "heads", "layers"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name} must be > 0, got {getattr(self, name)}")
        if self.dim % self.heads:
            raise ConfigError(f"model.dim ({self.dim}) must be divisible by model.heads ({self.heads})")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if not 0 < self.test_fraction < 1:
            raise ConfigError(f"model.test_fraction must be in (0, 1), got {self.test_fraction}")


def corpus() -> str:
    from pydoc_data.topics import topics
    return "\n".join(topics[key] for key in sorted(topics))


class Embed(nn.Module):
    def __init__(self, vocab: int, cfg: CharLMConfig):
        super().__init__()
        self.tokens = nn.Embedding(vocab, cfg.dim)
        self.positions = nn.Embedding(cfg.context, cfg.dim)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))


class Block(nn.Module):
    def __init__(self, cfg: CharLMConfig):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        self.attn = nn.MultiheadAttention(cfg.dim, cfg.heads, dropout=cfg.dropout, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(),
                                 nn.Linear(4 * cfg.dim, cfg.dim), nn.Dropout(cfg.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        causal = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device), 1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    def __init__(self, vocab: int, cfg: CharLMConfig):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.dim)
        self.out = nn.Linear(cfg.dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


class CharLMJob:
    name = "charlm"

    def __init__(self, cfg: CharLMConfig):
        self.cfg = cfg
        text = corpus()
        self.vocab = sorted(set(text))
        lookup = {c: i for i, c in enumerate(self.vocab)}
        encoded = torch.tensor([lookup[c] for c in text], dtype=torch.long)
        window = cfg.context + 1
        samples = encoded[: len(encoded) // window * window].view(-1, window)
        n_test = max(1, int(len(samples) * cfg.test_fraction))
        self.train, self.test = samples[:-n_test], samples[-n_test:]
        counts = Counter(text)
        self.unigram_loss = -sum(n / len(text) * math.log(n / len(text)) for n in counts.values())

    def build_model(self) -> nn.Sequential:
        vocab = len(self.vocab)
        return nn.Sequential(Embed(vocab, self.cfg), *[Block(self.cfg) for _ in range(self.cfg.layers)],
                             Head(vocab, self.cfg))

    def train_data(self) -> tuple[torch.Tensor, ...]:
        return (self.train,)

    def loss_sum(self, model, batch):
        (windows,) = batch
        return self.loss_on_logits(model(windows[:, :-1]), windows), windows[:, 1:].numel()

    # -- what a pipeline needs (elastic/pipeline/stage.py PipelineJob) --
    def pipeline_input(self, batch) -> torch.Tensor:
        return batch[0][:, :-1]

    def pipeline_loss(self, logits: torch.Tensor, batch) -> torch.Tensor:
        return self.loss_on_logits(logits, batch[0])

    def loss_count(self, batch) -> int:
        return batch[0][:, 1:].numel()

    @staticmethod
    def loss_on_logits(logits: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           windows[:, 1:].reshape(-1), reduction="sum")

    @torch.no_grad()
    def evaluate(self, model) -> dict[str, float]:
        model.eval()
        windows = self.test[:256]
        loss = self.loss_on_logits(model(windows[:, :-1]), windows).item() / windows[:, 1:].numel()
        return {"test_loss": loss, "unigram_loss": self.unigram_loss,
                "bits_per_char": loss / math.log(2)}


PIPELINE_FLAGS = {"pp": ("pipeline.pp", int), "dp": ("pipeline.dp", int),
                  "schedule": ("pipeline.schedule", str),
                  "microbatches": ("pipeline.microbatches", int),
                  "boundaries": ("pipeline.boundaries", str),
                  "transport": ("pipeline.transport", str)}


def parse_config(argv: list[str] | None = None) -> dict:
    return regatta.config({"model": CharLMConfig, "pipeline": regatta.PipelineConfig,
                           "planner": regatta.PlannerConfig}, argv,
                          toml=str(Path(__file__).with_suffix(".toml")), flags=PIPELINE_FLAGS)


def pipeline_job(argv: list[str] | None = None) -> tuple:
    """(job, train, pipeline, planner configs) from a command line (for ``regatta plan``)."""
    config = parse_config(argv)
    return CharLMJob(config["model"]), config["train"], config["pipeline"], config["planner"]


def main(argv: list[str] | None = None) -> dict:
    config = parse_config(argv)
    try:
        return regatta.train(CharLMJob(config["model"]), config)
    except ConfigError as err:   # a pipeline plan that does not fit this world: not worth a retry
        print(f"config error: {err}", file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    main()
