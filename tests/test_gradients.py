"""Data parallel over real MPI ranks equals one process on the combined batch."""
import torch

from conftest import PYTHON, ROOT, mpirun
from jobs.digits import DigitsConfig, DigitsJob


def reference():
    job = DigitsJob(DigitsConfig(dropout=0.0))
    torch.manual_seed(0)
    model = job.build_model()
    x, y = job.train_data()
    loss = torch.nn.functional.cross_entropy(model(x[:33]), y[:33])
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def test_two_rank_gradients_equal_single_process(tmp_path):
    out = tmp_path / "grads.pt"
    mpirun(2, PYTHON, str(ROOT / "tests" / "workers" / "grad_worker.py"), str(out))
    got = torch.load(out)
    loss, grads = reference()
    assert got["count"] == 33
    assert abs(got["loss"] - loss) < 1e-5
    assert grads.keys() == got["grads"].keys()
    for name, grad in grads.items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=name)
