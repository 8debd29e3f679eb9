"""Rebalancing in real mpirun processes: a slowed stage loses children, the measured stage
imbalance falls, and training ends bit for bit where the static run ends.

One 2-rank mpirun launch runs every case of RUNS in turn (pp = 2, charlm with 8 children);
this file is also the worker:

    PYTHONPATH=. mpirun -np 2 --oversubscribe python tests/test_pipeline_rebalance.py OUT_DIR
"""
from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elastic.runtime.events import read_events  # noqa: E402
from elastic.pipeline.planner import PlannerConfig  # noqa: E402
from elastic.pipeline.rebalance import Balancer, recut, speeds  # noqa: E402

STEPS = 36
MODEL = dict(context=16, dim=32, heads=4, layers=8)      # 10 children: embed, 8 blocks, head
# name: (boundaries, slowed rank 1 by this factor, rebalance)
RUNS = {"static": ([0, 5], 3.0, False), "rebalanced": ([0, 5], 3.0, True),
        "lopsided": ([0, 1], 1.0, True)}


def worker(out: Path) -> None:
    from elastic.config import TrainConfig
    from elastic.pipeline.config import PipelineConfig
    from elastic.pipeline.rebalance import SLOW_ENV
    from elastic.train import train
    from jobs.charlm import CharLMConfig, CharLMJob
    job = CharLMJob(CharLMConfig(**MODEL))
    for name, (boundaries, factor, rebalance) in RUNS.items():
        os.environ[SLOW_ENV] = f"1:{factor}"
        rows = []
        # The static run commits at the interval the runtime chooses (Young/Daly), as a
        # data-parallel run would; a fixed-world pipeline's commit is its checkpoint.
        configs = {"train": TrainConfig(steps=STEPS, global_batch=16, lr=0.01, seed=5, progress=False,
                                        commit_every="auto" if name == "static" else STEPS,
                                        checkpoint_every=1,
                                        run_dir=str(out / name), db=str(out / "m.db")),
                   "pipeline": PipelineConfig(pp=2, microbatches=4, boundaries=boundaries,
                                              transport="mpi"),
                   "planner": PlannerConfig(rebalance=rebalance, rebalance_warmup=4,
                                            rebalance_window=4, rebalance_patience=2)}
        result = train(job, configs, callbacks=[rows.append])
        rank = rows[0]["rank"]
        (out / name / f"metrics-rank{rank}.json").write_text(json.dumps(rows))
        (out / name / f"result-rank{rank}.json").write_text(json.dumps(result))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from conftest import run
    out = tmp_path_factory.mktemp("rebalance")
    run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "OMP_NUM_THREADS",
         "-x", "PYTHONPATH", sys.executable, __file__, str(out)], timeout=360,
        env={"PYTHONPATH": str(ROOT)})
    return out


def stage_busy(out: Path, name: str) -> dict[int, list[float]]:
    """Step -> busy seconds of [stage 0, stage 1], from the metrics the trainer returned."""
    rows = [r for rank in (0, 1)
            for r in json.loads((out / name / f"metrics-rank{rank}.json").read_text())]
    busy: dict[int, list[float]] = {}
    for r in rows:
        busy.setdefault(r["step"], [0.0, 0.0])[r["stage"]] = r["busy_time"]
    return busy


def imbalance(busy: dict[int, list[float]], steps) -> float:
    """Median over ``steps`` of max / mean stage busy time."""
    return statistics.median(max(busy[s]) / (sum(busy[s]) / 2) for s in steps)


def moves(out: Path, name: str) -> list[dict]:
    return [e for e in read_events(out / name) if e["kind"] == "rebalance" and e["rank"] == 0]


def under_first_move(done: list[dict]) -> range:
    """Steps run under the first move's boundaries (it may be undone later if another
    partition measures faster: on a box whose cores are busy, evening stages out can
    add CPU demand instead of parallelism)."""
    return range(done[0]["step"] + 2, (done[1]["step"] if len(done) > 1 else STEPS) + 1)


pytestmark = pytest.mark.timeout(420)

BASE = [0.1] + [1.0] * 8 + [0.2]     # nominal child costs: embedding, 8 blocks, head


def test_recut_gives_a_slowed_stage_fewer_children():
    # Stage 1 ([5, 10): 4.2 nominal) took 3 x as long per nominal second as stage 0 (4.1).
    stages = ((0, 5), (5, 10))
    new, predicted, _ = recut(stages, [4.1, 3 * 4.2], BASE)
    assert speeds(stages, [4.1, 3 * 4.2], BASE) == pytest.approx([1.0, 3.0])
    assert new == ((0, 7), (7, 10)) and predicted == pytest.approx(6.6)   # max(6.1, 3 x 2.2)


def test_a_rank_keeps_the_speed_it_showed_with_the_most_work():
    seen = {}
    speeds(((0, 5), (5, 10)), [4.1, 3 * 4.2], BASE, seen)
    # After the move stage 1 holds 1.2 nominal seconds (< half of 4.2): what it measures
    # now (overhead, contention) does not replace the estimate from when it held 4.2.
    assert speeds(((0, 8), (8, 10)), [7.1, 1.2 * 6], BASE, seen) == pytest.approx([1.0, 3.0])
    assert speeds(((0, 6), (6, 10)), [5.1 * 1.5, 3.2 * 3], BASE, seen) == pytest.approx([1.5, 3.0])


def balancer(measured: dict, above: int = 0) -> Balancer:
    b = Balancer.__new__(Balancer)
    b.cfg, b.measured, b.seen, b.above, b.misses = PlannerConfig(rebalance=True), measured, {}, above, 0
    return b


def test_boundaries_return_to_the_fastest_measured_partition_and_never_flap():
    slow, fast = ((0, 5), (5, 10)), ((0, 7), (7, 10))
    b = balancer({slow: 1.0, fast: 2.0})      # the move to `fast` measured worse: go back
    assert b._decide(fast, [2.0, 1.0], BASE) == (slow, "return to the fastest measured", None)
    # At `slow` the model would propose `fast` again, but it was measured slower: stay.
    b = balancer({slow: 1.0, fast: 2.0}, above=5)
    assert b._decide(slow, [0.4, 1.0], BASE) is None
    b = balancer({slow: 1.0}, above=5)
    target, reason, predicted = b._decide(slow, [0.4, 1.0], BASE)
    assert target[0][1] > 5 and reason == "model" and predicted < 1.2


def test_recut_evens_out_a_lopsided_partition_despite_overhead():
    # The embedding alone "took" 30x its nominal cost (fixed per-microbatch overhead): too
    # little work to judge its machine by, so it counts at the other stage's speed.
    stages = ((0, 1), (1, 10))
    assert speeds(stages, [3.0, 8.2], BASE) == pytest.approx([1.0, 1.0])
    assert recut(stages, [3.0, 8.2], BASE)[0] == ((0, 5), (5, 10))


def test_slow_stage_loses_children_and_imbalance_falls(runs):
    assert moves(runs, "static") == []
    done = moves(runs, "rebalanced")
    assert done, "no rebalance event"
    first = done[0]
    assert first["old"] == [0, 5] and first["new"][1] > 5     # the slowed stage 1 shrank
    assert first["imbalance_before"] > 1.2 and first["imbalance_predicted"] < first["imbalance_before"]
    assert first["stage_busy"][1] > first["stage_busy"][0]
    busy, static = stage_busy(runs, "rebalanced"), stage_busy(runs, "static")
    before = imbalance(busy, range(1, first["step"] + 1))
    after = imbalance(busy, under_first_move(done))
    assert after < before and after < imbalance(static, under_first_move(done))
    ends = {e["rank"]: e for e in read_events(runs / "rebalanced") if e["kind"] == "rebalance"}
    assert ends[0]["new"] == ends[1]["new"]       # every rank took the same decision


def test_auto_commit_interval_is_chosen_for_a_pipeline_as_for_data_parallelism(runs):
    events = read_events(runs / "static")
    (choice,) = [e for e in events if e["kind"] == "commit_interval"][:1]
    assert choice["rank"] == 0 and choice["step"] == 10 and choice["interval"] != 10
    # The interval came from what a commit (here: the durable checkpoint) cost.
    first = [e for e in events if e["kind"] == "commit" and e["step"] == 10]
    assert len(first) == 2 and all(e["durable"] for e in first)
    assert choice["commit_cost_s"] == pytest.approx(first[0]["cost_s"] if first[0]["rank"] == 0
                                                    else first[1]["cost_s"], rel=1e-6)
    expected = max(round((2 * choice["commit_cost_s"] * choice["mtbr_s"]) ** 0.5 / choice["step_time_s"]),
                   -(-choice["commit_cost_s"] // (0.01 * choice["step_time_s"])))
    assert choice["interval"] == min(10_000, int(expected))
    commits = {e["rank"]: [c["step"] for c in events if c["kind"] == "commit" and c["rank"] == e["rank"]]
               for e in first}
    assert commits[0] == commits[1]          # every rank committed at the same steps


def test_rebalanced_training_equals_static_training_bitwise(runs):
    static = json.loads((runs / "static" / "result-rank0.json").read_text())
    rebalanced = json.loads((runs / "rebalanced" / "result-rank0.json").read_text())
    assert static["step"] == rebalanced["step"] == STEPS
    assert rebalanced["param_hash"] == static["param_hash"]
    assert rebalanced["loss"] == static["loss"]
    # The final checkpoint is written under the moved boundaries and still loads whole.
    last = moves(runs, "rebalanced")[-1]["new"]
    assert [s["children"][0] for s in rebalanced["stages"]] == last


def test_lopsided_partition_is_evened_out(runs):
    done = moves(runs, "lopsided")
    assert done and done[0]["old"] == [0, 1] and done[0]["new"][1] > 1
    busy = stage_busy(runs, "lopsided")
    assert imbalance(busy, under_first_move(done)) < imbalance(busy, range(1, done[0]["step"] + 1))


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
