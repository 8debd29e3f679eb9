"""Pipeline pieces without processes: plan checks, cutting, schedules, checkpoints."""
from __future__ import annotations

import struct
import zipfile

import pytest
import torch
from torch import nn

from elastic.config import ConfigError
from elastic.pipeline import checkpoint as ckpt
from elastic.pipeline.config import PipelineConfig, balanced_starts, make_plan
from elastic.pipeline.grid import Grid, cut
from elastic.pipeline.schedule import gpipe, make_schedule, one_f_one_b, simulate
from jobs.charlm import main as charlm_main


def plan(world=4, children=6, batch=16, **kw):
    return make_plan(PipelineConfig(**kw), world, children, batch)


@pytest.mark.parametrize("kw, world, children, words", [
    (dict(pp=2, boundaries=[0, 3, 3]), 4, 6, ["lists 3 stage starts", "pp is 2"]),
    (dict(pp=3, boundaries=[0, 3, 3]), 3, 6, ["[0, 3, 3]", "stage 1 no layers"]),
    (dict(pp=2, boundaries=[1, 3]), 2, 6, ["[1, 3]", "must start at 0"]),
    (dict(pp=2, boundaries=[0, 6]), 2, 6, ["[0, 6]", "stage 1 no layers", "6 children"]),
    (dict(pp=7), 7, 6, ["pp = 7", "only 6 children"]),
    (dict(pp=4), 2, 6, ["pp = 4", "only 2 ranks"]),
    (dict(pp=2), 3, 6, ["world size 3", "not divisible", "pp = 2"]),
    (dict(pp=2, dp=3), 4, 6, ["dp = 3", "pp = 2", "world has 4"]),
    (dict(pp=2, microbatches=3), 4, 6, ["global_batch = 16", "2 x 3"]),
])
def test_bad_plans_name_the_values(kw, world, children, words):
    with pytest.raises(ConfigError) as err:
        plan(world=world, children=children, **kw)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize("kw, words", [
    (dict(schedule="zigzag"), ["pipeline.schedule", "'zigzag'"]),
    (dict(microbatches=0), ["pipeline.microbatches", "0"]),
    (dict(boundaries="0,x"), ["pipeline.boundaries", "0,x"]),
    (dict(pp=0), ["pipeline.pp", "0"]),
])
def test_bad_config_values_name_them(kw, words):
    with pytest.raises(ConfigError) as err:
        PipelineConfig(**kw)
    for word in words:
        assert word in str(err.value)


def test_command_line_bad_boundaries_exit_with_a_clear_message(capsys, tmp_path):
    with pytest.raises(SystemExit) as done:
        charlm_main(["--pp", "2", "--boundaries", "0,0", "--run-dir", str(tmp_path)])
    assert done.value.code == 2
    assert "pipeline.boundaries [0, 0] give stage 0 no layers" in capsys.readouterr().err


def test_balanced_and_explicit_partitions():
    assert balanced_starts(6, 2) == [0, 3] and balanced_starts(6, 4) == [0, 2, 4, 5]
    p = plan(world=4, children=6, pp=2, boundaries="0,2")
    assert p.stages == ((0, 2), (2, 6)) and p.dp == 2 and p.microbatch_size == 2
    assert [Grid(r, 2, 2).stage_peers() for r in range(4)] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert (Grid(3, 2, 2).replica, Grid(3, 2, 2).stage, Grid(3, 2, 2).prev_rank) == (1, 1, 2)


def test_cut_keeps_full_model_names_and_modules():
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 4), nn.Linear(4, 1))
    stage = cut(model, 2, 4)
    assert list(stage.state_dict()) == ["2.weight", "2.bias", "3.weight", "3.bias"]
    x = torch.randn(5, 3)
    assert torch.equal(stage(x), model[3](model[2](x)))


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_schedules_are_deadlock_free_and_1f1b_bounds_memory(pp, m):
    g = simulate([gpipe(s, pp, m) for s in range(pp)])
    o = simulate([one_f_one_b(s, pp, m) for s in range(pp)])
    assert g["peak_in_flight"] == [m] * pp
    assert o["peak_in_flight"] == [min(pp - s, m) for s in range(pp)]
    for s in range(pp):   # every microbatch forwarded and backwarded exactly once
        for actions in (gpipe(s, pp, m), one_f_one_b(s, pp, m)):
            assert sorted(a.microbatch for a in actions if a.kind == "fwd") == list(range(m))
            assert sorted(a.microbatch for a in actions if a.kind == "bwd") == list(range(m))


@pytest.mark.parametrize("pp", [2, 3])
@pytest.mark.parametrize("m", [1, 4, 8])
def test_replay_with_equal_compute_times_has_the_ideal_bubble(pp, m):
    # Forward 1 s and backward 2 s everywhere: the step lasts (m + pp - 1) * 3 s, the
    # bubble is (pp - 1) / (m + pp - 1), under either schedule.
    for make in (gpipe, one_f_one_b):
        lists = [make(s, pp, m) for s in range(pp)]
        durations = [[1.0 if a.kind == "fwd" else 2.0 for a in actions if a.kind in ("fwd", "bwd")]
                     for actions in lists]
        finish = simulate(lists, durations)["finish"]
        assert max(finish) == pytest.approx((m + pp - 1) * 3.0)
        assert finish[0] == max(finish)     # stage 0 runs the step's last backward
        assert 1 - 3.0 * m / max(finish) == pytest.approx((pp - 1) / (m + pp - 1))


def test_replay_waits_for_the_slower_stage():
    # GPipe, 2 stages, 2 microbatches; stage 1's first forward takes 5 s instead of 1:
    # stage 1 forwards [1, 6] and [6, 7], backwards [7, 9] and [9, 11]; stage 0's
    # backwards wait for those gradients: [9, 11], [11, 13].
    lists = [gpipe(s, 2, 2) for s in range(2)]
    finish = simulate(lists, [[1, 1, 2, 2], [5, 1, 2, 2]])["finish"]
    assert finish == [13, 11]


def test_simulator_catches_a_deadlock():
    # Stage 0 waits for the gradient of a microbatch it has not sent yet.
    first = make_schedule("gpipe", 0, 2, 1)
    broken = [[first[0], first[2], first[1], first[3]], make_schedule("gpipe", 1, 2, 1)]
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(broken)


def test_checkpoint_reloads_under_another_partition(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    stages = ((0, 1), (1, 4))
    for a, b in stages:
        part = cut(model, a, b)
        opt = torch.optim.Adam(part.parameters())
        part(torch.randn(2, 4)).sum().backward()
        opt.step()
        ckpt.save_stage(tmp_path, 7, (a, b), part, opt)
    ckpt.publish(tmp_path, 7, stages, {"epoch": 0, "consumed": 112})
    torch.manual_seed(1)
    other = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    part = cut(other, 0, 3)               # a new plan: children 0..2
    opt = torch.optim.Adam(part.parameters())
    manifest = ckpt.load_stage(tmp_path, (0, 3), part, opt)
    assert manifest["step"] == 7 and manifest["consumed"] == 112
    for name, tensor in part.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name])
    assert set(opt.state) == set(part.parameters())


def _checkpointed(folder, step, model, stages):
    for a, b in stages:
        part = cut(model, a, b)
        ckpt.save_stage(folder, step, (a, b), part, torch.optim.Adam(part.parameters()))
    ckpt.publish(folder, step, stages, {"epoch": 0, "consumed": step})


def test_a_corrupt_checkpoint_file_is_named_and_the_previous_one_kept(tmp_path):
    stages = ((0, 2), (2, 4))
    models = {}
    for step in (7, 9):
        torch.manual_seed(step)
        models[step] = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
        _checkpointed(tmp_path, step, models[step], stages)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000007", "step-00000009"]
    # One bit flipped inside a tensor of step 9's second file: torch.load would take it.
    broken = ckpt.stage_file(tmp_path, 9, 2, 4)
    data = bytearray(broken.read_bytes())
    with zipfile.ZipFile(broken) as archive:
        record = next(i for i in archive.infolist() if i.filename.endswith("/data/0"))
    name_len, extra_len = struct.unpack_from("<HH", data, record.header_offset + 26)
    data[record.header_offset + 30 + name_len + extra_len + 5] ^= 0x01   # a weight's byte
    broken.write_bytes(bytes(data))
    part = cut(nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)]), 0, 4)
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.load_stage(tmp_path, (0, 4), part, None)
    message = str(err.value)
    assert str(broken) in message and "CRC-32" in message
    assert "previous.json" in message and "step-00000007" in message
    # The way the message says: step 7 comes back, bit for bit.
    (tmp_path / "previous.json").replace(tmp_path / "latest.json")
    assert ckpt.load_stage(tmp_path, (0, 4), part, None)["step"] == 7
    for name, tensor in part.state_dict().items():
        assert torch.equal(tensor, models[7].state_dict()[name])
    # A third checkpoint keeps one before it, no more.
    _checkpointed(tmp_path, 11, models[9], stages)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000007", "step-00000011"]


class _NotWeights:
    pass


def test_a_checkpoint_file_with_arbitrary_objects_is_refused(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(2)])
    _checkpointed(tmp_path, 3, model, ((0, 2),))
    path = ckpt.stage_file(tmp_path, 3, 0, 2)
    torch.save({"children": (0, 2), "step": 3, "model": model.state_dict(),
                "optimizer": {}, "payload": _NotWeights()}, path)   # weights_only=False would run it
    with pytest.raises(ckpt.CheckpointError, match=str(path)):
        ckpt.load_stage(tmp_path, (0, 2), cut(model, 0, 2), None)
    (tmp_path / "latest.json").write_text("{not json")
    with pytest.raises(ckpt.CheckpointError, match="latest.json is not JSON"):
        ckpt.load_stage(tmp_path, (0, 2), cut(model, 0, 2), None)
