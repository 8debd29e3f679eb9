"""Gradient reduction for data parallelism, overlapped with backward, carrying the step's
agreement with it.

Every rank contributes the *summed* loss gradient of its share of the global batch; the
gradients and the agreement vector (runtime/control.py) are summed over the world, and the
gradients are then divided by the global sample count, so any split of the batch (uneven
shares, a new world size) gives the combined batch's mean gradient.

The step drives the reducer in two calls: ``before_backward(last)`` before each microstep's
backward, then ``finish(control)`` once the last backward returned. Gradients are grouped
into buckets (buckets.py, ``train.bucket_mb``). During the *last* microstep's backward a
post-accumulate-grad hook marks each finished gradient, and a full bucket starts its sum
once every bucket before it in the plan has (an asynchronous allreduce, in place) while
backward computes the rest; earlier microsteps only accumulate, so accumulation reduces once.
``finish`` sends what is left, with the agreement vector riding in the last bucket (the
one holding the first layers, which backward finishes last), waits, and leaves the mean
gradients in ``.grad``. The other buckets are divided just before their sum by the count
expected (the last step's, alike on every rank), so a steady run needs no pass over the
gradients afterwards; only the last bucket, and any bucket of a step whose count
differed, are divided here.

``train.compression = "fp16"`` puts floating gradients on the wire as float16, multiplied
by a power of two near 1 / the previous step's global count (known alike on every rank),
so what travels is about the mean gradient, as Horovod's and DDP's fp16 compression send;
the agreement then travels on its own in float64, so counts and losses stay exact.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from elastic.runtime.control import HEADER, Agreed, Control

from .buckets import Bucket, plan_buckets, wire_dtype


@dataclass
class Reduced:
    agreed: Agreed
    nbytes: int                    # bytes each rank put into the collectives
    overlap: float | None = None   # share of the communication hidden behind backward


class BucketReducer:
    def __init__(self, params: list[torch.nn.Parameter], rank: int, size: int, collectives,
                 bucket_bytes: int = 25 << 20, compression: str = "none", expected_count: int = 1,
                 broken: Callable[[], bool] = lambda: False, spare: list[torch.Tensor] = ()):
        """``expected_count``: the global loss-term count to expect on the first step (the
        same on every rank, e.g. the global batch); later steps expect the last one's.
        ``spare``: an earlier world's bucket buffers (``released``), to hold this one's
        buckets where they fit: fresh memory costs its page faults (800 MB at 200M
        parameters). ``broken()``: whether a peer has died in this world; backward then
        stops at the next gradient with HorovodInternalError (the step is redone in the
        new world)."""
        self.params, self.rank, self.size = params, rank, size
        self.collectives, self._broken = collectives, broken
        self._last_count = max(1, expected_count)
        self._hooks, self._armed, self._finishing = [], False, 0.0
        self._released: list[torch.Tensor] = []   # close's: buffers free for the next world
        self.buckets: list[Bucket] = []
        self._flying: list[Bucket] = []    # launched this step, not yet seen complete
        self._next = 0                       # the first bucket of the plan not launched yet
        self._where: dict[int, tuple[Bucket, int]] = {}
        if size == 1:
            return   # nothing to send: finish only divides
        control_len = HEADER + size
        plan = plan_buckets(params, bucket_bytes)
        spare = list(spare)
        for index, members in enumerate(plan):
            first = params[members[0]]
            dtype = wire_dtype(first.dtype, compression)
            carries = index == len(plan) - 1 and dtype == first.dtype and dtype in (torch.float32, torch.float64)
            extra = control_len if carries else 0
            needed = sum(params[i].numel() for i in members) + extra
            fits = next((m for m in spare if m.dtype == dtype and m.device == first.device
                         and m.numel() >= needed), None)
            if fits is not None:
                spare.remove(fits)
            bucket = Bucket(index, [params[i] for i in members], dtype, extra, memory=fits)
            self.buckets.append(bucket)
            for position, param_index in enumerate(members):
                self._where[param_index] = (bucket, position)
        self._carrier = self.buckets[-1] if self.buckets and self.buckets[-1].extra is not None else None
        self._hooks = [param.register_post_accumulate_grad_hook(self._hook(i))
                       for i, param in enumerate(params)]

    # -- the two calls the step makes -------------------------------------------------------
    def before_backward(self, last: bool) -> None:
        """Only the last microstep's gradients are complete: only its backward sends."""
        if last and not self._armed:
            scale = 2.0 ** -round(math.log2(self._last_count))
            for bucket in self.buckets:
                bucket.reset()
                bucket.scale = scale if bucket.narrow else 1.0
            self._flying, self._next = [], 0
        self._armed = last

    def finish(self, control: Control) -> Reduced:
        """Sum the rest and ``control`` over the world and leave the combined batch's
        mean gradient in every ``.grad``."""
        self._finishing = time.perf_counter()
        self._armed = False
        if self.size == 1:
            return self._finish_alone(control)
        own = None
        self._poll_flying()
        for bucket in self.buckets:
            if bucket.request is None:
                bucket.fill_rest()
                if bucket is self._carrier:
                    bucket.extra.copy_(control.encode(self.rank, self.size, bucket.extra.dtype,
                                                      bucket.extra.device))
                bucket.launch(self.collectives, self._last_count)
        if self._carrier is None:
            own = control.encode(self.rank, self.size, torch.float64)
            request = self.collectives.allreduce_sum_async([own], "regatta.control")
        self._wait_all([request] if own is not None else [])
        done = time.perf_counter()
        agreed = Agreed.decode(self._carrier.extra if own is None else own)
        self._last_count = max(1, agreed.count)
        for bucket in self.buckets:
            bucket.read_back(max(agreed.count, 1))
        nbytes = sum(b.nbytes for b in self.buckets)
        if own is not None:
            nbytes += own.numel() * own.element_size()
        return Reduced(agreed, nbytes, self._overlap(done, agreed.wait_s(self.rank)))

    def progress(self) -> dict:
        """The last step's buckets: how many, how many were sent, how many came back
        summed (what a failure interrupted). Settles the requests that have ended."""
        for bucket in self.buckets:
            if bucket.request is not None and _ended(bucket.request):
                try:
                    bucket.request.wait()
                    bucket.summed = True
                except Exception:  # noqa: BLE001 - this one failed: not summed
                    pass
                bucket.request = None
        return {"buckets": len(self.buckets),
                "launched": sum(b.launched_at is not None for b in self.buckets),
                "summed": sum(b.summed for b in self.buckets)}

    def close(self) -> None:
        """Remove the hooks (a new world makes a new reducer) and settle any collective a
        failed step left in flight, so nothing keeps its buffers alive."""
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._armed = [], False
        self._released = []
        for bucket in self.buckets:
            if bucket.request is not None and _ended(bucket.request):   # never block here
                try:
                    bucket.request.wait()
                except Exception:  # noqa: BLE001 - the failure was already handled
                    pass
                bucket.request = None
            if bucket.request is None:   # nothing can still write into it
                self._released.append(bucket.flat)
            bucket.request = None

    def released(self) -> list[torch.Tensor]:
        """After ``close``: the buckets' buffers that no collective of this world can still
        write into (one still in flight when it closed is left to its collective), for
        the next world's reducer (``spare``)."""
        return self._released

    # -- inside backward ----------------------------------------------------------------------
    def _hook(self, index: int):
        def on_gradient(param: torch.Tensor) -> None:
            if self._broken():
                abandon()
            if not self._armed:
                return
            bucket, position = self._where[index]
            if position in bucket.filled:
                raise RuntimeError(f"parameter {index} got a gradient twice during the last "
                                   f"microstep's backward; its bucket may already be on the wire")
            bucket.put(position)
            self._poll_flying()            # note completions: the overlap measure
            if bucket.complete():
                self._launch_in_order()
        return on_gradient

    def _launch_in_order(self) -> None:
        """Send the complete buckets that come next in plan order, as DDP does. Every rank
        then sends them in one order, whatever order its backward completes them in (an
        unused parameter, a rank without samples): a torch.distributed group pairs the
        ranks' sums by their order (Horovod pairs them by name). The carrier, last in
        plan order, waits for ``finish``."""
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if bucket is self._carrier or not bucket.complete():
                return
            bucket.launch(self.collectives, self._last_count)
            self._flying.append(bucket)
            self._next += 1

    def _poll_flying(self) -> None:
        for bucket in self._flying:
            bucket.poll()
        self._flying = [b for b in self._flying if b.done_at is None]

    # -- helpers ------------------------------------------------------------------------------
    def _wait_all(self, others: list) -> None:
        """Wait for every bucket's request and ``others``, even when one fails (each must
        be settled once), then raise the first failure."""
        failure = None
        for item in self.buckets + others:
            request = item.request if isinstance(item, Bucket) else item
            try:
                request.wait()
            except Exception as err:  # noqa: BLE001 - re-raised below
                failure = failure or err
            else:
                if isinstance(item, Bucket):
                    item.done_at = item.done_at or time.perf_counter()
                    item.summed = True
        for bucket in self.buckets:
            bucket.request = None
        if failure is not None:
            raise failure

    def _overlap(self, done: float, wait_s: float) -> float | None:
        """Share of the communication's time that ran while backward still computed: the
        time some bucket was in flight before ``finish`` began, against that plus the time
        ``finish`` waited beyond waiting for the slowest rank to finish its backward."""
        spans = sorted((b.launched_at, min(b.done_at or self._finishing, self._finishing))
                       for b in self.buckets if b.launched_at < self._finishing)
        hidden, reach = 0.0, -math.inf
        for start, end in spans:
            if end > reach:
                hidden += end - max(start, reach)
                reach = end
        exposed = max(0.0, done - self._finishing - wait_s)
        return hidden / (hidden + exposed) if hidden + exposed > 0 else None

    def _finish_alone(self, control: Control) -> Reduced:
        agreed = Agreed.decode(control.encode(self.rank, self.size, torch.float64))
        for param in self.params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            else:
                param.grad.div_(max(agreed.count, 1))
        return Reduced(agreed, 0)


def abandon() -> None:
    """Stop this backward: a peer died, so its sums cannot complete. The error is the one a
    failed collective raises, so the step is handled as any failed step (nothing of it
    was applied); the rest of the backward, seconds for a large model, is not computed."""
    from horovod.common.exceptions import HorovodInternalError
    raise HorovodInternalError("a peer of this world died during the step: its backward is abandoned")


def _ended(request) -> bool:
    """Whether waiting on ``request`` returns at once (a handle Horovod no longer knows,
    from before a reset, has ended too)."""
    try:
        return request.done()
    except Exception:  # noqa: BLE001
        return True
