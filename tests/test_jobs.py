"""The two jobs learn what they claim in the README, as a single process."""
import json
import subprocess

from conftest import PYTHON, ROOT


def run_job(tmp_path, job, *args):
    done = subprocess.run([PYTHON, "-m", f"jobs.{job}", "--run-dir", str(tmp_path), "--db", "",
                           "--no-progress", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={"OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((tmp_path / "result.json").read_text())


def test_digits_reaches_95_percent(tmp_path):
    result = run_job(tmp_path, "digits")          # the default config: 300 steps
    assert result["step"] == 300
    assert result["metrics"]["accuracy"] >= 0.95


def test_charlm_beats_the_unigram_baseline(tmp_path):
    # A smaller model and fewer steps than the default keep this test short; it still
    # has to learn far more than character frequencies.
    result = run_job(tmp_path, "charlm", "--steps", "150", "--set", "model.dim=64",
                     "--set", "model.layers=2", "--global-batch", "32")
    metrics = result["metrics"]
    assert metrics["unigram_loss"] > 3.2
    assert metrics["test_loss"] < 0.8 * metrics["unigram_loss"]


def test_digits_are_scikit_learns_without_importing_it():
    check = subprocess.run([PYTHON, "-c", """
import sys
from jobs.digits import load_digits
images, labels = load_digits()
assert "sklearn" not in sys.modules, "scikit-learn was imported"
from sklearn.datasets import load_digits as reference
bunch = reference()
assert images.shape == (1797, 64) and (images == bunch.data).all()
assert (labels == bunch.target).all() and labels.dtype.kind == "i"
print("same")
"""], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert check.stdout.strip() == "same", check.stderr[-2000:]
