"""A real SIGTERM to this process after the last training step, in each hook that runs before fit() returns.

python tests/checkpoint/late_signal.py DIR    prints "returned after <hook>" once fit() has returned, for each hook
"""

from __future__ import annotations

import os
import signal
import sys

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel import PreemptionCheckpoint
from lightning_accel.testing import quiet_trainer_kwargs


class Net(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.1), nn.Linear(8, 2))

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def signal_in(hook: str) -> Callback:
    def send(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)

    return type(f"SigtermIn_{hook}", (Callback,), {hook: send})()


if __name__ == "__main__":
    root = sys.argv[1]
    data = DataLoader(TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,))), batch_size=8)
    for hook in ("on_train_end", "on_fit_end", "teardown"):
        # the signalling callback after ours and before it; a teardown hook after PreemptionCheckpoint's own runs
        # with the handlers put back as they were before fit(), so only the one before it is ours to cover
        for late_first in (False, True) if hook != "teardown" else (True,):
            callbacks = [PreemptionCheckpoint(f"{root}/{hook}", every_n_steps=2), signal_in(hook)]
            kwargs = quiet_trainer_kwargs(accelerator="cpu", max_steps=4, default_root_dir=root)
            Trainer(**kwargs, callbacks=callbacks[::-1] if late_first else callbacks).fit(Net(), data)
            print(f"returned after {hook}", flush=True)
