"""Two gloo ranks train on a stream through ResumableStreamLoader: whole, cut by a SIGTERM to rank 1, resumed.

torchrun --nproc-per-node 2 tests/data/stream_ddp.py OUT_DIR PHASES [STOP_AT]

PHASES is ``whole``, ``cut`` or ``resume``, or several of them comma-separated, run in turn in the same ranks. Each
rank writes the sample ids it trained on and a digest of its final weights to OUT_DIR/PHASE-rankR.json. The stream
shards itself by rank and by loader worker.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer

from lightning_accel import PreemptionCheckpoint, ResumableStreamLoader, find_resume_checkpoint
from lightning_accel.checkpoint import Preempted
from lightning_accel.testing import quiet_trainer_kwargs
from tests.conftest import SigtermAt
from tests.data.test_stream import Net, Stream


class RankStream(Stream):
    """Rank r of 2 takes the samples with (i // workers) % 2 == r before the worker split, so each rank's
    shard is itself split between its workers."""

    def __iter__(self):
        rank = dist.get_rank() if dist.is_initialized() else 0
        for x, y, i in super().__iter__():
            if (i // 2) % 2 == rank:
                yield x, y, i


class SigtermRank1At(SigtermAt):
    """The real SIGTERM goes to rank 1 only; rank 0 learns of it through PreemptionCheckpoint's vote."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == 1:
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)


class Loader(ResumableStreamLoader):
    def __init__(self) -> None:
        super().__init__(RankStream(), batch_size=4, num_workers=int(os.environ.get("WORKERS", "0")))


def main(out: Path, phase: str, stop_at: int | None) -> None:
    torch.manual_seed(0)
    model = Net()
    # the uninterrupted run keeps its own folder: its final checkpoint would be the newest the resume finds
    folder = out / ("ck-whole" if phase == "whole" else "ck")
    callbacks = [PreemptionCheckpoint(folder), *([SigtermRank1At(stop_at)] if phase == "cut" else [])]
    trainer = Trainer(
        **quiet_trainer_kwargs(
            accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, default_root_dir=str(out), callbacks=callbacks
        )
    )
    ckpt = str(find_resume_checkpoint(folder)) if phase == "resume" else None
    try:
        trainer.fit(model, Loader(), ckpt_path=ckpt)
    except Preempted:
        pass
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    rank = trainer.global_rank
    (out / f"{phase}-rank{rank}.json").write_text(json.dumps({"seen": model.seen, "weights": digest}))


if __name__ == "__main__":
    # PHASES: one phase, or several (whole,cut,resume) run in turn in these two processes, each a fresh fit
    for name in sys.argv[2].split(","):
        main(Path(sys.argv[1]), name, int(sys.argv[3]) if len(sys.argv) > 3 else None)
