"""Committed state held in pieces across ranks, so that the loss of any one host (and
often of several) never takes the last copy of a piece with it, and no rank holds the
whole state twice. Both engines use it: data parallelism cuts the flat bytes of its
state into one share per rank (dataparallel/state.py); the elastic pipeline holds its
stages (pipeline/elastic_state.py).

    placement   ``buddies(hosts)``: who keeps the second copy of each rank's piece
    inventory   every rank says what it holds: ``{"rank", "step", "extent", "ranges"}``,
                ranges of ``[0, extent)``: bytes of the flat state, or pipeline children
    covering    ``covering_step``: the newest commit whose pieces, among the ranks now
                alive, cover all of ``[0, extent)``
    cover       ``cover``: which rank contributes which part of it (every rank computes
                the same answer from the same inventory, so no one has to decide)
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


def buddies(hosts: list[str]) -> list[int]:
    """Rank r's buddy: the rank that keeps a copy of r's piece. A permutation without
    fixed points (each rank holds exactly one piece besides its own), on another host
    whenever no host has more than half of the ranks: ranks are listed host by host and
    each piece moves as many places along that list as the largest host has ranks."""
    size = len(hosts)
    if size == 1:
        return [0]
    order = sorted(range(size), key=lambda r: (hosts.index(hosts[r]), r))
    shift = max(hosts.count(h) for h in set(hosts))
    shift = shift if shift % size else 1
    position = {rank: i for i, rank in enumerate(order)}
    return [order[(position[rank] + shift) % size] for rank in range(size)]


def kept_by(buddy: list[int], rank: int) -> list[int]:
    """The ranks whose pieces ``rank`` keeps: its own, then the one whose buddy it is."""
    return [rank] + [r for r, b in enumerate(buddy) if b == rank and r != rank]


@dataclass(frozen=True)
class Part:
    """``owner`` contributes ``[start, end)``, out of the piece ``held`` it keeps."""
    owner: int
    start: int
    end: int
    held: tuple


def cover(items: list[dict], step: int) -> list[Part] | None:
    """Parts that together cover ``[0, extent)`` of commit ``step`` exactly once, or None
    when the ranks' pieces leave a gap. Greedy: from each position, the piece reaching
    furthest (the lowest rank on a tie), so as few pieces move as possible."""
    pieces = [(tuple(rng), item["rank"]) for item in items if item["step"] == step
              for rng in item["ranges"]]
    if not pieces:
        return None
    extent = next(item["extent"] for item in items if item["step"] == step)
    parts, position = [], 0
    while position < extent:
        reaching = [(rng, rank) for rng, rank in pieces if rng[0] <= position < rng[1]]
        if not reaching:
            return None
        rng, rank = max(reaching, key=lambda p: (p[0][1], -p[1]))
        parts.append(Part(owner=rank, start=position, end=rng[1], held=rng))
        position = rng[1]
    return parts


def covering_step(items: list[dict]) -> int | None:
    """The newest committed step the ranks' pieces (``items``) cover entirely."""
    for step in sorted({i["step"] for i in items}, reverse=True):
        if cover(items, step) is not None:
            return step
    return None


def shares(extent: int, count: int, align: int = 64) -> list[tuple[int, int]]:
    """``[0, extent)`` cut into ``count`` contiguous shares of (almost) equal size, each
    boundary a multiple of ``align`` bytes (cache lines; the last share takes the rest)."""
    step = -(-extent // count)
    step = -(-step // align) * align
    bounds = [min(extent, i * step) for i in range(count)] + [extent]
    return [(bounds[i], bounds[i + 1]) for i in range(count)]


@dataclass(frozen=True)
class Transfer:
    """``owner`` sends its piece ``held`` of the chosen step to ``receiver``."""
    receiver: int
    owner: int
    held: tuple


def transfers(items: list[dict], step: int, needs: list[tuple[int, int]]) -> list[Transfer]:
    """What moves so that each rank r holds ``needs[r]`` (a range of ``[0, extent)``) of
    ``step``: nothing for a rank whose own pieces cover its range (its owner did not
    change), else the pieces it lacks, each from one of the ranks holding it whole (spread
    over them in turn, so a stage's replicas share the sending). Every rank
    computes the same list, in the same order, from the same inventory."""
    pieces = [(tuple(rng), item["rank"]) for item in items if item["step"] == step
              for rng in item["ranges"]]
    moves, served = [], Counter()      # receivers served so far by each set of holders
    for rank, (start, end) in enumerate(needs):
        mine = [rng for rng, owner in pieces if owner == rank]
        for part in cover(items, step) or []:
            lo, hi = max(part.start, start), min(part.end, end)
            if lo >= hi or any(rng[0] <= lo and hi <= rng[1] for rng in mine):
                continue
            holders = tuple(sorted({(owner, rng) for rng, owner in pieces
                                    if rng[0] <= lo and hi <= rng[1]}))
            owner, held = holders[served[holders] % len(holders)]
            served[holders] += 1
            moves.append(Transfer(receiver=rank, owner=owner, held=held))
    return moves
