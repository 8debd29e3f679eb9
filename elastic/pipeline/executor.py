"""Runs one stage's action list (schedule.py) for one optimizer step.

The same executor runs GPipe and 1F1B. Activations and gradients travel through buffers
kept from step to step (transport.py channels). Sends are non-blocking and completed at
the end of the step; every receive of the step is posted when the step starts, so a
message lands whenever it arrives, and a receive blocks only when its data is needed.

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
from dataclasses import dataclass, field

import torch
from torch import nn

from .grid import Grid
from .schedule import Action
from .transport import Channel, Handle, Transport

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
    compute_times: list = field(default_factory=list)   # each fwd and bwd's seconds, in order

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
        # (direction, kind, microbatch) -> the kept buffer and its channel
        self._channels: dict[tuple, tuple[torch.Tensor, Channel]] = {}
        self._actions = {kind: getattr(self, "_" + kind) for kind in
                         ("fwd", "bwd", "send_act", "send_grad", "recv_act", "recv_grad")}

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
        for action in actions:
            if action.kind.startswith("recv_"):
                self._post((action.kind[5:], action.microbatch))
        self.stats.recv_wait += time.perf_counter() - started   # the first step's header
        for index, action in enumerate(actions):
            self._actions[action.kind](action.microbatch, actions, index)
            while self._sends and self._sends[0].test():   # a test also drives MPI progress
                self._sends.pop(0)
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
        self._computed(started)

    def _bwd(self, i: int, actions, index) -> None:
        out = self._out.pop(i)
        grad = None if self.grid.is_last else self._grad_in.pop(i)
        started = time.perf_counter()
        torch.autograd.backward(out, grad)
        self._sync()
        self._computed(started)
        self._held -= self._saved.pop(i)
        if not self.grid.is_first:
            self._grad_out[i] = self._x.pop(i).grad

    def _send_act(self, i: int, actions, index) -> None:
        out = self._out[i].detach()
        shape = (out.dtype, tuple(out.shape))
        if self.out_shape is None:
            self.out_shape = shape
            header = _header(out)
            self._sends.append(self.transport.isend(header, self.grid.next_rank, HEADER_TAG))
            self.stats.activation_bytes += header.numel() * header.element_size()
        elif shape != self.out_shape:
            raise RuntimeError(f"stage {self.grid.stage}: activation {shape} differs from the "
                               f"{self.out_shape} agreed with the next stage; all microbatches "
                               f"must have one shape")
        self._send(("act", i), out, self.grid.next_rank)

    def _send_grad(self, i: int, actions, index) -> None:
        self._send(("grad", i), self._grad_out.pop(i), self.grid.prev_rank)

    def _recv_act(self, i: int, actions, index) -> None:
        # A new tensor over the kept buffer: its .grad is this step's alone.
        self._x[i] = self._receive(("act", i)).detach().requires_grad_(True)

    def _recv_grad(self, i: int, actions, index) -> None:
        self._grad_in[i] = self._receive(("grad", i))

    # -- transport --------------------------------------------------------------------
    def _send(self, key: tuple, tensor: torch.Tensor, peer: int) -> None:
        """Copy into the kept buffer of ``key`` (kind, microbatch) and send it; the last
        step's send from it has completed (every send is waited on at the step's end)."""
        if ("send", *key) not in self._channels:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
            self._channels["send", *key] = buffer, self.transport.send_channel(buffer, peer, tag(*key))
        buffer, channel = self._channels["send", *key]
        buffer.copy_(tensor)
        self._sends.append(channel.start())
        self.stats.activation_bytes += tensor.numel() * tensor.element_size()

    def _post(self, key: tuple) -> None:
        """Post the receive for ``key`` (kind, microbatch), unless posted, or unless its
        shape is not known yet: a gradient's is the shape of the activation this stage
        sends, known once it sent the first (``_receive`` posts it then)."""
        kind, i = key
        if key in self._posted:
            return
        if kind == "act":
            if self.in_shape is None:   # the one-time header from the previous stage
                header = torch.zeros(8, dtype=torch.int64)
                self.transport.irecv(header, self.grid.prev_rank, HEADER_TAG).wait()
                self.in_shape = _read_header(header)
            shape, peer = self.in_shape, self.grid.prev_rank
        elif self.out_shape is None:
            return
        else:
            shape, peer = self.out_shape, self.grid.next_rank
        if ("recv", *key) not in self._channels:
            buffer = torch.empty(shape[1], dtype=shape[0], device=self.device)
            self._channels["recv", *key] = buffer, self.transport.recv_channel(buffer, peer, tag(kind, i))
        self._posted[key] = self._channels["recv", *key][1].start()

    def _receive(self, key: tuple) -> torch.Tensor:
        started = time.perf_counter()
        self._post(key)
        tensor = self._posted.pop(key).wait()
        self.stats.recv_wait += time.perf_counter() - started
        return tensor

    def _computed(self, started: float) -> None:
        seconds = time.perf_counter() - started
        self.stats.busy_time += seconds
        self.stats.compute_times.append(seconds)

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
