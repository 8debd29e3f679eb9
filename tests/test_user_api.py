"""The public API as a user script meets it: any dtype, a run that raises, clear errors for
things that cannot be trained, and what a launcher may be asked to start."""
import json

import pytest
import torch
from torch import nn

import regatta
from conftest import PYTHON, ROOT, mpirun
from elastic.launch.target import Target, TargetError
from monitor.store import Store


def test_bf16_parameters_and_bf16_autocast_train_under_mpirun(tmp_path):
    mpirun(2, "-x", "PYTHONPATH", PYTHON, str(ROOT / "tests" / "workers" / "bf16_worker.py"),
           str(tmp_path), timeout=240)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for name, dtype in (("bf16_params", "torch.bfloat16"), ("bf16_autocast", "torch.float32")):
        mine, other = ranks[0][name], ranks[1][name]
        assert mine["dtypes"] == [dtype]
        assert mine["param_hash"] == other["param_hash"]          # replicas stayed identical
        assert mine["losses"] == other["losses"]                  # the agreed global loss
        first, last = sum(mine["losses"][:5]) / 5, sum(mine["losses"][-5:]) / 5
        assert last < 0.6 * first, (name, first, last)


def tiny_fit(tmp_path, **overrides):
    x = torch.randn(64, 4)
    y = (x.sum(1) > 0).long()
    model = nn.Linear(4, 2)
    config = regatta.TrainConfig(steps=12, global_batch=16, run_dir=str(tmp_path / "run"),
                                 db=str(tmp_path / "m.db"), progress=False, commit_every=4)
    kwargs = dict(model=model, data=(x, y), loss=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
                  config=config, name="tiny")
    return regatta.fit(**{**kwargs, **overrides})


def test_a_run_that_raises_ends_failed_with_its_message(tmp_path):
    def exploding(model, batch):
        if regatta.context().step == 7:
            raise ValueError("the data went bad at step 7")
        return nn.functional.cross_entropy(model(batch[0]), batch[1])

    with pytest.raises(ValueError, match="went bad"):
        tiny_fit(tmp_path, loss=exploding)
    store = Store(str(tmp_path / "m.db"))
    (run,) = store.runs()
    (failed,) = store.events(run["id"], kinds=["run_failed"])
    store.close()
    assert run["status"] == "failed" and run["last_step"] == 7
    assert run["error"] == failed["detail"]["error"] == "ValueError: the data went bad at step 7"


def test_what_cannot_be_trained_is_named(tmp_path):
    other = nn.Linear(4, 2)
    with pytest.raises(regatta.ConfigError, match="optimizer holds parameters that are not the model's"):
        tiny_fit(tmp_path, optimizer=torch.optim.SGD(other.parameters(), lr=0.1))
    with pytest.raises(regatta.ConfigError, match="'ema' cannot be committed"):
        tiny_fit(tmp_path, track={"ema": object()})
    with pytest.raises(regatta.ConfigError, match="training data is empty"):
        tiny_fit(tmp_path, data=(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long)))
    with pytest.raises(RuntimeError, match="no training is running"):
        regatta.log({"x": 1.0})


def test_launch_targets(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    assert Target.parse("digits").python_args() == ["-m", "jobs.digits"]
    assert Target.parse("mypkg.train").python_args() == ["-m", "mypkg.train"]
    assert Target.parse(str(script)).python_args() == [str(script)]
    assert Target.from_python_args(["-m", "a.b"]) == Target("module", "a.b")
    # a Horovod script parses its own command line (Regatta's flags go in REGATTA_ARGS);
    # a job importing horovod.torch inside a function is not one (bench/throughput_worker.py)
    assert Target.parse(str(ROOT / "examples" / "horovod_mnist_elastic.py")).keeps_command_line
    assert Target.parse(str(ROOT / "tests" / "workers" / "horovod_mnist_elastic_stock.py")).keeps_command_line
    assert not Target.parse(str(ROOT / "bench" / "throughput_worker.py")).keeps_command_line
    # the benches' stock Horovod loops take Regatta's flags too (bench_recovery's had run
    # 700 steps of defaults with no events, its --run-dir in REGATTA_ARGS)
    assert not Target.parse("bench.stock_elastic").keeps_command_line
    assert not Target.parse("digits").keeps_command_line
    with pytest.raises(TargetError, match="missing.py does not exist"):
        Target.parse(str(tmp_path / "missing.py"))
    with pytest.raises(TargetError, match="defines no pipeline_job"):
        from elastic.pipeline.planner import add_parser, main
        import argparse
        parser = argparse.ArgumentParser()
        add_parser(parser.add_subparsers(dest="command"))
        main(parser.parse_args(["plan", str(script), "--np", "2"]))


def test_readme_shows_the_example_script_as_it_is():
    """The README's Python excerpt is the example file's own lines, unchanged."""
    import re
    script = (ROOT / "examples" / "files_cnn.py").read_text()
    (excerpt,) = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert excerpt.count("\n") >= 4 and excerpt in script


def test_gpu_check_script_runs_on_cpu():
    """bench/gpu_dataparallel_check.py, the device check a GPU machine runs, in its CPU
    mode: the same engine path, so the script cannot rot between GPU runs."""
    from conftest import run
    done = run([PYTHON, str(ROOT / "bench" / "gpu_dataparallel_check.py"), "--cpu-only",
                "--steps", "30"], timeout=240)
    assert done.stdout.count("PASS ") == 2 and "FAIL" not in done.stdout, done.stdout
