"""Worker for test_bucket_reduce: drives the data-parallel BucketReducer directly, as the
step does (``before_backward`` before each microstep, ``finish`` after the last), over
uneven shares, gradient accumulation, a parameter the last microstep leaves unused, a rank
without samples, and float16 on the wire. Rank 0 saves what it got; the test compares it
with one process computing the combined batch.

    horovodrun --gloo -np 3 -H localhost:3 python tests/workers/bucket_worker.py OUT.pt [gloo]
    mpirun -np 2 python tests/workers/bucket_worker.py OUT.pt
"""
from __future__ import annotations

import sys

import torch
from torch import nn

# A case's steps: each a list of microsteps (global sample indices, whether it uses the
# ``extra`` head); every rank takes its share of each. ``set_to_none``: how zero_grad
# clears (False: backward adds into the last step's reduced gradients, in the buckets);
# ``rebuild``: a new reducer on the same parameters after each step (a new world).
TWO_STEPS = [[(range(0, 33), True)], [(range(40, 77), True)]]
CASES = {
    "plain": dict(steps=TWO_STEPS),
    # equal counts: from the second step on, launch divides by the right count
    "steady": dict(steps=[[(range(0, 33), True)], [(range(33, 66), True)], [(range(66, 99), True)]]),
    "in_place": dict(steps=TWO_STEPS, set_to_none=False),
    "rebuilt": dict(steps=TWO_STEPS, rebuild=True),
    "accumulate": dict(steps=[[(range(0, 20), True), (range(20, 47), True), (range(47, 60), False)],
                              [(range(60, 71), False), (range(71, 100), True)]]),
    "empty_rank": dict(steps=[[(range(100, 102), True)]]),
    # the head unused, and a rank without samples: the ranks with samples complete the
    # other buckets before the head's, the empty rank none; every rank must still send
    # them in one order (a torch.distributed group pairs sums by their order)
    "empty_rank_unused_head": dict(steps=[[(range(100, 102), False)], [(range(102, 135), True)]]),
    "fp16": dict(steps=TWO_STEPS, compression="fp16"),
}
BUCKET_BYTES = 4_000    # three buckets for this small model


class Net(nn.Module):
    """The digits classifier plus a head some microsteps skip (no gradient, no hook)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 96), nn.ReLU(),
                                  nn.Linear(96, 10))
        self.extra = nn.Linear(64, 10)

    def forward(self, x, extra: bool):
        out = self.body(x)
        return out + self.extra(x) if extra else out


def build() -> tuple[Net, torch.Tensor, torch.Tensor]:
    from jobs.digits import DigitsConfig, DigitsJob
    x, y = DigitsJob(DigitsConfig()).train_data()
    torch.manual_seed(0)
    return Net(), x, y


def loss_sum(net, x, y, indices, extra: bool):
    return nn.functional.cross_entropy(net(x[indices], extra), y[indices], reduction="sum")


def reference(case: str) -> list[dict]:
    """One process, the combined batch of every step: mean loss and mean gradients."""
    net, x, y = build()
    out = []
    for micro in CASES[case]["steps"]:
        net.zero_grad(set_to_none=True)
        total = sum(loss_sum(net, x, y, torch.tensor(list(idx)), extra) for idx, extra in micro)
        count = sum(len(idx) for idx, _ in micro)
        (total / count).backward()
        out.append({"loss": total.item() / count, "count": count,   # unused: zero, as fill_rest
                    "grads": {n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                              for n, p in net.named_parameters()}})
    return out


def run_case(case: str, hvd, collectives) -> list[dict]:
    from elastic.data.sampler import rank_share
    from elastic.dataparallel.reduce import BucketReducer
    from elastic.runtime.control import Pending
    spec = CASES[case]
    net, x, y = build()
    params = list(net.parameters())
    make = lambda: BucketReducer(params, hvd.rank(), hvd.size(), collectives,  # noqa: E731
                                 bucket_bytes=BUCKET_BYTES, expected_count=32,
                                 compression=spec.get("compression", "none"))
    reducer = make()
    assert len(reducer.buckets) >= 3, len(reducer.buckets)
    out = []
    for number, micro in enumerate(spec["steps"]):
        if number and spec.get("rebuild"):
            reducer.close()
            reducer = make()
        net.zero_grad(set_to_none=spec.get("set_to_none", True))
        loss_value, count = 0.0, 0
        for index, (indices, extra) in enumerate(micro):
            mine = rank_share(torch.tensor(list(indices)), hvd.rank(), hvd.size())
            reducer.before_backward(last=index == len(micro) - 1)
            if len(mine):          # as the step: no samples, no backward
                loss = loss_sum(net, x, y, mine, extra)
                loss.backward()
                loss_value, count = loss_value + loss.item(), count + len(mine)
        reduced = reducer.finish(Pending().control(loss_value, count, 0.0))
        out.append({"loss": reduced.agreed.loss, "count": reduced.agreed.count,
                    "nbytes": reduced.nbytes, "buckets": len(reducer.buckets),
                    "grads": {n: p.grad.clone() for n, p in net.named_parameters()}})
    reducer.close()
    return out


def main(path: str, sums: str = "horovod") -> None:
    """``sums``: what sums the buckets, as ``train.gradient_sums`` says (horovod | gloo)."""
    import horovod.torch as hvd
    from elastic.dataparallel.gloo_sums import GlooSums
    from elastic.runtime.collectives import HorovodCollectives
    from elastic.runtime.env import Env
    from elastic.runtime.torch_group import WorldGroup
    from elastic.runtime.world import World
    hvd.init()
    torch.set_num_threads(1)
    collectives = HorovodCollectives(hvd)
    group = WorldGroup(Env.read())
    if sums == "gloo":
        collectives = GlooSums(group, World.from_horovod(hvd, "localhost"), collectives)
    results = {case: run_case(case, hvd, collectives) for case in CASES}
    group.close()
    if hvd.rank() == 0:
        torch.save({"size": hvd.size(), "sums": sums, "cases": results}, path)


if __name__ == "__main__":
    main(*sys.argv[1:])
