"""Training run used by the preemption tests: deterministic, resumable, optionally slow and multi-rank.

python tests/checkpoint/train_resumable.py --ckpt-dir D --out W.pt [--resume] [--progress P --step-delay S]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from lightning_accel import PreemptionCheckpoint, find_resume_checkpoint
from lightning_accel.demos import SyntheticTokenDataModule, TinyGPT
from lightning_accel.testing import QUIET_TRAINER


class GPTWithScheduler(TinyGPT):
    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return [opt], [{"scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.7), "interval": "step"}]


class Progress(Callback):
    """Writes the global step to a file after each batch and slows steps down so a signal lands mid-run."""

    def __init__(self, path: str | None, delay_s: float) -> None:
        self.path, self.delay_s = path, delay_s

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.path and trainer.is_global_zero:
            # write-then-rename: the test polls this file and must never read it half-written
            tmp = Path(self.path + ".tmp")
            tmp.write_text(str(trainer.global_step))
            os.replace(tmp, self.path)
        time.sleep(self.delay_s)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--progress")
    p.add_argument("--step-delay", type=float, default=0.0)
    p.add_argument("--max-steps", type=int, default=46)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--every-n-steps", type=int)
    args = p.parse_args()

    torch.set_num_threads(1)
    seed_everything(1234)
    model = GPTWithScheduler(vocab_size=32, seq_len=16, d_model=32, n_layers=2, n_heads=2, dropout=0.1)
    dm = SyntheticTokenDataModule(num_samples=160, val_samples=16, seq_len=16, vocab_size=32, batch_size=8, seed=5)
    ckpt = PreemptionCheckpoint(
        args.ckpt_dir, keep_last=2, async_save=args.async_save, every_n_steps=args.every_n_steps
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="accel_ddp" if args.devices > 1 else "auto",
        max_steps=args.max_steps,
        **QUIET_TRAINER,
        callbacks=[ckpt, Progress(args.progress, args.step_delay)],
    )
    ckpt_path = find_resume_checkpoint(args.ckpt_dir) if args.resume else None
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    if trainer.is_global_zero:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.out)


if __name__ == "__main__":
    main()
