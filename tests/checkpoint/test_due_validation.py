"""The validation that was due right after the preempted step runs first on resume: EarlyStopping, ReduceLROnPlateau
and checkpoints on a validation metric see the uninterrupted run's validations."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import EarlyStopping
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.checkpoint import Preempted, PreemptionCheckpoint, find_resume_checkpoint
from lightning_accel.data import ResumableDataLoader
from tests.checkpoint.test_curves import Net, curve
from tests.conftest import SigtermAt, tiny_trainer_kwargs


class Validated(Net):
    """Validation every 5 steps, a metric with its best at step 15: EarlyStopping(patience=1) stops at step 20.
    The validation step draws randomness (it must not move training's), and ReduceLROnPlateau follows it."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        noise = torch.rand(()) * 1e-3
        self.log("val_loss", abs(self.global_step - 15) + noise)
        self.log("val_ce", torch.nn.functional.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
        return [opt], [{"scheduler": plateau, "interval": "step", "monitor": "val_loss", "frequency": 5}]


def fit(root: Path, version: str, stop_at: int | None = None, ckpt_path: str | None = None) -> Trainer:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(120, 8), torch.randint(0, 2, (120,)))
    val = DataLoader(TensorDataset(torch.randn(16, 8), torch.randint(0, 2, (16,))), batch_size=8)
    callbacks = [PreemptionCheckpoint(root / "ck"), EarlyStopping("val_loss", patience=1)]
    callbacks += [SigtermAt(stop_at)] if stop_at is not None else []
    kwargs = tiny_trainer_kwargs(root, max_epochs=10, val_check_interval=5, limit_val_batches=2)  # 15 an epoch
    logger = CSVLogger(root, name="logs", version=version)
    trainer = Trainer(**{**kwargs, "callbacks": callbacks, "logger": logger, "log_every_n_steps": 1})
    trainer.fit(Validated(), ResumableDataLoader(data, batch_size=8, shuffle=True, seed=0), val, ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize("stop_at", [19, 9])  # the step before a validation (20: where it stops; 10: mid-run)
def test_the_due_validation_runs_first_on_resume(tmp_path, stop_at):
    whole = fit(tmp_path / "whole", "ref")
    assert whole.global_step == 20  # the uninterrupted run stops at the validation after step 20
    with pytest.raises(Preempted) as stopped:
        fit(tmp_path / "cut", "first", stop_at=stop_at)
    assert stopped.value.checkpoint.name == f"step={stop_at + 1:08d}.ckpt"
    resumed = fit(tmp_path / "cut", "resumed", ckpt_path=find_resume_checkpoint(tmp_path / "cut" / "ck"))
    assert resumed.global_step == 20  # without the due validation it trained on to 25
    for key in ("val_loss", "val_ce"):
        assert curve(tmp_path / "cut", "first", "resumed", key=key) == curve(tmp_path / "whole", "ref", key=key)
    lr = [g["lr"] for t in (whole, resumed) for g in t.optimizers[0].param_groups]
    assert lr[0] == lr[1]  # ReduceLROnPlateau saw the same validations
    for a, b in zip(whole.lightning_module.parameters(), resumed.lightning_module.parameters(), strict=True):
        assert torch.equal(a, b)
