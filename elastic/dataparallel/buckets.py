"""Gradient buckets: consecutive parameters, in the order backward produces their
gradients, that travel as one collective (Horovod's tensor fusion, torch DDP's buckets).

A bucket owns one flat buffer, and its parameters' ``.grad`` are views into it (DDP's
``gradient_as_bucket_view``): a gradient backward made elsewhere (after ``zero_grad``
set it to None) is copied in once when complete, and the bucket is then one tensor summed
in place by one Horovod allreduce, and Horovod's own fusion is off (start_horovod), so
Horovod copies nothing into or out of its fusion buffer. The buffers live as long as the
reducer (one gradient-sized allocation, as DDP's buckets). The step's agreement vector,
when this bucket carries it, is the buffer's tail. The division by the global count
happens before the sum, on the training thread, by the count the reducer expects (as
DDP divides before its allreduce): Horovod's postscale would do it after, in one scalar
loop on its background thread, which holds up every bucket queued behind it. In the rare
step whose count differs, ``read_back`` corrects it. With compression the buffer is in
the narrow dtype instead: each gradient is cast into it when complete, and cast back and
divided afterwards.
"""
from __future__ import annotations

import time

import torch

# Wire dtypes a compression setting puts floating gradients on (Horovod's Compression.fp16).
# bfloat16 is not offered: Horovod 0.28.1 has no bfloat16 allreduce.
COMPRESSIONS = {"none": None, "fp16": torch.float16}
# Horovod 0.28 cannot sum bfloat16 at all: bfloat16 gradients travel as float32 (and come
# back exact to bfloat16 rounding of the float32 sum).
WIDENED = {torch.bfloat16: torch.float32}
EDGE_BYTES = 1 << 20


def plan_buckets(params: list[torch.Tensor], bucket_bytes: int, edge_bytes: int = EDGE_BYTES) -> list[list[int]]:
    """Indices of ``params`` grouped into buckets, in backward order (last parameter
    first, as autograd usually produces them). A bucket holds one dtype on one device and
    closes once it reaches ``bucket_bytes``; 0 puts every parameter in its own. The first
    and the last bucket stay near ``edge_bytes`` (as DDP's first bucket): the first, so
    that communication starts early in backward; the last, because it leaves only when
    backward is over. The plan depends only on the model, so every rank makes the same."""
    buckets: list[list[int]] = []
    current: list[int] = []
    size, kind = 0, None
    for index in reversed(range(len(params))):
        param = params[index]
        this = (param.dtype, param.device)
        limit = min(bucket_bytes, edge_bytes) if not buckets else bucket_bytes
        if current and (this != kind or size >= limit):
            buckets.append(current)
            current, size = [], 0
        current.append(index)
        size += param.numel() * param.element_size()
        kind = this
    if current:
        buckets.append(current)
    nbytes = lambda members: sum(params[i].numel() * params[i].element_size() for i in members)  # noqa: E731
    last = buckets[-1] if buckets else []
    if nbytes(last) > edge_bytes:                  # split off its final parameters
        tail = []
        while len(last) > 1 and nbytes(tail) < edge_bytes:
            tail.insert(0, last.pop())
        buckets.append(tail)
    return buckets


def wire_dtype(grad_dtype: torch.dtype, compression: str) -> torch.dtype:
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {', '.join(COMPRESSIONS)}, got {compression!r}")
    if grad_dtype in WIDENED:
        return WIDENED[grad_dtype]
    wire = COMPRESSIONS[compression]
    return wire if wire is not None and grad_dtype in (torch.float32, torch.float64) else grad_dtype


class Bucket:
    """The gradients of ``params`` (in plan order), sent together in one flat buffer;
    ``extra`` (``extra_len`` elements at the buffer's end, when asked) rides along (the
    step's agreement vector)."""

    def __init__(self, index: int, params: list[torch.Tensor], dtype: torch.dtype, extra_len: int = 0,
                 memory: torch.Tensor | None = None):
        """``memory``: a buffer of an earlier world's bucket to hold this one's (its values
        are never read: every gradient is written in before the bucket is sent)."""
        self.index, self.params = index, params
        self.name = f"regatta.grad.{index}"
        self.offsets, total = [], 0
        for param in params:
            self.offsets.append(total)
            total += param.numel()
        self.total = total
        self.flat = memory[:total + extra_len] if memory is not None else \
            torch.zeros(total + extra_len, dtype=dtype, device=params[0].device)
        self.narrow = dtype != params[0].dtype   # compressed: cast in, cast back
        self.extra = self.flat[total:] if extra_len else None
        self.nbytes = self.flat.numel() * self.flat.element_size()
        self.filled: set[int] = set()      # positions whose gradient is complete
        self.scale = 1.0                    # narrow buffer values are gradients times this
        self.reset()

    def reset(self) -> None:
        self.filled.clear()
        self.request = self.launched_at = self.done_at = None
        self.divided_by: int | None = None  # the count launch already divided by
        self.summed = False                 # waited on, and it succeeded

    def _slot(self, position: int) -> torch.Tensor:
        param = self.params[position]
        start = self.offsets[position]
        return self.flat[start:start + param.numel()].view_as(param)

    def put(self, position: int) -> None:
        """The gradient of ``params[position]`` is complete (or will get none: zero)."""
        param, slot = self.params[position], self._slot(position)
        if param.grad is None:
            slot.zero_()
        elif self.narrow:
            torch.mul(param.grad, self.scale, out=slot)
        elif param.grad.data_ptr() != slot.data_ptr() or param.grad.stride() != slot.stride():
            slot.copy_(param.grad)
        if not self.narrow:
            param.grad = slot
        self.filled.add(position)

    def complete(self) -> bool:
        return len(self.filled) == len(self.params)

    def fill_rest(self) -> None:
        """Gradients no hook delivered (parameters unused in the last microstep, or no
        backward at all on a rank without samples): what ``.grad`` holds, else zero."""
        for position in range(len(self.params)):
            if position not in self.filled:
                self.put(position)

    def launch(self, collectives, expected_count: int | None = None) -> None:
        """Start the sum of the gradients divided by ``expected_count`` (not the narrow
        buffer's values, nor a bucket carrying ``extra``: those are divided afterwards)."""
        if self.narrow or self.extra is not None:
            expected_count = None
        if expected_count and expected_count != 1:
            self.flat.div_(expected_count)
        self.divided_by = expected_count
        self.launched_at = time.perf_counter()
        self.request = collectives.allreduce_sum_async([self.flat], self.name)

    def poll(self) -> None:
        if self.request is not None and self.done_at is None and self.request.done():
            self.done_at = time.perf_counter()

    def read_back(self, divisor: int) -> None:
        """Leave the reduced sum / ``divisor`` in every parameter's ``.grad``."""
        grads = self.flat[:self.total]
        if not self.narrow:
            if self.divided_by != divisor:
                grads.mul_(self.divided_by / divisor) if self.divided_by else grads.div_(divisor)
            return
        divisor = divisor * self.scale     # the scale is a power of two: exact
        for position, param in enumerate(self.params):
            slot = self._slot(position)
            if param.grad is None:
                param.grad = slot.to(param.dtype).div_(divisor)
            else:
                param.grad.copy_(slot).div_(divisor)
