"""A step's seed (runtime/randomness.py): the same random numbers as torch.manual_seed,
different for every step and rank, without manual_seed's cost on a CPU run."""
import time

import torch

from elastic.runtime.randomness import seed_step, step_seed


def draws(seed_with) -> torch.Tensor:
    seed_with()
    return torch.rand(8)


def test_a_step_draws_what_torch_manual_seed_would_draw():
    ours = draws(lambda: seed_step(7, 120, 1))
    torch_s = draws(lambda: torch.manual_seed(7 * 1_000_003 + 120 * 1009 + 1))
    assert torch.equal(ours, torch_s)
    assert torch.equal(ours, draws(lambda: seed_step(7, 120, 1)))   # replays after a restore


def test_steps_and_ranks_draw_differently():
    seeds = {step_seed(7, step, rank) for step in range(200) for rank in range(8)}
    assert len(seeds) == 200 * 8
    assert not torch.equal(draws(lambda: seed_step(7, 120, 1)), draws(lambda: seed_step(7, 121, 1)))
    assert not torch.equal(draws(lambda: seed_step(7, 120, 1)), draws(lambda: seed_step(7, 120, 2)))


def median_seconds(operation, repeats: int = 200) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        operation()
        times.append(time.perf_counter() - started)
    return sorted(times)[repeats // 2]


def test_seeding_a_cpu_step_skips_the_queued_device_seeds():
    assert not torch.cuda.is_initialized()
    ours = median_seconds(lambda: seed_step(7, 120, 1))
    theirs = median_seconds(lambda: torch.manual_seed(7))
    # torch.manual_seed formats three stack traces here (about 90 us against 1-2 us);
    # the bound is loose so that a loaded machine cannot fail it.
    assert ours * 5 < theirs, (ours, theirs)
