"""Runs one stage's action list (schedule.py) for one optimizer step.

The same executor runs GPipe and 1F1B. Sends are non-blocking and completed at the end of
the step; receives block only when their data is needed, and the next receive of each
kind is posted one action early, so a message can land while this stage computes.

Shapes are agreed once: the first activation a stage ever sends is preceded by a small
header (dtype, shape); every later activation must have that shape (the plan makes all
microbatches equal), so the hot path moves raw tensor memory and nothing else. Gradients
travel back with the shape of the activation they belong to, which both sides know.

Measured per step (StageStats): busy (forward+backward compute), receive and send waits,
bytes sent, the peak bytes of autograd-saved activations held, and the bubble fraction
``1 - busy / step_time``.

Device: the stage computes on its module's device (or ``device``). Received activations
and gradients land in buffers allocated there; headers stay on the CPU. On CUDA, forward
and backward end with a device synchronize so that busy time is compute time, not the
time to queue kernels (the bubble would otherwise read as idle GPU work).
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn

from .grid import Grid
from .schedule import Action
from .transport import Handle, Transport

HEADER_TAG = 32000          # below MPI's guaranteed minimum tag bound, 32767
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32)


def tag(kind: str, microbatch: int) -> int:
    if not 0 <= microbatch < HEADER_TAG // 2:
        raise ValueError(f"microbatch {microbatch} out of the tag range (< {HEADER_TAG // 2})")
    return 2 * microbatch + (1 if kind == "grad" else 0)


@dataclass
class StageStats:
    step_time: float = 0.0
    busy_time: float = 0.0            # forward + backward compute
    recv_wait: float = 0.0            # blocked waiting for an activation or gradient
    send_wait: float = 0.0            # completing sends at the end of the step
    activation_bytes: int = 0         # bytes this stage sent (activations and gradients)
    peak_activation_bytes: int = 0    # autograd-saved activations held at once
    loss_sum: float = 0.0             # last stage: summed loss over its microbatches
    microbatches: int = 0

    @property
    def bubble(self) -> float:
        return 1.0 - self.busy_time / self.step_time if self.step_time > 0 else 0.0


def module_device(module: nn.Module) -> torch.device:
    """The device of a module's first parameter or buffer; CPU for a module with neither."""
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    return torch.device("cpu")


class StageExecutor:
    def __init__(self, module: nn.Module, grid: Grid, transport: Transport, loss_fn=None,
                 device: torch.device | None = None):
        self.module, self.grid, self.transport, self.loss_fn = module, grid, transport, loss_fn
        self.device = torch.device(device) if device is not None else module_device(module)
        self._cuda = self.device.type == "cuda"
        self.in_shape: tuple | None = None     # (dtype, shape) of activations received
        self.out_shape: tuple | None = None    # (dtype, shape) of activations sent
        self._param_storages = {p.untyped_storage().data_ptr() for p in module.parameters()}

    # -- one step ---------------------------------------------------------------------
    def run(self, actions: list[Action], inputs: list | None = None, targets: list | None = None,
            scale: float = 1.0) -> StageStats:
        """``inputs``: stage 0's microbatch inputs; ``targets``: the last stage's
        microbatches for ``loss_fn``; ``scale`` multiplies the loss before backward (1 /
        the global count, so gradients come out as the step's mean)."""
        self.stats = StageStats(microbatches=sum(a.kind == "fwd" for a in actions))
        self._inputs, self._targets, self._scale = inputs, targets, scale
        self._x, self._out, self._grad_in, self._grad_out = {}, {}, {}, {}
        self._posted: dict[tuple, Handle] = {}
        self._sends: list[Handle] = []
        self._saved, self._held = defaultdict(int), 0
        self._loss = torch.zeros((), device=self.device)
        started = time.perf_counter()
        for index, action in enumerate(actions):
            getattr(self, "_" + action.kind)(action.microbatch, actions, index)
            self._sends = [h for h in self._sends if not h.test()]   # also drives MPI progress
        waited = time.perf_counter()
        for handle in self._sends:
            handle.wait()
        done = time.perf_counter()
        self.stats.send_wait += done - waited
        self.stats.step_time = done - started
        self.stats.loss_sum = float(self._loss)
        return self.stats

    # -- actions ----------------------------------------------------------------------
    def _fwd(self, i: int, actions, index) -> None:
        x = self._inputs[i] if self.grid.is_first else self._x[i]
        started = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(self._packer(i), lambda t: t):
            out = self.module(x)
            if self.grid.is_last:
                loss = self.loss_fn(out, self._targets[i])
                self._loss = self._loss + loss.detach()
                out = loss * self._scale
        self._sync()
        self._out[i] = out
        self._held += self._saved[i]
        self.stats.peak_activation_bytes = max(self.stats.peak_activation_bytes, self._held)
        self.stats.busy_time += time.perf_counter() - started

    def _bwd(self, i: int, actions, index) -> None:
        out = self._out.pop(i)
        grad = None if self.grid.is_last else self._grad_in.pop(i)
        started = time.perf_counter()
        torch.autograd.backward(out, grad)
        self._sync()
        self.stats.busy_time += time.perf_counter() - started
        self._held -= self._saved.pop(i)
        if not self.grid.is_first:
            self._grad_out[i] = self._x.pop(i).grad

    def _send_act(self, i: int, actions, index) -> None:
        out = self._out[i].detach().contiguous()
        shape = (out.dtype, tuple(out.shape))
        if self.out_shape is None:
            self.out_shape = shape
            self._send(_header(out), self.grid.next_rank, HEADER_TAG)
        elif shape != self.out_shape:
            raise RuntimeError(f"stage {self.grid.stage}: activation {shape} differs from the "
                               f"{self.out_shape} agreed with the next stage; all microbatches "
                               f"must have one shape")
        self._send(out, self.grid.next_rank, tag("act", i))

    def _send_grad(self, i: int, actions, index) -> None:
        self._send(self._grad_out.pop(i).contiguous(), self.grid.prev_rank, tag("grad", i))

    def _recv_act(self, i: int, actions, index) -> None:
        x = self._receive(("act", i), actions, index)
        self._x[i] = x.requires_grad_(True)

    def _recv_grad(self, i: int, actions, index) -> None:
        self._grad_in[i] = self._receive(("grad", i), actions, index)

    # -- transport --------------------------------------------------------------------
    def _send(self, tensor: torch.Tensor, peer: int, tag_: int) -> None:
        self._sends.append(self.transport.isend(tensor, peer, tag_))
        self.stats.activation_bytes += tensor.numel() * tensor.element_size()

    def _post(self, key: tuple) -> None:
        kind, i = key
        if key in self._posted:
            return
        if kind == "act":
            if self.in_shape is None:   # the one-time header from the previous stage
                header = torch.zeros(8, dtype=torch.int64)
                self.transport.irecv(header, self.grid.prev_rank, HEADER_TAG).wait()
                self.in_shape = _read_header(header)
            dtype, shape, peer = *self.in_shape, self.grid.prev_rank
        else:
            dtype, shape = self.out_shape
            peer = self.grid.next_rank
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        self._posted[key] = self.transport.irecv(buffer, peer, tag(kind, i))

    def _receive(self, key: tuple, actions, index) -> torch.Tensor:
        started = time.perf_counter()
        self._post(key)
        for later in actions[index + 1:]:    # post the next receive of the same kind early
            if later.kind == "recv_" + key[0]:
                self._post((key[0], later.microbatch))
                break
        tensor = self._posted.pop(key).wait()
        self.stats.recv_wait += time.perf_counter() - started
        return tensor

    def _sync(self) -> None:
        if self._cuda:
            torch.cuda.synchronize(self.device)

    def _packer(self, i: int):
        def pack(t: torch.Tensor) -> torch.Tensor:
            # Weights saved for backward are parameters, not activations: skip them.
            if t.untyped_storage().data_ptr() not in self._param_storages:
                self._saved[i] += t.numel() * t.element_size()
            return t
        return pack


def _header(t: torch.Tensor) -> torch.Tensor:
    if t.dim() > 6:
        raise ValueError(f"activations of more than 6 dimensions are not supported, got {t.dim()}")
    return torch.tensor([DTYPES.index(t.dtype), t.dim(), *t.shape, *[0] * (6 - t.dim())],
                        dtype=torch.int64)


def _read_header(header: torch.Tensor) -> tuple:
    code, ndim, *dims = header.tolist()
    return DTYPES[code], tuple(dims[:ndim])
