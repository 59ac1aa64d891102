"""Exact-resume conformance: interrupted runs must end bitwise equal to an uninterrupted one.

    python tests/checkpoint/resume_matrix.py CONFIG_JSON OUT_DIR

CONFIG_JSON is one config or a list of them (all with the same "devices"), run one after another in this process,
config i in OUT_DIR/i: like a sweep, one process start and one set of imports for all. A config:
{"loader": "resumable"|"stateful"|"dali", "accumulate": 1|3, "val": bool, "async_save": bool,
"devices": 1|2, "workers": 0|2, "augment": bool, "scenarios": [...]} (see SCENARIOS). Every scenario runs
attempts in this process, each like a fresh run of the same script (seed_everything, new model and data,
resume from the newest valid checkpoint): an attempt is stopped by a SIGTERM the run sends itself (rank 1
only under DDP) at a chosen point, and the next attempt resumes. Writes OUT_DIR/result_rank{R}.json with, per
scenario, whether the final weights (BatchNorm buffers included), optimizer state, LR and the sequence of
trained sample ids equal the uninterrupted run's, every epoch value (a self.log mean and a torchmetrics
accuracy) and every validation's value as each attempt saw them, and the exit codes of the attempts.
"""

from __future__ import annotations

import gc
import json
import os
import random
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer, seed_everything
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchmetrics.classification import MulticlassAccuracy

from lightning_accel import (
    PreemptionCheckpoint,
    ResumableDataLoader,
    find_resume_checkpoint,
)
from lightning_accel.checkpoint import Preempted
from lightning_accel.data import PerSampleSeed, tag_epochs
from lightning_accel.strategies import close_gloo_process_group_at_exit
from lightning_accel.testing import quiet_trainer_kwargs

BATCH, SAMPLES, VAL_SAMPLES, EPOCHS = 4, 48, 12, 3
BATCHES_PER_EPOCH = SAMPLES // BATCH  # 12: accumulation 3 steps at batches 2, 5, 8, 11 of each epoch
EVERY_N_STEPS = 3  # periodic saves
VAL_EVERY = 9  # batches, counted across epochs: does not divide the epoch

# Stop points: (kind, global batch index for accumulate=1, for accumulate=3). A "train" signal is sent
# at the start of that batch; the save follows at the next optimizer-step boundary.
STOPS: dict[str, tuple[str, int, int]] = {
    "first_step": ("train", 0, 0),
    "mid_epoch_at_periodic": ("train", 5, 16),  # the signalled step is also a periodic save
    "after_resume": ("first", 0, 0),  # the first batch of a resumed attempt
    "epoch_end": ("train", 11, 11),
    "before_validation": ("train", 8, 8),  # the step is followed by a validation run
    "during_validation": ("val", 1, 1),  # validation batch 1 of the attempt's first validation run
    "sanity_check": ("sanity", 0, 0),
    "inside_accumulation": ("train", 3, 3),  # first micro-batch of a window (accumulate=3)
    "after_periodic": ("train", 3, 9),  # the batch after a periodic save
    "late_epoch_end": ("train", 23, 23),
}
SCENARIOS: dict[str, list[str]] = {
    "first_step": ["first_step"],
    "mid_epoch_then_after_resume": ["mid_epoch_at_periodic", "after_resume"],
    "epoch_end": ["epoch_end"],
    "before_validation": ["before_validation"],
    "during_validation": ["during_validation"],
    "sanity_check": ["sanity_check"],
    "inside_accumulation": ["inside_accumulation"],
    "three_in_a_row": ["after_periodic", "after_resume", "late_epoch_end"],
}


class IndexedImages(Dataset):
    """Seeded 3x6x6 images; item ``i`` is ``(image, label, i)`` so every trained sample is accounted for. With
    ``augment``, __getitem__ draws noise and a flip from the global generators, as image augmentation does."""

    def __init__(self, n: int, seed: int, augment: bool = False) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, 6, 6, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)
        self.augment = augment

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        x = self.x[i]
        if self.augment:
            x = x + 0.05 * torch.randn_like(x)
            x = x.flip(-1) if random.random() < 0.5 else x
        return x, self.y[i], i


class ConvNet(LightningModule):
    """BatchNorm, Dropout, AdamW with per-step and per-epoch schedules, a validation step that draws randomness, and
    epoch values: a loss mean through self.log (synced across ranks) and a torchmetrics accuracy."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Dropout(0.3), nn.Linear(4 * 4 * 4, 3)
        )
        self.accuracy = MulticlassAccuracy(num_classes=3, average="micro")
        self.seen: list[int] = []
        self.epoch_values: list[tuple[int, str, float]] = []  # (epoch, name, value) as this attempt saw them

    @staticmethod
    def split(batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if len(batch) == 3:
            return batch
        images, ids = batch  # DALI: the label carries the sample id
        return images, ids % 3, ids

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, ids = self.split(batch)
        self.seen.extend(int(i) for i in ids)
        logits = self.net(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        self.accuracy.update(logits.argmax(-1), y)
        return loss

    def on_train_epoch_end(self) -> None:
        self.epoch_values.append((self.current_epoch, "accuracy", float(self.accuracy.compute())))
        self.accuracy.reset()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = self.split(batch)
        noise = torch.rand(()) * 1e-3  # validation that uses the RNG must not change training
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y) + noise)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=3e-2, weight_decay=0.1)
        per_step = torch.optim.lr_scheduler.MultiplicativeLR(opt, lambda step: 0.97)
        per_epoch = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return [opt], [{"scheduler": per_step, "interval": "step"}, {"scheduler": per_epoch, "interval": "epoch"}]


class EpochLoss(Callback):
    """Records each epoch's logged train_loss aggregate once Lightning has computed it (at the next epoch's start,
    and at the end of training), and every validation's val_loss (the sequence EarlyStopping would see)."""

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            pl_module.epoch_values.append(
                (trainer.global_step, "val_loss", float(trainer.callback_metrics["val_loss"]))
            )

    def _record(self, trainer: Trainer, model: ConvNet, epoch: int) -> None:
        if "train_loss" in trainer.callback_metrics:  # (none yet at a resumed attempt's first epoch start)
            model.epoch_values.append((epoch, "train_loss", float(trainer.callback_metrics["train_loss"])))

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._record(trainer, pl_module, trainer.current_epoch - 1)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._record(trainer, pl_module, trainer.current_epoch)


class StatefulDistributedData(LightningDataModule):
    """What docs/checkpointing.md tells a StatefulDataLoader user under DDP: a StatefulDistributedSampler, built
    in ``train_dataloader()`` (the process group exists by then), so Lightning keeps it instead of wrapping."""

    def __init__(self, train: Dataset, val: Dataset | None, workers: int = 0) -> None:
        super().__init__()
        self.train, self.val, self.workers = train, val, workers

    def train_dataloader(self) -> DataLoader:
        return stateful_loader(self.train, self.workers)

    def val_dataloader(self) -> DataLoader | list:
        return DataLoader(self.val, batch_size=BATCH) if self.val is not None else []


def stateful_loader(train: Dataset, workers: int, **sampler_kwargs: Any) -> DataLoader:
    """A StatefulDataLoader over a StatefulDistributedSampler; with augmentation, as docs/checkpointing.md shows:
    PerSampleSeed and tag_epochs."""
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

    sampler = StatefulDistributedSampler(train, shuffle=True, seed=7, **sampler_kwargs)
    if getattr(train, "augment", False):
        train, sampler = PerSampleSeed(train, seed=7), tag_epochs(sampler)
    return StatefulDataLoader(train, batch_size=BATCH, sampler=sampler, num_workers=workers)


def build_data(cfg: dict[str, Any]) -> dict[str, Any]:
    # Every rank sees SAMPLES per epoch, so the stop points below hold for any world size.
    augment, workers = cfg.get("augment", False), cfg.get("workers", 0)
    train = IndexedImages(SAMPLES * cfg["devices"], seed=1, augment=augment)
    val = IndexedImages(VAL_SAMPLES * cfg["devices"], seed=2)
    if cfg["loader"] == "dali":
        from lightning_accel.data import DALIImageDataModule

        def arrays(ds: IndexedImages) -> tuple[np.ndarray, np.ndarray]:
            images = ((ds.x.permute(0, 2, 3, 1).clamp(-2, 2) + 2) * 63).to(torch.uint8).numpy()
            return images, np.arange(len(ds))  # labels = sample ids

        dm = DALIImageDataModule(
            train_arrays=arrays(train),
            val_arrays=arrays(val) if cfg["val"] else None,
            batch_size=BATCH,
            image_size=6,
            scale=(0.5, 1.0),
            mean=(127.0,) * 3,
            std=(64.0,) * 3,
            device="cpu",
            num_threads=1,
            seed=3,
        )
        return {"datamodule": dm}
    if cfg["loader"] == "stateful" and cfg["devices"] > 1:
        return {"datamodule": StatefulDistributedData(train, val if cfg["val"] else None, workers)}
    if cfg["loader"] == "stateful" and augment:
        loader: DataLoader = stateful_loader(train, workers, num_replicas=1, rank=0)
    elif cfg["loader"] == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = StatefulDataLoader(train, batch_size=BATCH, shuffle=True, num_workers=workers)
    else:
        loader = ResumableDataLoader(train, batch_size=BATCH, shuffle=True, seed=7, num_workers=workers)
    data: dict[str, Any] = {"train_dataloaders": loader}
    if cfg["val"]:
        data["val_dataloaders"] = DataLoader(val, batch_size=BATCH)
    return data


class SendSigterm(Callback):
    """Sends SIGTERM to this process at one stop point (on rank ``rank`` only)."""

    def __init__(self, stop: str, accumulate: int, rank: int) -> None:
        self.kind, at1, at3 = STOPS[stop]
        self.at = at1 if accumulate == 1 else at3
        self.rank = rank
        self.sent = False
        self.validations = 0

    def _send(self, trainer: Trainer) -> None:
        if not self.sent and trainer.global_rank == self.rank:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.kind == "first" or (
            self.kind == "train" and trainer.current_epoch * BATCHES_PER_EPOCH + batch_idx == self.at
        ):
            self._send(trainer)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self.validations += 1

    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self.kind == "sanity" and trainer.sanity_checking:
            self._send(trainer)
        if self.kind == "val" and not trainer.sanity_checking and self.validations == 1 and batch_idx == self.at:
            self._send(trainer)


def fit(cfg: dict[str, Any], ckpt_dir: Path, stop: str | None) -> tuple[int, Trainer, ConvNet]:
    seed_everything(1234)
    model = ConvNet()
    callbacks: list[Callback] = [
        PreemptionCheckpoint(ckpt_dir, every_n_steps=EVERY_N_STEPS, keep_last=2, async_save=cfg["async_save"]),
        EpochLoss(),
    ]
    if stop is not None:
        callbacks.append(SendSigterm(stop, cfg["accumulate"], rank=1 if cfg["devices"] > 1 else 0))
    validation = (
        {
            "limit_val_batches": 1.0,
            "num_sanity_val_steps": 2,
            "val_check_interval": VAL_EVERY,
            "check_val_every_n_epoch": None,
        }
        if cfg["val"]
        else {}
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=cfg["devices"],
        strategy="ddp" if cfg["devices"] > 1 else "auto",
        max_epochs=EPOCHS,
        accumulate_grad_batches=cfg["accumulate"],
        callbacks=callbacks,
        default_root_dir=str(ckpt_dir.parent),
        **quiet_trainer_kwargs(**validation),
    )
    try:
        trainer.fit(model, ckpt_path=find_resume_checkpoint(ckpt_dir), **build_data(cfg))
        code = 0
    except Preempted as stopped:
        code = int(stopped.code)
    return code, trainer, model


def final_state(trainer: Trainer, model: ConvNet) -> dict[str, Any]:
    opt = trainer.optimizers[0]
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": opt.state_dict(),
        "lr": opt.param_groups[0]["lr"],
        "global_step": trainer.global_step,
    }


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    diffs = [f"model.{k}" for k in a["model"] if not torch.equal(a["model"][k], b["model"][k])]
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    for pid in sa:
        diffs += [
            f"optimizer.{pid}.{k}"
            for k in sa[pid]
            if not torch.equal(torch.as_tensor(sa[pid][k]), torch.as_tensor(sb[pid][k]))
        ]
    diffs += [name for name in ("lr", "global_step") if a[name] != b[name]]
    return diffs


def main() -> None:
    configs, out = json.loads(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    close_gloo_process_group_at_exit()  # stock "ddp" on gloo, as a user would run it
    if isinstance(configs, dict):
        run_config(configs, out)
    else:
        for i, cfg in enumerate(configs):
            run_config(cfg, out / str(i))
            # A finished config's DALI pipelines are cyclic garbage: collected here, where their threads live. Left
            # to a collection inside a later config's forked loader worker, their destructor waits forever on a
            # condition variable of a thread the fork did not copy (seen once: DALI's Executor2::~Impl).
            gc.collect()


def run_config(cfg: dict[str, Any], out: Path) -> None:
    """The reference run and every scenario of one config; writes OUT/result_rank{R}.json."""
    code, trainer, model = fit(cfg, out / "reference" / "ck", None)
    if code != 0:
        raise SystemExit(f"the uninterrupted reference run exited with code {code}")
    reference, reference_seen = final_state(trainer, model), list(model.seen)
    reference_epochs = list(model.epoch_values)
    results: dict[str, Any] = {}
    for name in cfg["scenarios"]:
        stops = SCENARIOS[name]
        ckpt_dir = out / name / "ck"
        seen: list[int] = []
        epoch_values: list[tuple[int, str, float]] = []
        codes = []
        for stop in [*stops, None]:
            code, trainer, model = fit(cfg, ckpt_dir, stop)
            codes.append(code)
            seen += model.seen
            epoch_values += model.epoch_values
            if code == 0:
                break
        results[name] = {
            "codes": codes,
            "differences": differences(reference, final_state(trainer, model)),
            "seen_equal": seen == reference_seen,
            "seen_first_mismatch": next(
                (i for i, (a, b) in enumerate(zip(seen, reference_seen, strict=False)) if a != b),
                min(len(seen), len(reference_seen)),
            ),
            "seen_lengths": [len(seen), len(reference_seen)],
            "epoch_values": [list(v) for v in epoch_values],
            "reference_epoch_values": [list(v) for v in reference_epochs],
        }
    (out / f"result_rank{trainer.global_rank}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
