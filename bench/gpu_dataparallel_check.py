"""The data-parallel step through the real runtime on CUDA and on the CPU, compared.

On a machine with a GPU:

    PYTHONUNBUFFERED=1 python3 bench/gpu_dataparallel_check.py 2>&1 | tee $OUT/gpu_dp.log

Here, without one (the CUDA arms become CPU arms, so the script cannot rot):

    .venv/bin/python bench/gpu_dataparallel_check.py --cpu-only

Each arm is ``regatta.fit`` in this process (one rank: the runtime, the engine, the
reducer with the step's agreement, the DataLoader over a map-style Dataset, commits and a
checkpoint), on the same seed and data:

* fp32 on the device vs fp32 on the CPU: every step's loss within ``--rtol`` (TF32 off);
* bf16 autocast on the device: the loss falls;
* fp16 autocast with a GradScaler on the device (CUDA only): the loss falls, and the
  scaler's state is in the committed state (the checkpoint holds it).

Prints one line per arm and PASS/FAIL; exit status 0 when every check passed.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import regatta  # noqa: E402


class Noisy(torch.utils.data.Dataset):
    """A learnable classification set, served item by item like files would be."""

    def __init__(self, size: int = 2048):
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, 32, generator=generator)
        self.y = (self.x[:, :8].sum(1) > 0).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def arm(tmp: Path, name: str, device: str, autocast: str, steps: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 2))
    losses = []
    config = regatta.TrainConfig(steps=steps, global_batch=64, lr=0.003, optimizer="adamw",
                                 device=device, autocast=autocast, loader_workers=1,
                                 run_dir=str(tmp / name), db=str(tmp / "m.db"), progress=False,
                                 commit_every=10, checkpoint_every=1)
    regatta.fit(model=model, data=Noisy(), config=config, name=name,
                loss=lambda m, b: nn.functional.cross_entropy(m(b[0]).float(), b[1]),
                callbacks=[lambda r: losses.append(r["loss"])])
    saved = torch.load(Path(config.checkpoint_path), weights_only=True)
    return {"losses": losses, "device": str(next(model.parameters()).device),
            "committed": sorted(saved["objects"])}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-only", action="store_true", help="no GPU: the device arms run on the CPU")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rtol", type=float, default=1e-4)
    opts = parser.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    device = "cpu" if opts.cpu_only else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device visible: run with --cpu-only")
        return 2
    checks = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        reference = arm(tmp, "cpu-fp32", "cpu", "", opts.steps)
        on_device = arm(tmp, f"{device}-fp32", device, "", opts.steps)
        worst = max(abs(a - b) / abs(b) for a, b in zip(on_device["losses"], reference["losses"]))
        checks.append((f"fp32 {device} vs cpu, worst relative loss difference {worst:.2e}",
                       worst <= opts.rtol and on_device["device"].startswith(device)))
        falls = [("bf16", "")] + ([] if opts.cpu_only else [("fp16", "scaler")])
        for autocast, needs in falls:
            result = arm(tmp, f"{device}-{autocast}", device, autocast, opts.steps)
            first, last = sum(result["losses"][:5]) / 5, sum(result["losses"][-5:]) / 5
            ok = last < 0.7 * first and (not needs or needs in result["committed"])
            checks.append((f"{autocast} autocast on {device}: loss {first:.3f} -> {last:.3f}, "
                           f"committed {result['committed']}", ok))
    for text, ok in checks:
        print(("PASS " if ok else "FAIL ") + text)
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
