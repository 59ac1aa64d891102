"""A run for the GoodputMonitor tests: writes the monitor's results as JSON.

python tests/monitor/goodput_run.py --out DIR [--devices 2 --slow-rank 1] [--kill-at-step N] [--resume]

``--kill-at-step`` SIGKILLs the process at the end of that step (no hook runs, as when a node dies);
``--resume`` continues from the newest checkpoint in DIR/ckpt. ``--slow-rank`` makes one rank's training
step ``--slow-extra-s`` (40 ms) slower than ``--step-s`` (10 ms), the straggler the monitor must name.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.demos.boring_classes import BoringModel

import lightning_accel as la
from lightning_accel.testing import quiet_trainer_kwargs


class SlowStep(BoringModel):
    def __init__(self, slow_rank: int | None, step_s: float, slow_extra_s: float) -> None:
        super().__init__()
        self.slow_rank, self.step_s, self.slow_extra_s = slow_rank, step_s, slow_extra_s

    def training_step(self, batch, batch_idx):
        time.sleep(self.step_s + (self.slow_extra_s if self.global_rank == self.slow_rank else 0.0))
        return super().training_step(batch, batch_idx)


class KillAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--slow-rank", type=int, default=None)
    parser.add_argument("--kill-at-step", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--step-s", type=float, default=0.01)
    parser.add_argument("--sentinel", action="store_true", help="add a HangSentinel (floor 2 s): no alarm expected")
    parser.add_argument("--prometheus", action="store_true", help="scrape this rank's endpoint into the out dir")
    parser.add_argument("--slow-extra-s", type=float, default=0.04)
    args = parser.parse_args()
    torch.set_num_threads(1)
    seed_everything(0)
    ckpt_dir = args.out / "ckpt"
    exporter = la.PrometheusExporter(port=0) if args.prometheus else None
    monitor = la.GoodputMonitor(every_n_steps=5, progress_every_n_seconds=0.0, summary=False, prometheus=exporter)
    callbacks: list[Callback] = [monitor, la.PreemptionCheckpoint(dirpath=ckpt_dir, every_n_steps=5, keep_last=None)]
    if args.kill_at_step is not None:
        callbacks.append(KillAt(args.kill_at_step))
    if args.sentinel:
        callbacks.append(la.HangSentinel(floor_s=2, startup_s=60, poll_s=0.1, dirpath=args.out))
    trainer = Trainer(
        **quiet_trainer_kwargs(
            accelerator="cpu",
            devices=args.devices,
            strategy="ddp" if args.devices > 1 else "auto",
            max_steps=args.steps,
            limit_val_batches=0,
            default_root_dir=str(args.out),
            callbacks=callbacks,
        )
    )
    model = SlowStep(args.slow_rank, args.step_s, args.slow_extra_s)
    ckpt = la.find_resume_checkpoint(ckpt_dir) if args.resume else None
    trainer.fit(model, ckpt_path=ckpt)
    (args.out / f"results_rank{trainer.global_rank}.json").write_text(json.dumps(monitor.results))
    if exporter is not None:  # what Prometheus would scrape from this rank, read over loopback HTTP
        with urllib.request.urlopen(f"http://127.0.0.1:{exporter.bound_port}/metrics", timeout=10) as answer:
            (args.out / f"metrics_rank{trainer.global_rank}.txt").write_bytes(answer.read())
        exporter.close()


if __name__ == "__main__":
    la.strategies.close_gloo_process_group_at_exit()
    main()
