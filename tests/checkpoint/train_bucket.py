"""A run that keeps its checkpoints in a bucket, for the object-storage tests (a model this file defines).

python tests/checkpoint/train_bucket.py --url s3://bucket/run --out W.pt [--resume] [--progress P --step-delay S]

BatchNorm, Dropout, AdamW with a per-step schedule, gradient accumulation 2, validation every 6 batches and a
torchmetrics accuracy; ResumableDataLoader, so a resumed run trains the uninterrupted run's batches. The endpoint and
credentials come from the standard AWS variables (the tests point them at their server on 127.0.0.1).
"""

from __future__ import annotations

import argparse
import logging

import torch
from lightning.pytorch import LightningDataModule, LightningModule, Trainer, seed_everything
from torch import nn
from torch.utils.data import TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from lightning_accel import PreemptionCheckpoint, ResumableDataLoader, find_resume_checkpoint
from lightning_accel.logs import defer_to_root
from lightning_accel.testing import quiet_trainer_kwargs
from tests.checkpoint.train_resumable import Progress


class BucketNet(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 3))
        self.accuracy = MulticlassAccuracy(num_classes=3, average="micro")

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.accuracy.update(logits.argmax(-1), y)
        self.log("train_acc", self.accuracy, on_step=False, on_epoch=True)
        return nn.functional.cross_entropy(logits, y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.8)
        return [opt], [{"scheduler": sched, "interval": "step"}]


def loaders(seed: int = 7) -> tuple[ResumableDataLoader, ResumableDataLoader]:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(192, 8, generator=g), torch.randint(0, 3, (192,), generator=g)
    train = ResumableDataLoader(TensorDataset(x[:160], y[:160]), batch_size=8, shuffle=True, seed=seed)
    val = ResumableDataLoader(TensorDataset(x[160:], y[160:]), batch_size=8)
    return train, val


class BucketData(LightningDataModule):
    """:func:`loaders` as a DataModule, for recipes (LightningCLI)."""

    def train_dataloader(self) -> ResumableDataLoader:
        return loaders()[0]

    def val_dataloader(self) -> ResumableDataLoader:
        return loaders()[1]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--progress")
    p.add_argument("--step-delay", type=float, default=0.0)
    p.add_argument("--every-n-steps", type=int, default=4)
    p.add_argument("--max-steps", type=int, default=30)
    args = p.parse_args()

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    defer_to_root()
    torch.set_num_threads(1)
    seed_everything(1234)
    model = BucketNet()
    train, val = loaders()
    ckpt = PreemptionCheckpoint(args.url, every_n_steps=args.every_n_steps, keep_last=2, async_save=True)
    trainer = Trainer(
        **quiet_trainer_kwargs(
            accelerator="cpu",
            devices=1,
            max_steps=args.max_steps,
            accumulate_grad_batches=2,
            limit_val_batches=2,
            val_check_interval=6,
            callbacks=[ckpt, Progress(args.progress, args.step_delay)],
        )
    )
    ckpt_path = find_resume_checkpoint(args.url) if args.resume else None
    print(f"resuming from {ckpt_path}", flush=True)
    trainer.fit(model, train_dataloaders=train, val_dataloaders=val, ckpt_path=ckpt_path)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.out)
    print(f"durable: {ckpt.durable}", flush=True)


if __name__ == "__main__":
    main()
