"""Two-rank training used by the strategy tests: writes each rank's final weights and losses.

python tests/strategies/train_distributed.py --strategy accel_ddp --out DIR [--devices 2]
python tests/strategies/train_distributed.py --out DIR --run "NAME=--strategy accel_ddp" --run "NAME2=..." ...

Each ``--run`` is one fit with its own options, in DIR/NAME, one after another in the same two processes (Lightning's
launcher starts the second rank once; later Trainers find the ranks and the process group there), so a matrix of
strategies pays the imports and the process start once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_accel  # noqa: F401  (registers the presets)
from lightning_accel import Float8Training, PreemptionCheckpoint, TorchCompile, find_resume_checkpoint
from lightning_accel.demos import SyntheticTokenDataModule, TinyGPT
from lightning_accel.strategies import AccelFSDPStrategy
from lightning_accel.testing import quiet_trainer_kwargs


class RecordLoss(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def full_state(trainer: Trainer, model: TinyGPT) -> dict[str, torch.Tensor]:
    """Unsharded weights on every rank (FSDP2 parameters are DTensors)."""
    state = {}
    for name, tensor in model.state_dict().items():
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        state[name] = full.detach().cpu().clone()
    return state


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy")
    p.add_argument("--out", required=True)
    p.add_argument("--run", action="append", default=[], help="NAME=OPTIONS: one fit of several, in OUT/NAME")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--fp8", action="store_true", help="Float8Training in torchao's emulation (fp8 all-gather on FSDP2)")
    p.add_argument("--activation-checkpointing", action="store_true", help="fp32 FSDP2 with activation checkpointing")
    p.add_argument("--sharded-checkpoints", help="fp32 FSDP2 saving torch DCP folders to this folder or bucket URL")
    p.add_argument("--resume", action="store_true", help="resume from the newest valid folder there")
    return p


def fit(args: argparse.Namespace) -> None:
    """One fit as ``args`` say; every rank writes its weights, losses and strategy to ``args.out``."""
    torch.set_num_threads(1)
    seed_everything(0)
    out = Path(args.out)
    model = TinyGPT(vocab_size=32, seq_len=16, d_model=32, n_layers=2, n_heads=2, lr=3e-3)
    dm = SyntheticTokenDataModule(num_samples=256, val_samples=16, seq_len=16, vocab_size=32, batch_size=8)
    record = RecordLoss()
    callbacks = [record, ModelCheckpoint(dirpath=out / "ckpt", save_last=False, every_n_train_steps=args.max_steps)]
    record_fp8 = Float8Training(emulate=True) if args.fp8 else None
    if record_fp8 is not None:
        callbacks.append(record_fp8)
    if args.compile:
        callbacks.append(TorchCompile(backend="aot_eager"))
    strategy = AccelFSDPStrategy(activation_checkpointing=True) if args.activation_checkpointing else args.strategy
    ckpt_path = None
    if args.sharded_checkpoints:
        strategy = AccelFSDPStrategy(save_distributed_checkpoint=True)
        folder = args.sharded_checkpoints  # a local folder or a bucket URL
        callbacks = [record, PreemptionCheckpoint(folder, every_n_steps=5, keep_last=2)]
        ckpt_path = find_resume_checkpoint(folder) if args.resume else None
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.max_steps,
        callbacks=callbacks,
        **quiet_trainer_kwargs(enable_checkpointing=not args.sharded_checkpoints),
    )
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    rank = trainer.global_rank
    torch.save(full_state(trainer, model), out / f"weights_rank{rank}.pt")
    (out / f"losses_rank{rank}.json").write_text(json.dumps(record.losses))
    (out / f"strategy_rank{rank}.txt").write_text(type(trainer.strategy).__name__)
    if (
        record_fp8 is not None
    ):  # which tensors FSDP2 all-gathers: torchao's fp8-casting weights where the all-gather is in fp8
        local = {type(p.to_local() if hasattr(p, "to_local") else p).__name__ for p in model.parameters()}
        (out / f"fp8_rank{rank}.json").write_text(
            json.dumps({"converted": record_fp8.converted, "shards": sorted(local)})
        )


def main() -> None:
    args = parser().parse_args()
    runs = [(name, options.split()) for name, options in (run.split("=", 1) for run in args.run)]
    for name, options in runs:
        (Path(args.out) / name).mkdir(parents=True, exist_ok=True)
        fit(parser().parse_args([*options, "--out", str(Path(args.out) / name)]))
    if not runs:
        fit(args)
    if torch.distributed.is_initialized():
        # Both ranks have written their files before either exits: the test reads rank 1's files as
        # soon as rank 0 (the launching process) ends.
        torch.distributed.barrier()
    # Skip interpreter shutdown: FSDP2's DTensor caches keep the gloo group (and its threads) alive
    # past lightning_accel's exit hook, and gloo threads alive during shutdown occasionally abort a
    # finished run (pytorch/pytorch#190489). These runs test training, not exiting; the exit hook has
    # its own test (test_gloo_process_group_closed_before_interpreter_exit).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
