"""A 2-rank run for the HangSentinel tests (torchrun --nproc-per-node 2 tests/monitor/hang_run.py OUT MODE).

MODE: ``step`` (rank 1 sleeps forever inside training_step at global step 12), ``loader`` (rank 1's loader worker
sleeps forever fetching a sample of that step), ``none`` (a balanced run). The hang happens in the first attempt
only (TORCHELASTIC_RESTART_COUNT 0), so under ``--max-restarts 1`` the second attempt resumes from the last
periodic checkpoint and finishes. Each rank that finishes writes OUT/done-rank{R}.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch import nn
from torch.utils.data import Dataset

from lightning_accel import PreemptionCheckpoint, ResumableDataLoader, find_resume_checkpoint
from lightning_accel.monitor import HangSentinel
from lightning_accel.testing import quiet_trainer_kwargs

HANG_STEP = 12
HANG_RANK = int(os.environ.get("HANG_RANK", "1"))  # the GPU check hangs rank 0 of 1 (one GPU, NCCL)
DEVICES, ACCELERATOR = int(os.environ.get("DEVICES", "2")), os.environ.get("ACCELERATOR", "cpu")
FIRST_ATTEMPT = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
OUT, MODE = Path(sys.argv[1]), sys.argv[2]


def sleep_forever(where: str) -> None:
    (OUT / f"hang-started-{where}").write_text(str(time.time()))
    while True:
        time.sleep(1)


class Samples(Dataset):
    """Sample i is (features, label, i); in ``loader`` mode rank 1's worker never returns the samples of the
    hang step."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(512, 8, generator=g), torch.randint(0, 2, (512,), generator=g)
        self.fetched = 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        self.fetched += 1
        # the worker's count of samples fetched: batches of 8, so the hang step's batch starts at 8 * HANG_STEP
        if MODE == "loader" and FIRST_ATTEMPT and os.environ["RANK"] == "1" and self.fetched > 8 * HANG_STEP:
            sleep_forever("loader")
        return self.x[i], self.y[i], i


class Net(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.1), nn.Linear(16, 2))

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        if MODE == "step" and FIRST_ATTEMPT and self.global_rank == HANG_RANK and self.global_step == HANG_STEP:
            sleep_forever("step")
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y, _ = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def train_dataloader(self):
        return ResumableDataLoader(Samples(), batch_size=8, shuffle=True, seed=0, num_workers=1)

    def val_dataloader(self):
        return ResumableDataLoader(Samples(), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    seed_everything(0)
    sentinel = HangSentinel(factor=10, floor_s=3, startup_s=60, poll_s=0.25)
    callbacks = [PreemptionCheckpoint(OUT / "ck", every_n_steps=5), sentinel]
    trainer = Trainer(
        **quiet_trainer_kwargs(
            accelerator=ACCELERATOR,
            devices=DEVICES,
            strategy="accel_ddp",
            max_steps=30,
            val_check_interval=10,
            limit_val_batches=4,
            default_root_dir=str(OUT),
            callbacks=callbacks,
        )
    )
    ckpt = find_resume_checkpoint(OUT / "ck") if (OUT / "ck").exists() else None
    trainer.fit(Net(), ckpt_path=str(ckpt) if ckpt else None)
    done = {"global_step": trainer.global_step, "resumed_from": str(ckpt), "report": sentinel.report is not None}
    (OUT / f"done-rank{trainer.global_rank}.json").write_text(json.dumps(done))


if __name__ == "__main__":
    main()
