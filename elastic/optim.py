"""The optimizer a job gets from ``train.optimizer`` when it does not bring its own."""
from __future__ import annotations

import torch


def make_optimizer(params, cfg) -> torch.optim.Optimizer:
    """``params``: a module's parameters (a whole model, or one pipeline stage's)."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr)
    return torch.optim.Adam(params, lr=cfg.lr)
