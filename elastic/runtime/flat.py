"""A training state seen as one run of bytes, without copying it.

A state is a tree of dicts, lists and tuples whose leaves are tensors or plain values
(what ``state_dict()`` returns for models, optimizers, schedulers, GradScalers and most
user objects). ``Flat.of(tree)`` lays its tensors end to end in a fixed order: the
*skeleton* (the tree with a ``TensorSlot`` in place of each tensor) is small and plain,
the bytes stay where they are. Any byte range of that run can then be copied out
(``read``: a commit's share, a piece to send) or in (``write``: a piece received, into
fresh tensors made by ``Flat.empty(skeleton)``), so no step needs a second copy of the
whole state.
"""
from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorSlot:
    """Where a tensor sits in the flat bytes: offset, size, dtype and shape."""
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple


def map_tree(tree, leaf):
    if isinstance(tree, dict):
        return {k: map_tree(v, leaf) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_tree(v, leaf) for v in tree)
    return leaf(tree)


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


class Flat:
    def __init__(self, skeleton, tensors: list[torch.Tensor], slots: list[TensorSlot],
                 in_place: bool = False):
        self.skeleton, self.tensors, self.slots = skeleton, tensors, slots
        self.total = slots[-1].offset + slots[-1].nbytes if slots else 0
        self.in_place = in_place     # writing here writes the tree's own tensors
        self._starts = [s.offset for s in slots]

    @classmethod
    def of(cls, tree) -> "Flat":
        """The tree's tensors, in place (a non-contiguous one is made contiguous, and the
        Flat is then no longer ``in_place``)."""
        tensors, slots = [], []
        copied = False

        def slot(value):
            nonlocal copied
            if not torch.is_tensor(value):
                return value
            t = value.detach()
            if not t.is_contiguous():
                t, copied = t.contiguous(), True
            offset = slots[-1].offset + slots[-1].nbytes if slots else 0
            slots.append(TensorSlot(offset, t.numel() * t.element_size(), t.dtype, tuple(t.shape)))
            tensors.append(t)
            return slots[-1]
        skeleton = map_tree(tree, slot)
        return cls(skeleton, tensors, slots, in_place=not copied)

    def into(self, skeleton) -> "Flat | None":
        """``skeleton``'s layout over these tensors, when they have exactly its slots (then
        a state with that skeleton can be written straight into them), else None."""
        if not self.in_place or self.slots != slots_of(skeleton):
            return None
        return Flat(skeleton, self.tensors, self.slots, in_place=True)

    @classmethod
    def empty(cls, skeleton) -> "Flat":
        """Fresh host tensors for every slot of ``skeleton``, to ``write`` into."""
        tensors, slots = [], []

        def fresh(value):
            if isinstance(value, TensorSlot):
                slots.append(value)
                tensors.append(torch.empty(value.shape, dtype=value.dtype))
            return value
        map_tree(skeleton, fresh)
        return cls(skeleton, tensors, slots)

    def _overlapping(self, start: int, end: int):
        """(tensor bytes, lo, hi, position in [start, end)) of every slot in the range."""
        for i, (data, lo, hi) in self._overlapping_indexed(start, end):
            yield data, lo, hi, self.slots[i].offset + lo - start

    def views(self, start: int, end: int) -> list[tuple[int, torch.Tensor]]:
        """(offset, uint8 view of these tensors' own bytes) covering ``[start, end)``:
        what a transfer reads from or writes into without a copy."""
        return [(self.slots[i].offset + lo, data[lo:hi])
                for i, (data, lo, hi) in self._overlapping_indexed(start, end)]

    def _overlapping_indexed(self, start: int, end: int):
        i = max(0, bisect.bisect_right(self._starts, start) - 1)
        while i < len(self.slots) and self.slots[i].offset < end:
            s = self.slots[i]
            lo, hi = max(start, s.offset), min(end, s.offset + s.nbytes)
            if lo < hi:
                yield i, (_bytes_of(self.tensors[i]), lo - s.offset, hi - s.offset)
            i += 1

    def read(self, start: int, end: int, out: torch.Tensor) -> torch.Tensor:
        """Copy bytes ``[start, end)`` into ``out`` (uint8, host; pinned for CUDA tensors,
        then the caller synchronises)."""
        for data, lo, hi, at in self._overlapping(start, end):
            out[at:at + hi - lo].copy_(data[lo:hi], non_blocking=data.is_cuda)
        return out

    def write(self, start: int, data: torch.Tensor) -> None:
        """Copy ``data`` (uint8) into bytes ``[start, start + len(data))``."""
        for target, lo, hi, at in self._overlapping(start, start + data.numel()):
            target[lo:hi].copy_(data[at:at + hi - lo])

    @property
    def on_cuda(self) -> bool:
        return any(t.is_cuda for t in self.tensors)

    def tree(self):
        """The skeleton with this Flat's tensors in place."""
        tensors = iter(self.tensors)      # map_tree visits slots in the order of() made them
        return map_tree(self.skeleton, lambda v: next(tensors) if isinstance(v, TensorSlot) else v)


def slots_of(skeleton) -> list[TensorSlot]:
    slots = []
    map_tree(skeleton, lambda v: slots.append(v) if isinstance(v, TensorSlot) else None)
    return slots


def tree_digest(tree) -> str:
    """A short digest of a whole tree, plain values and tensor bytes alike: equal on two
    ranks exactly when their trees are bit for bit equal."""
    flat = Flat.of(tree)
    digest = hashlib.sha256(repr(flat.skeleton).encode())
    for tensor in flat.tensors:
        digest.update(_bytes_of(tensor).cpu().numpy().tobytes())
    return digest.hexdigest()[:16]
