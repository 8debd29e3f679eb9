"""Durable checkpoints: a commit written to disk so a whole-job restart can resume.

Written atomically (temporary file, fsync, rename, fsync of the directory) so a crash
mid-write leaves the previous checkpoint intact, never a torn file.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import torch


def save_atomic(payload: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def parameter_hash(model: torch.nn.Module) -> str:
    """A short digest of every tensor of ``model`` by name: equal on two ranks (or a
    pipeline's reassembled stages) exactly when their parameters are bit for bit equal."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def load(path: Path) -> dict | None:
    """The checkpoint at ``path``, or None when there is none."""
    if not path.exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=False)
