"""Durable checkpoints: a commit written to disk so a whole-job restart can resume.

Written atomically (temporary file, fsync, rename, fsync of the directory) so a crash
mid-write leaves the previous checkpoint intact, never a torn file; the one it replaces
stays beside it as ``<name>.previous<suffix>`` (a hard link, no copy), so a file damaged
later still leaves one to fall back on. Read back with ``weights_only=True``: a
checkpoint holds tensors and plain values only, so loading one never runs code from the
file. checkpoint_writer.py writes them in the background.
"""
from __future__ import annotations

import hashlib
import os
import pickle
import tempfile
import zipfile
from pathlib import Path

import torch

from .direct_file import DirectFile, Pace


class CheckpointError(RuntimeError):
    """A checkpoint file exists but cannot be used; the message names the file and why."""


def previous_path(path: Path) -> Path:
    return path.with_name(f"{path.stem}.previous{path.suffix}")


def save_atomic(payload: dict, path: Path, keep_previous: bool = False, pace: Pace | None = None) -> int:
    """Write ``payload`` to ``path`` atomically; the bytes written. ``keep_previous``: the
    checkpoint it replaces stays as ``previous_path(path)``; ``pace``: spread the write."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # One write at a time per checkpoint: a temporary already there is a killed writer's.
    for stale in path.parent.glob(f"{path.name}.*.tmp*"):
        stale.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        try:
            handle = DirectFile(fd, pace)
            torch.save(payload, handle)
            size = handle.finish()
        finally:
            os.close(fd)
        if keep_previous and path.exists():
            # Link, then rename over the old previous: ``path`` itself never goes missing.
            link = Path(tmp + ".previous")
            os.link(path, link)
            os.replace(link, previous_path(path))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        Path(tmp + ".previous").unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return size


def load(path: Path, expect: str | None = None) -> dict | None:
    """The checkpoint at ``path``, or None when there is none. ``expect``: the ``format``
    the file must declare (a checkpoint of another engine or program is refused)."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        _check_records(path)
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, zipfile.BadZipFile, EOFError, RuntimeError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path} is corrupt or not a Regatta checkpoint "
                              f"({type(err).__name__}: {str(err).splitlines()[0][:200]})"
                              f"{_fallback_hint(path)}") from None
    if not isinstance(saved, dict) or (expect and saved.get("format") != expect):
        found = saved.get("format") if isinstance(saved, dict) else type(saved).__name__
        raise CheckpointError(f"checkpoint {path} has format {found!r}, expected {expect!r}"
                              f"{_fallback_hint(path)}")
    return saved


def _check_records(path: Path) -> None:
    """torch.save stores a CRC-32 of every record but torch.load never checks it, so a
    flipped bit inside a tensor would load silently: check them all here."""
    with zipfile.ZipFile(path) as archive:
        bad = archive.testzip()
    if bad is not None:
        raise ValueError(f"record {bad} fails its CRC-32 check")


def _fallback_hint(path: Path) -> str:
    previous = previous_path(path)
    if not previous.exists():
        return ""
    return (f"; the checkpoint before it is kept as {previous}: move it to {path} to resume "
            f"from there")


def parameter_hash(model: torch.nn.Module) -> str:
    """A short digest of every tensor of ``model`` by name: equal on two ranks (or a
    pipeline's reassembled stages) exactly when their parameters are bit for bit equal."""
    return state_hash(model.state_dict())


def state_hash(state: dict) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(state.items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]
