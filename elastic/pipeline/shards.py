"""Committed pipeline state that survives a rank's death without reading disk.

At every commit each rank snapshots its own stage (parameters and optimizer state under
the full model's names, rebalance.export_stage) in memory. With dp >= 2 the stage's other
replicas hold the same bytes (they applied the same summed gradients); with dp = 1 each
rank also sends its snapshot to a *buddy*, the next rank on another host, over the
pipeline's Gloo group (placement: runtime/shards.py, the same for data parallelism). So
every rank holds one stage's shard, or two with dp = 1: 1/pp or 2/pp of the model, never
the whole of it for pp >= 2 (README states the cost). A single failed rank or host
therefore never takes the last copy of any stage with it, and two failures do not either
as long as they leave some copy of each stage.

On a reset the survivors (and any new workers) all-gather what they hold: their commits
and, after a failure, their live stage (elastic_state.py). They pick the newest step whose
shards cover every child (runtime/shards.py: covering_step, cover), live or committed, and
rebuild under the new plan: a rank whose own shards hold its new stage moves nothing, the
others receive what they lack point to point from a rank holding it (``transfers``,
``send_pieces``). Every digest here is
``model_digest``: sha256 over (name, sha256 of bytes) of every tensor, sorted by name,
so per-stage digests combine into the full model's.
"""
from __future__ import annotations

import hashlib
import io

import torch

from .transport import Transport

SIZE_TAG, DATA_TAG = 32100, 32101     # above the executor's activation and header tags
PIECE_TAG = 32200                     # a re-plan's moves: two tags each, from here up


def tensor_digests(state: dict) -> dict[str, str]:
    return {name: hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()
            for name, t in state.items()}


def model_digest(digests: dict[str, str]) -> str:
    """The full model's digest from every tensor's (any stage split gives the same)."""
    whole = hashlib.sha256()
    for name in sorted(digests):
        whole.update(name.encode())
        whole.update(digests[name].encode())
    return whole.hexdigest()[:16]


def to_bytes(obj) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def from_bytes(data: torch.Tensor):
    """A peer's stage shard: tensors, numbers and containers only, so nothing else loads."""
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)


def exchange(transport: Transport, obj, send_to: int | None, recv_from: list[int]) -> list:
    """Send ``obj`` to one rank and receive one object from each of ``recv_from``, all
    non-blocking (a cycle of buddies cannot deadlock)."""
    payload = to_bytes(obj) if send_to is not None else None
    sizes = {peer: torch.zeros(1, dtype=torch.int64) for peer in recv_from}
    handles = [transport.irecv(sizes[p], p, SIZE_TAG) for p in recv_from]
    if payload is not None:
        handles.append(transport.isend(torch.tensor([len(payload)]), send_to, SIZE_TAG))
        handles.append(transport.isend(payload, send_to, DATA_TAG))
    for handle in handles[:len(recv_from)]:
        handle.wait()
    buffers = {p: torch.empty(int(sizes[p]), dtype=torch.uint8) for p in recv_from}
    received = [transport.irecv(buffers[p], p, DATA_TAG) for p in recv_from]
    for handle in received + handles[len(recv_from):]:
        handle.wait()
    return [from_bytes(buffers[p]) for p in recv_from]


def send_pieces(transport: Transport, moves: list, mine: dict, rank: int) -> tuple[list[dict], int]:
    """Carry out ``moves`` (runtime/shards.py ``transfers``), all at once and non-blocking:
    this rank sends the pieces it owns (``mine``: children range -> shard) and receives
    those it lacks, each with tags of its own (every rank numbers the moves alike).
    Returns this rank's pieces, its own then those received, and the bytes received."""
    payloads, sends, sizes = {}, [], []
    for number, move in enumerate(moves):
        tag = PIECE_TAG + 2 * number
        if move.owner == rank:
            if move.held not in payloads:
                payloads[move.held] = to_bytes(mine[move.held])
            data = payloads[move.held]
            sends += [transport.isend(torch.tensor([len(data)]), move.receiver, tag),
                      transport.isend(data, move.receiver, tag + 1)]
        elif move.receiver == rank:
            size = torch.zeros(1, dtype=torch.int64)
            sizes.append((number, move.owner, size, transport.irecv(size, move.owner, tag)))
    arriving = []
    for number, owner, size, handle in sizes:
        handle.wait()
        data = torch.empty(int(size), dtype=torch.uint8)
        arriving.append((data, transport.irecv(data, owner, PIECE_TAG + 2 * number + 1)))
    for handle in [h for _, h in arriving] + sends:
        handle.wait()
    received = [from_bytes(data) for data, _ in arriving]
    return list(mine.values()) + received, sum(data.numel() for data, _ in arriving)


def shard_bytes(shards: dict) -> int:
    """Tensor bytes of the shards a rank holds (what the redundancy costs in memory)."""
    tensors = [t for shard in shards.values() for t in shard["model"].values()]
    tensors += [v for shard in shards.values() for state in shard["optimizer"].values()
                for v in state.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in tensors)
