"""IdleMonitor: a fit that stops stepping, or a process that outlives its fit, is said loudly, exported, and runs the
user's command only when one is configured."""

from __future__ import annotations

import logging
import sys
import time
import urllib.request

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_accel as la
from tests.conftest import tiny_trainer_kwargs
from tests.helpers.prometheus import sample


class StallsAtStep3(LightningModule):
    """BatchNorm and a scheduler; step 3 takes 0.8 s (a validation that hangs, a paused notebook)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        if self.global_step == 3:
            time.sleep(0.8)
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.01)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, 2)]


def fit(tmp_path, monitor: la.IdleMonitor) -> None:
    trainer = Trainer(**tiny_trainer_kwargs(tmp_path, max_steps=6, callbacks=[monitor]))
    trainer.fit(StallsAtStep3(), DataLoader(TensorDataset(torch.randn(48, 4)), batch_size=4))


def writer(path) -> list[str]:
    """A command that appends the reason it was run for to ``path``."""
    code = "import os,sys; open(sys.argv[1], 'a').write(os.environ['LIGHTNING_ACCEL_IDLE_REASON'] + '\\n')"
    return [sys.executable, "-c", code, str(path)]


def test_a_fit_without_steps_is_reported_and_the_commands_run_once_each(tmp_path, caplog):
    ran = tmp_path / "ran.txt"
    # 0.5 s: one alarm inside the 0.8 s stall (a second would need 1.0 s; 0.4 s put it on the edge)
    monitor = la.IdleMonitor(idle_after_s=0.5, poll_s=0.05, on_idle=writer(ran), after_fit=writer(ran))
    with caplog.at_level(logging.WARNING, logger="lightning_accel.monitor.idle"):
        fit(tmp_path, monitor)
        monitor.close()
    assert ran.read_text() == "idle\nfinished\n"  # on_idle once (during the stall), after_fit once
    assert monitor.ran == [("idle", 0), ("finished", 0)] and monitor.alarms == 1
    assert "min without an optimizer step on rank 0: the machines are paid for and train nothing" in caplog.text
    assert "IdleMonitor: training has finished" in caplog.text


def test_a_process_that_outlives_its_fit_is_reported_again_and_again(tmp_path, caplog):
    monitor = la.IdleMonitor(idle_after_s=0.2, poll_s=0.02)
    with caplog.at_level(logging.WARNING, logger="lightning_accel.monitor.idle"):
        fit(tmp_path, monitor)
        alarms_at_end = monitor.alarms
        time.sleep(0.75)  # the notebook stays open
        monitor.close()
    assert monitor.alarms >= alarms_at_end + 2 and monitor.ran == []  # nothing configured: nothing runs
    assert "since training finished on rank 0" in caplog.text
    assert "(IdleMonitor(on_idle=...) can run a command then)" in caplog.text


def test_idle_seconds_are_exported_and_nothing_runs_by_default(tmp_path):
    exporter = la.PrometheusExporter(port=0)
    monitor = la.IdleMonitor(idle_after_s=100, poll_s=0.05, prometheus=exporter, watch_after_fit=False)
    fit(tmp_path, monitor)
    with urllib.request.urlopen(f"http://127.0.0.1:{exporter.bound_port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    monitor.close()
    exporter.close()
    assert sample(text, "lightning_accel_idle_finished", rank="0") == 1.0
    assert 0 <= sample(text, "lightning_accel_idle_seconds_since_step", rank="0") < 5
    assert monitor.alarms == 0 and monitor.ran == []


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match=r"idle_after_s and poll_s must be > 0, got 0 and 5\.0"):
        la.IdleMonitor(idle_after_s=0)
    with pytest.raises(ValueError, match="an empty command; give None to run nothing"):
        la.IdleMonitor(on_idle="")
    assert la.IdleMonitor(on_idle="sudo shutdown -h now").on_idle == ["sudo", "shutdown", "-h", "now"]
