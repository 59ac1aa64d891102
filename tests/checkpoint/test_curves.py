"""What a user looks at after a preemption: the logged curves have no gap, and epoch-level values (self.log with
on_epoch=True, torchmetrics) equal the uninterrupted run's."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
import torchmetrics
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import TensorDataset

from lightning_accel.checkpoint import Preempted, PreemptionCheckpoint, find_resume_checkpoint
from lightning_accel.data import ResumableDataLoader
from tests.conftest import SigtermAt, tiny_trainer_kwargs


class Net(LightningModule):
    """Defined here: BatchNorm, Dropout, a per-step scheduler, and a value logged every step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.Dropout(0.2), nn.ReLU(), nn.Linear(32, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, on_step=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return [opt], [{"scheduler": torch.optim.lr_scheduler.StepLR(opt, 3, 0.5), "interval": "step"}]


class WithMetrics(Net):
    """Epoch values three ways: a mean and a max through self.log, and two torchmetrics metrics."""

    def __init__(self) -> None:
        super().__init__()
        self.mean_loss = torchmetrics.MeanMetric()
        self.accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=2, average="micro")

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.log("loss", loss, on_step=False, on_epoch=True)
        self.log("max_loss", loss, on_step=False, on_epoch=True, reduce_fx="max")
        self.mean_loss.update(loss)
        self.accuracy.update(logits.argmax(-1), y)
        return loss

    def on_train_epoch_end(self):
        self.log("metric_mean_loss", self.mean_loss.compute())
        self.log("metric_accuracy", self.accuracy.compute())
        self.mean_loss.reset()
        self.accuracy.reset()


def fit(root: Path, version: str, extra: list[Callback], ckpt_path: str | None = None, model=Net) -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(96, 8), torch.randint(0, 2, (96,)))
    callbacks = [PreemptionCheckpoint(root / "ck"), *extra]
    logger = CSVLogger(root, name="logs", version=version)
    trainer = Trainer(
        **tiny_trainer_kwargs(root, max_steps=20, log_every_n_steps=1, logger=logger, callbacks=callbacks)
    )
    trainer.fit(model(), ResumableDataLoader(data, batch_size=8, shuffle=True, seed=0), ckpt_path=ckpt_path)


def curve(root: Path, *versions: str, key: str = "train_loss") -> list[tuple[str, str]]:
    rows = []
    for version in versions:
        path = root / "logs" / version / "metrics.csv"
        if not path.exists():  # nothing logged before the preemption
            continue
        with open(path) as f:
            rows += [(r["step"], r[key]) for r in csv.DictReader(f) if r.get(key)]
    return rows


EPOCH_KEYS = ("loss", "max_loss", "metric_mean_loss", "metric_accuracy")


@pytest.mark.parametrize("stop_at", [5, 12])  # mid-epoch (12 batches an epoch), and in the second epoch
def test_the_preempted_step_is_logged_and_the_curve_equals_the_uninterrupted_one(tmp_path, stop_at):
    fit(tmp_path / "whole", "ref", [])
    with pytest.raises(Preempted) as stopped:
        fit(tmp_path / "cut", "first", [SigtermAt(stop_at)])
    assert stopped.value.checkpoint.name == f"step={stop_at + 1:08d}.ckpt"  # the step the signal landed in
    fit(tmp_path / "cut", "resumed", [], ckpt_path=find_resume_checkpoint(tmp_path / "cut" / "ck"))
    expected = curve(tmp_path / "whole", "ref")
    assert len(expected) == 20
    assert curve(tmp_path / "cut", "first", "resumed") == expected  # every step once, each value the same


@pytest.mark.parametrize("stop_at", [5, 13])  # mid-epoch in the first and in the second of two epochs
def test_epoch_values_after_a_mid_epoch_resume_equal_the_uninterrupted_ones(tmp_path, stop_at):
    """self.log(on_epoch=True) means and maxima and torchmetrics states of the interrupted epoch go through the
    checkpoint: every epoch value (12 batches an epoch) equals the uninterrupted run's, to the last bit."""
    fit(tmp_path / "whole", "ref", [], model=WithMetrics)
    with pytest.raises(Preempted):
        fit(tmp_path / "cut", "first", [SigtermAt(stop_at)], model=WithMetrics)
    resume = find_resume_checkpoint(tmp_path / "cut" / "ck")
    fit(tmp_path / "cut", "resumed", [], ckpt_path=resume, model=WithMetrics)
    for key in EPOCH_KEYS:
        expected = curve(tmp_path / "whole", "ref", key=key)
        assert len(expected) == 2, (key, expected)  # 20 steps: one whole epoch and the part of a second
        assert curve(tmp_path / "cut", "first", "resumed", key=key) == expected, key
