"""What the elastic fleet test's recipe trains: a model and data defined here, and a callback that records every
micro-batch each worker trains (one JSON line each, written as it happens: a worker killed with its node leaves
what it did behind).

Each record: the world size and the step the worker's fit started from (together they name its group), the global
step the micro-batch goes into, and its sample ids. Rank 0 also writes the step reached to ``progress`` so the test
knows when to take a node away or bring one back.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule
from torch import nn
from torch.utils.data import Dataset

from lightning_accel import PreemptionCheckpoint, ResumableDataLoader

SAMPLES, BATCH, SEED = 96, 4, 11


class Indexed(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(SAMPLES, 6, generator=g), torch.randn(SAMPLES, 1, generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


class FleetData(LightningDataModule):
    def train_dataloader(self):
        return ResumableDataLoader(Indexed(), batch_size=BATCH, shuffle=True, seed=SEED)


class FleetNet(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Record(Callback):
    """Appends each micro-batch to ``folder/<pid>.jsonl``; sleeps ``delay_s`` per batch so the test can act mid-run.

    ``hold_from_step``: a group of one rank holds before each batch from that global step on, up to ``hold_s``, for
    the node the test brings in: that node's agent then regroups a run that has not finished, however long its start
    takes on a slow machine (without the hold, the one rank left could finish the run first, and a join after the
    end is, rightly, no membership change).
    """

    def __init__(self, folder: str, delay_s: float = 0.0, hold_from_step: int | None = None, hold_s: float = 90.0):
        self.folder, self.delay_s = Path(folder), delay_s
        self.hold_from_step, self.hold_s = hold_from_step, hold_s

    def on_train_start(self, trainer, pl_module):
        self.folder.mkdir(parents=True, exist_ok=True)
        self.group = {"world_size": trainer.world_size, "from_step": trainer.global_step}
        self.file = open(self.folder / f"{os.getpid()}.jsonl", "a")  # open for the whole fit
        self.held = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        due = self.hold_from_step is not None and trainer.global_step >= self.hold_from_step
        if due and trainer.world_size == 1 and not self.held:  # until the agent stops this worker for the new node
            self.held = True
            stops = [cb.stop_signals for cb in trainer.callbacks if isinstance(cb, PreemptionCheckpoint)]
            deadline = time.monotonic() + self.hold_s
            while time.monotonic() < deadline and not any(stop.received is not None for stop in stops):
                time.sleep(0.1)
        ids = batch[2].tolist()
        record = {**self.group, "rank": trainer.global_rank, "step": trainer.global_step, "ids": ids}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        time.sleep(self.delay_s)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.is_global_zero:
            tmp = self.folder / "progress.tmp"
            tmp.write_text(str(trainer.global_step))
            os.replace(tmp, self.folder / "progress")


def step_reached(folder: Path) -> int:
    """The global step rank 0 last wrote to ``folder/progress`` (-1 before the first)."""
    progress = folder / "progress"
    return int(progress.read_text()) if progress.exists() else -1


def world_sizes(folder: Path) -> set[int]:
    """The world sizes of the groups that have trained so far (each worker's first record)."""
    return {json.loads(p.read_text().split("\n")[0])["world_size"] for p in folder.glob("*.jsonl") if p.stat().st_size}
