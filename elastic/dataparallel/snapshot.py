"""A data-parallel commit held in shares, and its reassembly from the ranks that hold them.

Replicas hold identical states, so a commit needs no communication: each rank copies,
from its own live state, the byte ranges placement gives it (runtime/shards.py: its own
share of the flat state, runtime/flat.py, and its buddy's) into host memory (pinned for a
CUDA model). With dp ranks that is 2/dp of the state per rank instead of all of it.

``send_to`` rebuilds the whole state on the ranks that need it (survivors after a
failure, new workers) from any set of parts that covers it: each part goes from its owner
to each of those ranks alone, point to point over the world's torch.distributed group,
straight from the holder's tensors (or held buffer) into the live tensors (a survivor's
already have the commit's layout) or fresh ones (a new worker's), so no rank ever holds
a second whole copy in flight. ``spread`` (host tensors) and ``gather`` (CUDA ones) do the
same with Horovod broadcasts, which reach every rank, where there is no such group.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from elastic.runtime import checkpoint
from elastic.runtime.torch_group import translated
from elastic.runtime.flat import Flat, TensorSlot, map_tree
from elastic.runtime.shards import Part

CHUNK = 64 << 20      # bytes per broadcast: bounds the receive buffer, not the state size


@dataclass
class Commit:
    step: int
    skeleton: object                       # the state tree, TensorSlots for tensors
    total: int                             # bytes of the flat state
    held: dict = field(default_factory=dict)   # (start, end) -> uint8 host tensor

    def summary(self) -> dict:
        """What the inventory says about this commit (no bytes)."""
        return {"step": self.step, "extent": self.total, "ranges": list(self.held)}

    @property
    def held_bytes(self) -> int:
        return sum(buffer.numel() for buffer in self.held.values())

    def piece(self, held: tuple, start: int, end: int) -> torch.Tensor:
        """Bytes ``[start, end)`` of the flat state, out of the held range ``held``."""
        return self.held[held][start - held[0]:end - held[0]]


def take(flat: Flat, step: int, ranges: list[tuple[int, int]], previous: Commit | None) -> Commit:
    """Commit ``ranges`` of ``flat``, written over ``previous``'s buffers (the previous
    commit is gone afterwards): a range it held takes its buffer, the others are carved out
    of what is left of them, and only what they cannot hold is allocated. Fresh host
    memory costs its page faults (584 MiB copied in 0.26-1.03 s during a recovery here,
    against 0.12-0.14 s into memory already mapped; a pinned allocation is slower still),
    and RSS stays flat. A carved range is held as several pieces."""
    pin = flat.on_cuda
    spare = dict(previous.held) if previous is not None else {}
    wanted = list(dict.fromkeys(ranges))
    kept = {rng: spare.pop(rng) for rng in wanted if rng in spare}
    memory = list(spare.values())
    pieces = {}
    for start, end in wanted:
        if (start, end) in kept:
            pieces[start, end] = kept[start, end]
            continue
        while start < end:
            if memory:
                free = memory.pop(0)
                if free.numel() > end - start:
                    memory.insert(0, free[end - start:])
                buffer = free[:end - start]
            else:
                buffer = torch.empty(end - start, dtype=torch.uint8, pin_memory=pin)
            pieces[start, start + buffer.numel()] = buffer
            start += buffer.numel()
    held = {(start, end): flat.read(start, end, buffer) for (start, end), buffer in pieces.items()}
    if pin:
        torch.cuda.synchronize()
    return Commit(step=step, skeleton=flat.skeleton, total=flat.total, held=held)


def merged(ranges) -> list[tuple[int, int]]:
    """``ranges`` sorted, adjacent and overlapping ones joined: what bytes they cover."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def gather(parts: list[Part], rank: int, hvd, provide: Callable[[Part, int, int, torch.Tensor], torch.Tensor],
           target: Flat | None) -> None:
    """Every part on every rank, written into ``target`` (None: this rank only passes
    them on). ``provide(part, start, end, scratch)``: on the part's owner, those bytes
    (a view of its held buffer, or its live state read into ``scratch``)."""
    longest = max((min(CHUNK, p.end - p.start) for p in parts), default=0)
    scratch = torch.empty(longest, dtype=torch.uint8)
    for index, part in enumerate(parts):
        for start in range(part.start, part.end, CHUNK):
            end = min(part.end, start + CHUNK)
            data = scratch[:end - start]
            if rank == part.owner:
                data = provide(part, start, end, data)
            if hvd.size() > 1:
                hvd.broadcast_(data, root_rank=part.owner, name=f"regatta.dp.part.{index}.{start}")
            if target is not None:
                target.write(start, data)


def spread(parts: list[Part], here: Flat, rank: int, hvd,
           provide: Callable[[Part, int, int], torch.Tensor] | None = None) -> None:
    """Every part from its owner to every rank, in place: on each rank ``here`` has the
    state's layout (a holder's live tensors, a receiver's the tensors it receives into),
    so no byte is copied on a receiver. ``provide(part, start, end)``: the owner's bytes
    when its live tensors are not the state sent (a commit's held share); they are put
    in ``here`` first. One asynchronous broadcast per tensor slice, all in flight at
    once, as Horovod's own broadcast of parameters does (it fuses the small ones): one
    synchronous 64 MiB chunk after another took 4x as long (bench_state, 10M x Adam).
    Host tensors only: a Horovod without GPU operations broadcasts no CUDA tensor."""
    handles = []
    for part in parts:
        for offset, view in here.views(part.start, part.end):
            if provide is not None and rank == part.owner:
                view.copy_(provide(part, offset, offset + view.numel()))
            handles.append(hvd.broadcast_async_(view, root_rank=part.owner,
                                                name=f"regatta.dp.spread.{offset}"))
    for handle in handles:
        hvd.synchronize(handle)


def send_to(parts: list[Part], here: Flat, rank: int, receivers: list[int],
            provide: Callable[[Part, int, int], torch.Tensor] | None = None) -> int:
    """Every part from its owner to each of ``receivers`` (and no other rank), in place,
    over the world's torch.distributed group (open on every rank: runtime/torch_group.py);
    ``here`` and ``provide`` as in ``spread``. Every send and receive is in flight at once.
    A broadcast also reaches the ranks that hold a part already: with 2 of 3 ranks
    sending to a new worker, each stripe crossed the link twice, and the transfer reached
    0.15 of the link's bound (bench_state, 100M x Adam, 2026-12-07). Returns the bytes
    this rank received."""
    works, received = [], 0
    views = [(part, offset, view) for part in parts for offset, view in here.views(part.start, part.end)]
    with translated("the state's transfer"):
        for tag, (part, offset, view) in enumerate(views):   # the same numbering on every rank
            if rank == part.owner:
                if provide is not None:
                    view.copy_(provide(part, offset, offset + view.numel()))
                works += [dist.isend(view, peer, tag=tag) for peer in receivers if peer != rank]
            elif rank in receivers:
                works.append(dist.irecv(view, part.owner, tag=tag))
                received += view.numel()
        for work in works:
            work.wait()
    return received


HANDOFF_FORMAT = "regatta-dataparallel-handoff/1"
_SLOT = "__tensor_slot__"


def save_commit(commit: Commit, path) -> None:
    """``commit`` to a file (one rank's shares: a hand-over to its in-place replacement).
    Slots become tagged tuples, so the file loads with ``weights_only=True``."""
    def plain(value):
        if isinstance(value, TensorSlot):
            return (_SLOT, value.offset, value.nbytes, str(value.dtype).removeprefix("torch."), list(value.shape))
        return value
    checkpoint.save_atomic({"format": HANDOFF_FORMAT, "step": commit.step, "total": commit.total,
                            "skeleton": map_tree(commit.skeleton, plain),
                            "held": [[start, end, buffer] for (start, end), buffer in commit.held.items()]},
                           path, keep_previous=False)


def load_commit(path) -> Commit:
    saved = checkpoint.load(path, expect=HANDOFF_FORMAT)
    if saved is None:
        raise checkpoint.CheckpointError(f"no hand-over at {path}")
    return Commit(step=saved["step"], skeleton=_revive(saved["skeleton"]), total=saved["total"],
                  held={(start, end): buffer for start, end, buffer in saved["held"]})


def _revive(tree):
    if isinstance(tree, tuple) and tree and tree[0] == _SLOT:
        return TensorSlot(tree[1], tree[2], getattr(torch, tree[3]), tuple(tree[4]))
    if isinstance(tree, dict):
        return {key: _revive(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_revive(value) for value in tree)
    return tree
