"""One attempt of a run whose world size changes between attempts (nodes leave and join), on gloo under torchrun.

torchrun --nproc-per-node W tests/checkpoint/world_change_run.py OUT_DIR PHASE [STOP_AT_STEP]

A model this test defines (BatchNorm between two linears, AdamW, a per-step LR schedule), accumulate_grad_batches=2
at 2 ranks, validation every epoch, ResumableDataLoader with shuffle; with WORLD_CHANGE_DATA=dali, DALIImageDataModule
over arrays instead (DALI's CPU backend; the crop keeps the whole image and nothing flips, so the weights can be
compared). DDP, or with WORLD_CHANGE_STRATEGY=zero2 / zero3 the accel_zero presets' settings on DeepSpeed's CPU engine,
fsdp for FSDP2 saving DCP folders, or a preset by name (WORLD_CHANGE_STRATEGY=accel_zero2 with
WORLD_CHANGE_ACCELERATOR=gpu). WORLD_CHANGE_STRATEGIES=zero2,zero3,fsdp instead runs one fit per strategy in turn in
the same processes, each in OUT_DIR/NAME.
Every rank appends what it trained to OUT_DIR/PHASE-rankR.json: for each micro-batch the global step it belongs to
and its sample ids; rank 0 adds the final step, LR and parameters. With STOP_AT_STEP, rank 0 gets a SIGTERM at the
batch after that step (inside an accumulation window); PreemptionCheckpoint saves at the next optimizer step and the
attempt exits 75.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset

from lightning_accel import (
    PreemptionCheckpoint,
    ResumableDataLoader,
    find_resume_checkpoint,
)
from lightning_accel.checkpoint import Preempted
from lightning_accel.strategies import AccelFSDPStrategy, close_gloo_process_group_at_exit
from lightning_accel.testing import quiet_trainer_kwargs
from tests.conftest import SigtermAt

SAMPLES, BATCH = 96, 4
ACCUMULATE_AT_2 = 2  # the run starts on 2 ranks: a step is 2 x 2 batches of 4


class Indexed(Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.randn(n, 6, generator=g), torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


class Net(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        # No bias before BatchNorm: its gradient is float noise, which Adam would scale up to full steps.
        self.net = nn.Sequential(nn.Linear(6, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
        self.trained: list[tuple[int, list[int]]] = []

    def training_step(self, batch, batch_idx):
        x, y, i = batch
        self.trained.append((self.trainer.global_step, i.tolist()))
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y, _ = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)  # Adam: what DeepSpeed's universal checkpoint carries
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
        return [opt], [{"scheduler": sched, "interval": "step"}]

    def train_dataloader(self):
        return ResumableDataLoader(Indexed(SAMPLES, 0), batch_size=BATCH, shuffle=True, seed=3)

    def val_dataloader(self):
        return DataLoader(Indexed(16, 1), batch_size=8)


class Images(Net):
    """The same training on DALI's images: the label of each image is its sample id, the target a table of them."""

    def __init__(self) -> None:
        super().__init__()
        self.net[0] = nn.Linear(3 * 2 * 2, 16, bias=False)  # images of 2 x 2 after the crop
        self.register_buffer("targets", torch.randn(SAMPLES, 1, generator=torch.Generator().manual_seed(4)))

    def training_step(self, batch, batch_idx):
        images, ids = batch
        return super().training_step((images.flatten(1), self.targets[ids], ids), batch_idx)

    def validation_step(self, batch, batch_idx):
        images, ids = batch
        return super().validation_step((images.flatten(1), self.targets[ids], ids), batch_idx)


def dali_data():
    from lightning_accel.data import DALIImageDataModule

    images = torch.randint(0, 256, (SAMPLES, 2, 3, 3), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    arrays = (images.numpy(), torch.arange(SAMPLES).numpy())
    return DALIImageDataModule(
        train_arrays=arrays,
        val_arrays=(arrays[0][:16], arrays[1][:16]),
        batch_size=BATCH,
        image_size=2,
        scale=(1.0, 1.0),
        ratio=(1.5, 1.5),  # the arrays' own aspect (3 wide, 2 high): the crop keeps the whole image
        center_crop_ratio=1.0,
        flip_prob=0.0,
        mean=(127.0,) * 3,
        std=(64.0,) * 3,
        device="cpu",
        num_threads=1,
        seed=3,
    )


ZERO_STAGES = {"zero2": 2, "zero3": 3}


def strategy(name: str):
    if name.startswith("accel_"):  # a preset by name (on GPUs)
        return name
    if name == "fsdp":  # FSDP2, its checkpoints torch DCP folders
        return AccelFSDPStrategy(save_distributed_checkpoint=True)
    if name in ZERO_STAGES:
        from tests.strategies.cpu_deepspeed import cpu_deepspeed

        return cpu_deepspeed(ZERO_STAGES[name], int(os.environ.get("WORLD_SIZE", "1")))
    return "ddp"


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def whole_parameters(model: Net, zero3: bool) -> dict[str, list]:
    """The parameters as lists; under ZeRO-3 and FSDP2 each rank holds a slice, gathered here (on every rank: a
    collective)."""
    if not zero3:
        return {name: full_tensor(p.detach()).tolist() for name, p in model.named_parameters()}
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {name: p.detach().tolist() for name, p in model.named_parameters()}


def attempt(out: Path, phase: str, stop_at: int | None, strategy_name: str) -> None:
    """One attempt's fit under one strategy, writing OUT/PHASE-rankR.json."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    dali = os.environ.get("WORLD_CHANGE_DATA") == "dali"
    torch.manual_seed(0)
    model = Images() if dali else Net()
    callbacks = [PreemptionCheckpoint(out / "ck", keep_last=None), *([SigtermAt(stop_at)] if stop_at else [])]
    trainer = Trainer(
        **quiet_trainer_kwargs(
            accelerator=os.environ.get("WORLD_CHANGE_ACCELERATOR", "cpu"),
            devices=world_size,
            strategy=strategy(strategy_name),
            max_epochs=2,
            accumulate_grad_batches=ACCUMULATE_AT_2,  # as the user's script says; a resume at 1 rank doubles it
            default_root_dir=str(out),
            callbacks=callbacks,
            limit_val_batches=2,
        )
    )
    if stop_at and trainer.global_rank != 0:
        callbacks.pop()  # the signal reaches rank 0 only; the others learn of it through the vote
    ckpt = find_resume_checkpoint(out / "ck")
    try:
        trainer.fit(model, datamodule=dali_data() if dali else None, ckpt_path=str(ckpt) if ckpt else None)
    except Preempted:
        pass
    record = {"world_size": world_size, "trained": model.trained, "accumulate": trainer.accumulate_grad_batches}
    params = whole_parameters(model, zero3=strategy_name == "zero3")
    if trainer.global_rank == 0:
        record.update(global_step=trainer.global_step, lr=trainer.optimizers[0].param_groups[0]["lr"], params=params)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{phase}-rank{trainer.global_rank}.json").write_text(json.dumps(record))


def main(out: Path, phase: str, stop_at: int | None) -> None:
    """The fit under WORLD_CHANGE_STRATEGY in OUT; or each of WORLD_CHANGE_STRATEGIES in turn in OUT/NAME, the way a
    sweep runs several fits in one process (one launch and one process group for all, their imports paid once)."""
    close_gloo_process_group_at_exit()  # stock "ddp" on gloo, as a user would run it
    if "WORLD_CHANGE_STRATEGIES" in os.environ:
        for name in os.environ["WORLD_CHANGE_STRATEGIES"].split(","):
            attempt(out / name, phase, stop_at, name)
    else:
        attempt(out, phase, stop_at, os.environ.get("WORLD_CHANGE_STRATEGY", "ddp"))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None)
