"""Which device a rank computes on: the one place both engines ask."""
from __future__ import annotations

import torch

from elastic.config import ConfigError


def wants_cpu(request: str | None) -> bool:
    """Whether ``request`` (as :func:`choose_device` takes it) means the CPU; an invalid
    one is :func:`choose_device`'s to name."""
    text = (request or "cpu").strip().lower()
    return text == "cpu" or (text == "auto" and not torch.cuda.is_available())


def choose_device(request: str | None = None, local_rank: int = 0) -> torch.device:
    """``request``: ``cpu``, ``cuda`` (this rank's GPU), ``cuda:N``, or ``auto`` (cuda when
    available, else cpu); empty means cpu, so no run changes device unasked
    (``REGATTA_DEVICE`` or ``train.device`` ask). This rank's GPU is
    ``cuda:<local_rank % device count>``: one GPU per process on a multi-GPU host."""
    text = (request or "cpu").strip().lower()
    if text == "auto":
        text = "cuda" if torch.cuda.is_available() else "cpu"
    if text == "cpu":
        return torch.device("cpu")
    if text == "cuda" or text.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ConfigError(f"device {text!r} asked for, but torch {torch.__version__} "
                              f"sees no CUDA device; use cpu or auto")
        if text != "cuda":
            try:
                index = int(text.split(":", 1)[1])
            except ValueError:
                raise ConfigError(f"device {text!r}: expected cuda:N") from None
            if not 0 <= index < torch.cuda.device_count():
                raise ConfigError(f"device {text!r}, but only {torch.cuda.device_count()} "
                                  f"CUDA devices are visible")
            return torch.device("cuda", index)
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    raise ConfigError(f"device must be cpu, cuda, cuda:N or auto, got {text!r}")
