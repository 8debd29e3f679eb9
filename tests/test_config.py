"""Config files and flags: unknown keys and bad values are named, never ignored."""
import subprocess

import pytest
import torch

from conftest import PYTHON, ROOT
from elastic.config import ConfigError, TrainConfig, load, parse_overrides
from jobs.digits import DigitsConfig


def write(tmp_path, text):
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def test_values_from_file_and_overrides(tmp_path):
    path = write(tmp_path, "[train]\nsteps = 7\nlr = 0.5\n[model]\nhidden = 16\n")
    config = load(path, {"train": TrainConfig, "model": DigitsConfig},
                  parse_overrides(["train.lr=0.25", "model.dropout=0"]))
    assert (config["train"].steps, config["train"].lr) == (7, 0.25)
    assert (config["model"].hidden, config["model"].dropout) == (16, 0.0)


@pytest.mark.parametrize("text, overrides, message", [
    ("[train]\nstepz = 3\n", [], "unknown key 'stepz'"),
    ("[trian]\nsteps = 3\n", [], "unknown table [trian]"),
    ("[train]\nsteps = 0\n", [], "train.steps must be > 0, got 0"),
    ("[train]\nsteps = 'many'\n", [], "train.steps must be an integer, got 'many'"),
    ("[train]\noptimizer = 'lbfgs'\n", [], "train.optimizer must be one of adam, adamw, sgd, got 'lbfgs'"),
    ("[train]\nsteps = 2.5\n", [], "must be an integer, got 2.5"),
    ("[model]\nhidden = -1\n", [], "model.hidden must be > 0, got -1"),
    ("[train\n", [], "not valid TOML"),
    ("", ["train.lr=fast"], "train.lr must be a number, got 'fast'"),
    ("", ["train.state_transfer=tcp"],
     "train.state_transfer must be one of auto, point_to_point, broadcast, got 'tcp'"),
])
def test_bad_config_names_the_problem(tmp_path, text, overrides, message):
    with pytest.raises(ConfigError) as err:
        load(write(tmp_path, text), {"train": TrainConfig, "model": DigitsConfig},
             parse_overrides(overrides))
    assert message in str(err.value)


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="must look like section.key=value"):
        parse_overrides(["lr0.1"])


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load(tmp_path / "nope.toml", {"train": TrainConfig})


def test_job_command_line_reports_config_errors():
    done = subprocess.run([PYTHON, "-m", "jobs.digits", "--set", "train.bogus=1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "unknown key 'bogus'" in done.stderr
    done = subprocess.run([PYTHON, "-m", "jobs.digits", "--steps", "-3"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "train.steps must be > 0, got -3" in done.stderr


def test_threads_per_rank_come_from_omp_num_threads_else_the_shared_cores():
    import os

    import torch

    from elastic.runtime.env import Env, EnvError
    from elastic.runtime.world import World, share_cores
    before = torch.get_num_threads()
    cores = os.cpu_count() or 1
    try:
        world = World(rank=0, size=4, local_rank=0, local_size=4, host="h")
        assert share_cores(world, Env.read({})) == max(1, cores // 4)
        assert share_cores(world, Env.read({"REGATTA_PROCS_PER_MACHINE": "1"})) == cores
        assert share_cores(world, Env.read({"OMP_NUM_THREADS": "1"})) == 1
        with pytest.warns(UserWarning, match=f"OMP_NUM_THREADS={cores + 1} for each of 4 processes"):
            assert share_cores(world, Env.read({"OMP_NUM_THREADS": str(cores + 1)})) == cores + 1
        assert torch.get_num_threads() == cores + 1
    finally:
        torch.set_num_threads(before)
    assert Env.read({"OMP_NUM_THREADS": "4,2"}).threads == 4   # OpenMP's nested levels
    for bad in ("-2", "two", "0"):
        with pytest.raises(EnvError, match="OMP_NUM_THREADS"):
            Env.read({"OMP_NUM_THREADS": bad})


def test_horovods_fusion_is_off_unless_the_environment_sets_it_or_tunes_it():
    from elastic.runtime.collectives import horovod_fusion_bytes
    from elastic.runtime.env import Env, EnvError
    assert [horovod_fusion_bytes(Env.read(env)) for env in
            ({}, {"HOROVOD_FUSION_THRESHOLD": "67108864"}, {"HOROVOD_FUSION_THRESHOLD": "0"},
             {"HOROVOD_AUTOTUNE": "1"}, {"HOROVOD_AUTOTUNE": "0"})] == [0, None, None, None, 0]
    assert [Env.read(env).horovod_fusion_threshold for env in
            ({}, {"HOROVOD_FUSION_THRESHOLD": " "}, {"HOROVOD_FUSION_THRESHOLD": "1048576"})] == \
        [None, None, 1 << 20]
    for bad in ("64MB", "-1", "1.5"):
        with pytest.raises(EnvError, match="HOROVOD_FUSION_THRESHOLD must be a whole number of bytes"):
            Env.read({"HOROVOD_FUSION_THRESHOLD": bad})
    # HOROVOD_AUTOTUNE as Horovod reads it (C's strtol > 0): "true" leaves it off there
    assert [Env.read({"HOROVOD_AUTOTUNE": text}).horovod_autotune for text in
            ("1", "2", " 1 ", "0", "true", "yes", "", "-1")] == [True, True, True] + [False] * 5


def test_horovods_gloo_interface_and_timeout_reach_a_torch_group_of_the_world():
    """horovodrun's --network-interface and --gloo-timeout-seconds, which the buckets'
    torch.distributed group (dataparallel/gloo_sums.py) takes on as Horovod's Gloo does."""
    from elastic.runtime.env import Env, EnvError
    assert [(e.gloo_iface, e.gloo_timeout_s) for e in (
        Env.read({}), Env.read({"HOROVOD_GLOO_IFACE": "rg0", "HOROVOD_GLOO_TIMEOUT_SECONDS": "3600"}))] == \
        [("", 30.0), ("rg0", 3600.0)]
    for bad in ("0", "-5", "soon"):
        with pytest.raises(EnvError, match="HOROVOD_GLOO_TIMEOUT_SECONDS must be a number of seconds > 0"):
            Env.read({"HOROVOD_GLOO_TIMEOUT_SECONDS": bad})


def test_horovods_cycle_on_the_cpu_is_20_ms_waking_5_not_unless_the_job_or_the_environment_names_one():
    from elastic.runtime.collectives import horovod_cycle_ms
    from elastic.runtime.device import wants_cpu
    from elastic.runtime.env import Env, EnvError
    unset = Env.read({})
    assert [horovod_cycle_ms(0, unset, on_cpu) for on_cpu in (True, False)] == [5.0, None]
    assert [horovod_cycle_ms(0, unset, on_cpu, wakes=True) for on_cpu in (True, False)] == [20.0, None]
    assert horovod_cycle_ms(3, unset, True, wakes=True) == 3
    assert [Env.read(env).horovod_wake for env in
            ({}, {"HOROVOD_WAKE_ON_ENQUEUE": "0"}, {"HOROVOD_WAKE_ON_ENQUEUE": "1"})] == [None, False, True]
    assert horovod_cycle_ms(1, unset, True) == horovod_cycle_ms(1, unset, False) == 1
    assert horovod_cycle_ms(2.5, Env.read({"HOROVOD_CYCLE_TIME": "1"}), True) is None   # the environment's wins
    assert [horovod_cycle_ms(2.5, Env.read(env), True) is None for env in
            ({}, {"HOROVOD_CYCLE_TIME": "1"}, {"HOROVOD_AUTOTUNE": "1"}, {"HOROVOD_AUTOTUNE": "0"})] == \
        [False, True, True, False]                        # a set cycle would pin the autotuner's
    assert Env.read({"HOROVOD_CYCLE_TIME": "2.5"}).horovod_cycle_time == 2.5
    for bad in ("fast", "-1", "nan"):
        with pytest.raises(EnvError, match="HOROVOD_CYCLE_TIME must be a number of milliseconds"):
            Env.read({"HOROVOD_CYCLE_TIME": bad})
    assert [wants_cpu(r) for r in ("", "cpu", "CPU", "cuda", "cuda:1")] == [True, True, True, False, False]
    assert wants_cpu("auto") == (not torch.cuda.is_available())
    assert TrainConfig().horovod_cycle_ms == 0
    with pytest.raises(ConfigError, match="train.horovod_cycle_ms must be >= 0"):
        TrainConfig(horovod_cycle_ms=-1)


def test_a_sync_goes_point_to_point_from_64_mib_unless_told():
    from elastic.dataparallel.state import point_to_point
    assert [point_to_point("auto", n) for n in (300_000, 64 * 2**20 - 1, 64 * 2**20)] == [False, False, True]
    assert point_to_point("point_to_point", 1) and not point_to_point("broadcast", 2**40)
