"""Durable pipeline checkpoints that load under any other stage partition.

Replica 0's rank of every stage writes its own file, ``step-<N>/children-<a>-<b>.pt``
(model tensors under the full model's key names, optimizer state keyed by parameter
name, not by position). After a barrier, rank 0 atomically replaces ``latest.json``, which
names the step's folder, keeps the manifest it replaced as ``previous.json`` (with its
folder) and removes older folders. A crash before the rename leaves the previous
checkpoint in force; a folder is never half-referenced.

Files load with ``weights_only=True`` after a check of every record's CRC-32
(runtime/checkpoint.py): a corrupt or missing file is an error naming it, and saying how
to resume from the checkpoint before it.

Loading picks, from every file, the keys of this stage's children, so a job restarted
with fewer ranks and other stage boundaries (the supervisor's re-plan) resumes exactly.
Multi-host runs need ``checkpoint_dir`` on a filesystem every host sees.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from elastic.runtime.checkpoint import CheckpointError, load, save_atomic

MANIFEST = "latest.json"
PREVIOUS = "previous.json"


def stage_file(folder: Path, step: int, start: int, end: int) -> Path:
    return folder / f"step-{step:08d}" / f"children-{start:03d}-{end:03d}.pt"


def save_stage(folder: Path, step: int, children: tuple, module: nn.Module,
               optimizer: torch.optim.Optimizer) -> Path:
    by_param = {id(p): name for name, p in module.named_parameters()}
    state = {by_param[id(p)]: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
             for p, s in optimizer.state.items()}
    path = stage_file(folder, step, *children)
    save_atomic({"children": tuple(children), "step": step, "model": module.state_dict(),
                 "optimizer": state}, path)
    return path


def publish(folder: Path, step: int, stages: tuple, extra: dict) -> None:
    """Make step ``step`` the checkpoint in force (rank 0, after every stage saved); the
    one it replaces stays, as ``previous.json``, for a file of the new one found corrupt."""
    manifest = {"step": step, "folder": f"step-{step:08d}",
                "files": [stage_file(folder, step, a, b).name for a, b in stages], **extra}
    replaced = read_manifest(folder)
    if replaced is not None and replaced["folder"] != manifest["folder"]:
        _write_json(folder / PREVIOUS, replaced)
    else:
        replaced = None
    _write_json(folder / MANIFEST, manifest)
    keep = {manifest["folder"], replaced["folder"] if replaced else _kept_folder(folder)}
    for old in folder.glob("step-*"):
        if old.name not in keep:
            shutil.rmtree(old, ignore_errors=True)


def _kept_folder(folder: Path) -> str | None:
    try:
        return json.loads((folder / PREVIOUS).read_text())["folder"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_json(path: Path, value: dict) -> None:
    fd, tmp = tempfile.mkstemp(prefix=path.name, dir=path.parent)
    with os.fdopen(fd, "w") as handle:
        json.dump(value, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def read_manifest(folder: Path) -> dict | None:
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError as err:
        raise CheckpointError(f"pipeline checkpoint manifest {path} is not JSON ({err})"
                              f"{_previous_hint(folder)}") from None
    if not (isinstance(manifest, dict) and isinstance(manifest.get("folder"), str)
            and isinstance(manifest.get("files"), list) and isinstance(manifest.get("step"), int)):
        raise CheckpointError(f"pipeline checkpoint manifest {path} lacks step, folder or files"
                              f"{_previous_hint(folder)}")
    return manifest


def _previous_hint(folder: Path) -> str:
    kept = _kept_folder(folder)
    if kept is None or not (folder / kept).is_dir():
        return ""
    return (f"; the checkpoint before it is kept ({folder / kept}): copy {folder / PREVIOUS} "
            f"over {folder / MANIFEST} to resume from there")


def _load_file(folder: Path, path: Path) -> dict:
    try:
        saved = load(path)
    except CheckpointError as err:
        raise CheckpointError(f"pipeline {err}{_previous_hint(folder)}") from None
    if saved is None:
        raise CheckpointError(f"pipeline checkpoint file {path} is missing (named by "
                              f"{folder / MANIFEST}){_previous_hint(folder)}")
    return saved


def _mine(key: str, start: int, end: int) -> bool:
    return start <= int(key.split(".", 1)[0]) < end


def load_stage(folder: Path, children: tuple, module: nn.Module,
               optimizer: torch.optim.Optimizer | None) -> dict | None:
    """Load this stage's children from the checkpoint in force; return its manifest, or
    None when there is none."""
    manifest = read_manifest(folder)
    if manifest is None:
        return None
    start, end = children
    model, optim = {}, {}
    for name in manifest["files"]:
        a, b = (int(v) for v in name[len("children-"):-len(".pt")].split("-"))
        if a >= end or b <= start:
            continue
        saved = _load_file(folder, folder / manifest["folder"] / name)
        model.update({k: v for k, v in saved["model"].items() if _mine(k, start, end)})
        optim.update({k: v for k, v in saved["optimizer"].items() if _mine(k, start, end)})
    module.load_state_dict(model, strict=True)
    if optimizer is not None:
        for name, param in module.named_parameters():
            if name in optim:
                optimizer.state[param] = optim[name]
    return manifest


def load_full(folder: Path, model: nn.Module) -> dict | None:
    """The whole model from a pipeline checkpoint (for evaluation on one rank)."""
    return load_stage(folder, (0, len(model)), model, None)
