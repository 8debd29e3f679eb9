"""The planner: exact partitions and grid choices from given layer costs, measured costs'
bytes, config validation, and `regatta plan` on the charlm job."""
from __future__ import annotations

import argparse
import json

import pytest
import torch
from torch import nn

from elastic.config import ConfigError
from elastic.pipeline.config import PipelineConfig, balanced_starts, make_plan
from elastic.pipeline.planner import (LayerCosts, PlannerConfig, add_parser, candidates, choose,
                                      main, measure_layer_costs, partition, plan_grid)

FREE = PlannerConfig(bandwidth_gbps=1e9, latency_us=0.0)   # communication costs nothing


def costs(seconds, params=None, out=None, batch=16) -> LayerCosts:
    n = len(seconds)
    return LayerCosts(seconds=tuple(seconds), param_bytes=tuple(params or [0] * n),
                      out_bytes=tuple(out or [0] * n), batch=batch)


def by_sum(values, speeds=None):
    speeds = speeds or [1.0] * len(values)
    return lambda a, b, s: speeds[s] * sum(values[a:b])


@pytest.mark.parametrize("values, pp, expected", [
    ([1] * 6, 4, ((0, 2), (2, 4), (4, 5), (5, 6))),            # = balanced_starts(6, 4)
    ([1] * 6, 2, ((0, 3), (3, 6))),
    ([1, 1, 1, 1, 4, 1, 1, 1, 1], 3, ((0, 4), (4, 5), (5, 9))),  # the heavy layer alone
    ([5, 1, 1, 1, 1, 1], 2, ((0, 1), (1, 6))),
    ([1, 2, 3, 4], 2, ((0, 3), (3, 4))),
    ([1, 2, 3, 4], 4, ((0, 1), (1, 2), (2, 3), (3, 4))),
    ([3, 3, 3], 1, ((0, 3),)),
])
def test_partition_minimises_the_slowest_stage_exactly(values, pp, expected):
    assert partition(len(values), pp, by_sum(values)) == expected


def test_uniform_ties_match_the_hand_balanced_partition():
    for n in range(1, 9):
        for pp in range(1, n + 1):
            starts = [a for a, _ in partition(n, pp, by_sum([1] * n))]
            assert starts == balanced_starts(n, pp), (n, pp)


def test_partition_prefers_the_most_even_split_among_optimal_ones():
    # Bottleneck 10 is forced by the first child; [10 | 2 2 | 2 2] beats [10 | 2 | 2 2 2].
    assert partition(5, 3, by_sum([10, 2, 2, 2, 2])) == ((0, 1), (1, 3), (3, 5))


def test_a_slow_stage_gets_fewer_children():
    # Stage 1 runs 3x slower: max(x, 3 (8 - x)) is smallest at x = 6.
    assert partition(8, 2, by_sum([1] * 8, [1.0, 3.0])) == ((0, 6), (6, 8))
    assert partition(8, 2, by_sum([1] * 8, [3.0, 1.0])) == ((0, 2), (2, 8))


def test_partition_rejects_impossible_counts():
    with pytest.raises(ConfigError, match="cannot split 2 children into 3"):
        partition(2, 3, by_sum([1, 1]))


def test_grid_choice_from_compute_alone():
    # 16 samples per step, 4 microbatches, layer seconds measured on 16 samples.
    # dp=4 pp=1: 10/16 s per slot x 4 slots = 2.5; dp=2 pp=2: [1 2 3 | 4] 6/8 x 5 = 3.75;
    # dp=1 pp=4: 4/4 x 7 = 7.
    found = candidates(costs([1, 2, 3, 4]), 4, 16, 4, FREE)
    assert [(c.dp, c.pp, c.stages, c.step_time) for c in found] == [
        (4, 1, ((0, 4),), 2.5), (2, 2, ((0, 3), (3, 4)), 3.75),
        (1, 4, ((0, 1), (1, 2), (2, 3), (3, 4)), 7.0)]


def test_a_costly_allreduce_favours_the_pipeline():
    # 1 GB of parameters per child at 1 GB/s: ring allreduce 2 (dp-1)/dp x stage bytes.
    slow_net = PlannerConfig(bandwidth_gbps=1.0, latency_us=0.0)
    c = costs([1, 2, 3, 4], params=[10**9] * 4)
    best = choose(c, 4, 16, 4, slow_net)
    assert (best.dp, best.pp, best.stages) == (2, 2, ((0, 3), (3, 4)))
    assert best.allreduce == pytest.approx(3.0) and best.step_time == pytest.approx(6.75)
    assert plan_grid(c, 4, 1, 4, 16, slow_net).step_time == pytest.approx(2.5 + 6.0)


def test_activation_traffic_moves_the_cut():
    # Equal compute; cutting after child 0 sends 8 bytes per sample, after child 1 none.
    net = PlannerConfig(bandwidth_gbps=1e-9, latency_us=0.0)   # 1 byte/s
    c = costs([1, 1, 1, 1], out=[128, 0, 128, 128], batch=16)
    assert plan_grid(c, 1, 2, 1, 16, net).stages == ((0, 2), (2, 4))
    assert plan_grid(c, 1, 2, 1, 16, FREE).stages == ((0, 2), (2, 4))
    c = costs([1, 1, 1, 1], out=[0, 128, 128, 128], batch=16)
    assert plan_grid(c, 1, 2, 1, 16, net).stages == ((0, 1), (1, 4))


def test_limits_and_infeasible_grids_are_named():
    c = costs([1, 1])
    with pytest.raises(ConfigError) as err:
        choose(c, 3, 16, 4, FREE)
    text = str(err.value)
    assert "world size 3" in text and "dp=3 pp=1" in text and "16 not divisible by" in text
    assert "dp=1 pp=3: pp = 3 > 2 children" in text
    limited = PlannerConfig(pp_min=2, pp_max=2, bandwidth_gbps=1e9, latency_us=0)
    assert [(x.dp, x.pp) for x in candidates(costs([1, 2, 3, 4]), 4, 16, 4, limited)] == [(2, 2)]


@pytest.mark.parametrize("kw, words", [
    (dict(pp_min=0), ["planner.pp_min", "0"]),
    (dict(pp_min=3, pp_max=2), ["planner.pp_max (2)", "planner.pp_min (3)"]),
    (dict(rebalance_threshold=0.9), ["planner.rebalance_threshold", "0.9"]),
    (dict(rebalance_window=0), ["planner.rebalance_window", "0"]),
    (dict(bandwidth_gbps=0), ["planner.bandwidth_gbps", "0"]),
])
def test_bad_planner_config_names_the_values(kw, words):
    with pytest.raises(ConfigError) as err:
        PlannerConfig(**kw)
    for word in words:
        assert word in str(err.value)


def test_measured_costs_have_exact_sizes():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    c = measure_layer_costs(model, torch.randn(5, 8), lambda out: out.sum(), repeats=2)
    assert c.batch == 5 and c.names == ("Linear", "ReLU", "Linear")
    assert c.param_bytes == ((8 * 16 + 16) * 4, 0, (16 * 4 + 4) * 4)
    assert c.out_bytes == (5 * 16 * 4, 5 * 16 * 4, 5 * 4 * 4)
    assert all(s > 0 for s in c.seconds)
    assert all(p.grad is None for p in model.parameters())   # measuring leaves no gradients


def plan_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    cut = argv.index("--")
    args = parser.parse_args(list(argv[:cut]))
    args.job_args = list(argv[cut + 1:])
    return args


SMALL = ["--set", "model.dim=32", "--set", "model.layers=3", "--set", "model.context=16",
         "--global-batch", "16"]


def test_regatta_plan_prints_a_plan_that_make_plan_accepts(capsys):
    args = plan_args("plan", "charlm", "--np", "4", "--pp-max", "4", "--microbatches", "2",
                     "--repeats", "1", "--json", "--", *SMALL)
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["costs"]["seconds"]) == 5 and out["costs"]["batch"] == 8
    shapes = [(c["dp"], c["pp"]) for c in out["candidates"]]
    assert sorted(shapes) == [(1, 4), (2, 2), (4, 1)]
    times = [c["step_time"] for c in out["candidates"]]
    assert times == sorted(times)
    for c in out["candidates"]:
        starts = [a for a, _ in c["stages"]]
        plan = make_plan(PipelineConfig(pp=c["pp"], dp=c["dp"], microbatches=2, boundaries=starts),
                         4, 5, 16)
        assert plan.stages == tuple(map(tuple, c["stages"]))


def test_regatta_plan_table_marks_the_choice_and_infeasible_grids(capsys):
    args = plan_args("plan", "charlm", "--np", "3", "--microbatches", "2", "--repeats", "1",
                     "--", *SMALL)
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "<- chosen" in out and "infeasible: global_batch 16 not divisible by dp x " \
                                  "microbatches = 3 x 2" in out
    assert "   1   3   2" in out    # dp=1 pp=3 is the one that fits
