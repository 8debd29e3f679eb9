"""A user's own training script on Regatta: a CNN on a folder of image files, read by a
map-style Dataset through a DataLoader, AdamW with a cosine schedule, gradient clipping
and two accumulation microsteps. Nothing in it comes from jobs/.

    python examples/files_cnn.py --steps 300                        # one process
    mpirun -np 2 python examples/files_cnn.py --steps 300
    horovodrun -np 2 --min-np 1 --max-np 4 --host-discovery-script \
        "hostfiles/discover.sh hostfiles/hosts.txt" python examples/files_cnn.py
    regatta local examples/files_cnn.py --hosts 3 --steps 300 --kill 2@120

The first run writes the image files (scikit-learn's 8x8 digits, one .npy file per
image) into ``data.folder``; later runs read them.
"""
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

import regatta


@dataclass
class DataConfig:
    folder: str = "runs/digit-files"
    train_files: int = 600          # the rest of the 1797 images are held out


class DigitFiles(torch.utils.data.Dataset):
    """One .npy file per image, named <index>_<label>.npy."""

    def __init__(self, files: list[Path]):
        self.files = files

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        path = self.files[i]
        image = torch.from_numpy(np.load(path)).float().div(16).unsqueeze(0)
        index, label = (int(part) for part in path.stem.split("_"))
        return image, label, index


def write_files(folder: Path) -> None:
    """Materialise the data set as files once (a real user already has their files)."""
    from sklearn.datasets import load_digits
    folder.mkdir(parents=True, exist_ok=True)
    digits = load_digits()
    for index, (image, label) in enumerate(zip(digits.images, digits.target)):
        target = folder / f"{index:05d}_{label}.npy"
        if not target.exists():   # every rank may be writing: a private temporary name each
            tmp = folder / f".{target.name}.{os.getpid()}"
            with open(tmp, "wb") as handle:
                np.save(handle, image.astype(np.uint8))
            tmp.replace(target)


def datasets(cfg: DataConfig) -> tuple[DigitFiles, DigitFiles]:
    folder = Path(cfg.folder)
    if len(list(folder.glob("*.npy"))) < 1797:
        write_files(folder)
    files = sorted(folder.glob("*.npy"))
    return DigitFiles(files[:cfg.train_files]), DigitFiles(files[cfg.train_files:])


def build_model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))


def loss_fn(model, batch):
    images, labels, _ = batch
    return F.cross_entropy(model(images), labels)          # the batch's mean loss


def parts(configs: dict) -> dict:
    """Everything fit() needs; built the same way on every rank."""
    train_set, test_set = datasets(configs["data"])
    torch.manual_seed(configs["train"].seed)
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=configs["train"].lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=configs["train"].steps)

    @torch.no_grad()
    def evaluate(model) -> dict:
        images, labels, _ = torch.utils.data.default_collate([test_set[i] for i in range(len(test_set))])
        return {"accuracy": (model(images).argmax(1) == labels).float().mean().item()}

    return dict(model=model, data=train_set, loss=loss_fn, optimizer=optimizer,
                scheduler=scheduler, evaluate=evaluate)


def main(argv=None) -> dict:
    configs = regatta.config({"data": DataConfig}, argv, defaults={"train": {
        "steps": 300, "global_batch": 32, "lr": 0.003, "accumulate": 2, "clip_grad_norm": 1.0,
        "commit_every": "auto", "eval_every": 50, "loader_workers": 2}})
    return regatta.fit(**parts(configs), config=configs, name="files_cnn")


if __name__ == "__main__":
    main()
