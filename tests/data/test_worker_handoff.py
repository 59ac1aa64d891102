"""Loader workers that could not hand a batch over (a temporary folder too deep for a Unix socket) are an error
before the first batch, not a first batch that never comes: ours before their workers start, any loader under
HangSentinel when training starts. In fresh processes: a worker uses its parent's folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

SCRIPT = """
import torch
from torch.utils.data import DataLoader, TensorDataset
from lightning_accel import ResumableDataLoader

data = TensorDataset(torch.arange(32.0))
try:
    print("ours", next(iter(ResumableDataLoader(data, batch_size=8, shuffle=False, num_workers=1)))[0].tolist())
except RuntimeError as err:
    print("ours refused:", err)
try:
    print("plain", next(iter(DataLoader(data, batch_size=8, num_workers=1, timeout=5)))[0].tolist())
except RuntimeError as err:
    print("plain:", err)

from lightning.pytorch import LightningModule, Trainer
from lightning_accel import HangSentinel


class Net(LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0][:, None]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer = Trainer(max_steps=2, callbacks=[HangSentinel(exit_on_hang=False)], **quiet)
try:
    trainer.fit(Net(), DataLoader(data, batch_size=8, num_workers=1))
    print("sentinel: trained", trainer.global_step)
except RuntimeError as err:
    print("sentinel refused:", err)
"""


def run_under(tmpdir: str, cwd: str) -> str:
    env = {**os.environ, "TMPDIR": tmpdir}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_a_temporary_folder_too_deep_for_the_workers_socket_is_refused_before_they_start(tmp_path):
    deep = tmp_path / ("d" * max(1, 100 - len(str(tmp_path))))
    deep.mkdir()
    said = run_under(str(deep), str(tmp_path))
    # ours names the folder and the fixes; a plain DataLoader's worker drops the batch and the wait times out
    assert (
        f"ours refused: ResumableDataLoader: its 1 worker(s) would hand batches over through a Unix socket in the "
        f"temporary folder '{deep}/pymp-" in said
    ), said
    assert "Set TMPDIR to a shorter folder" in said and "set_sharing_strategy('file_system')" in said
    assert "plain: DataLoader timed out after 5 seconds" in said, said
    # a plain DataLoader under HangSentinel: refused when training starts, not found hung after the allowance
    assert "sentinel refused: DataLoader: its 1 worker(s) would hand batches over" in said, said

    short = tempfile.mkdtemp(prefix="h-", dir="/tmp")
    try:
        said = run_under(short, str(tmp_path))
    finally:
        shutil.rmtree(short, ignore_errors=True)
    assert said.splitlines() == [
        "ours [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]",
        "plain [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]",
        "sentinel: trained 2",
    ]
