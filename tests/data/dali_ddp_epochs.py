"""Two gloo ranks train on DALIImageDataModule for every source x last-batch case; each rank writes what it saw.

torchrun --nproc-per-node 2 tests/data/dali_ddp_epochs.py IMAGE_DIR OUT_DIR

Per case (folder | arrays, partial | drop | fill) and epoch: the size and sample ids of every training and
validation batch, ``len()`` of the loader at the start and the end of the epoch, and Lightning's count of
training batches. The images are solid colours whose red channel encodes the sample id (see test_data_dali).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from PIL import Image
from torch import nn

from lightning_accel.data import DALIImageDataModule
from lightning_accel.testing import quiet_trainer_kwargs

MEAN, STD = (100.0, 50.0, 20.0), (50.0, 25.0, 10.0)


def ids(images: torch.Tensor) -> list[int]:
    red = images[:, 0].mean(dim=(1, 2)) * STD[0] + MEAN[0]
    return [round(v / 10) for v in red.tolist()]


class Net(LightningModule):
    """BatchNorm fails loudly on an empty batch, which is what a short shard used to get."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(64, 3))
        self.seen: list[dict] = []

    def training_step(self, batch, batch_idx):
        images, labels = batch
        self.seen[-1]["train"].append(ids(images))
        return F.cross_entropy(self.net(images), labels)

    def validation_step(self, batch, batch_idx):
        images, _ = batch
        self.seen[-1]["val"].append(ids(images))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Lengths(Callback):
    def on_train_epoch_start(self, trainer, pl_module):
        pl_module.seen.append({"train": [], "val": [], "len_start": len(trainer.train_dataloader)})
        pl_module.seen[-1]["num_training_batches"] = trainer.num_training_batches

    def on_train_epoch_end(self, trainer, pl_module):
        pl_module.seen[-1]["len_end"] = len(trainer.train_dataloader)


def main() -> None:
    root, out = Path(sys.argv[1]), Path(sys.argv[2])
    files = sorted(root.rglob("*.png"), key=lambda f: int(f.stem))
    images = np.stack([np.asarray(Image.open(f).convert("RGB").resize((12, 10))) for f in files])
    labels = np.arange(len(files)) % 3
    torch.set_num_threads(1)
    results = {}
    for source in ("folder", "arrays"):
        for policy in ("partial", "drop", "fill"):
            data = (
                {"train_dir": str(root), "val_dir": str(root)}
                if source == "folder"
                else {"train_arrays": (images, labels), "val_arrays": (images, labels)}
            )
            dm = DALIImageDataModule(
                **data, batch_size=4, image_size=6, mean=MEAN, std=STD, last_batch=policy, num_threads=1, device="cpu"
            )
            model = Net()
            trainer = Trainer(
                accelerator="cpu",
                devices=2,
                strategy="ddp",
                max_epochs=3,
                callbacks=[Lengths()],
                **quiet_trainer_kwargs(limit_val_batches=None),
            )
            trainer.fit(model, datamodule=dm)
            results[f"{source}-{policy}"] = model.seen
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
