"""A process where the optional extras are not installed: every import of DALI, DeepSpeed, torchao, Ray,
HolisticTraceAnalysis and the object-store backends fails as it does where pip never installed them.

python tests/helpers/core_install.py OUT_JSON

Then it does what a user of the core install does: a fit of a model defined here with the callbacks that need no
extra, and each feature that needs one, whose error (type, extra named) it records. OUT_JSON gets the results.
"""

from __future__ import annotations

import importlib.abc
import json
import sys
from pathlib import Path

ABSENT = ("deepspeed", "nvidia.dali", "torchao", "ray", "hta", "s3fs", "gcsfs", "adlfs")


class NotInstalled(importlib.abc.MetaPathFinder):
    """Finds the extras' modules the way Python finds a package that is not installed: not at all."""

    def find_spec(self, name, path=None, target=None):
        if any(name == top or name.startswith(top + ".") for top in ABSENT):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NotInstalled())


def fit_with_the_core_callbacks(root: Path) -> dict:
    import torch
    from lightning.pytorch import LightningModule, Trainer
    from torch import nn
    from torch.utils.data import TensorDataset

    import lightning_accel as la

    class Net(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.1), nn.Linear(8, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
            return la.ResumableDataLoader(data, batch_size=8, shuffle=True, seed=0)

    callbacks = [
        la.PreemptionCheckpoint(root / "ckpt", every_n_steps=4),
        la.GoodputMonitor(run_dir=root / "run", summary=False, prometheus=la.PrometheusExporter(port=0)),
        la.HangSentinel(),
    ]
    trainer = Trainer(
        accelerator="cpu",
        max_steps=8,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        default_root_dir=root,
        callbacks=callbacks,
    )
    trainer.fit(Net())
    return {
        "global_step": trainer.global_step,
        "checkpoint": la.find_resume_checkpoint(root / "ckpt"),
        "goodput_json": (root / "run" / "goodput.json").is_file(),
    }


def missing_extras(root: Path) -> dict:
    """Each feature that needs an extra, made as a user makes it: the error's type and message."""
    from lightning.pytorch import Trainer

    import lightning_accel as la
    from lightning_accel.cli import main

    attempts = {
        "dali": lambda: la.data.DALIImageDataModule,
        "deepspeed": lambda: Trainer(accelerator="cpu", strategy="accel_zero2"),
        "fp8": lambda: la.Float8Training(emulate=True),
        "cloud": lambda: la.PreemptionCheckpoint("s3://bucket/run1"),
        "ray": lambda: main(["fit", "--config", "recipes/mlp_cpu.yaml", "--ray.num_workers", "2"]),
    }
    errors = {}
    for extra, attempt in attempts.items():
        try:
            attempt()
            errors[extra] = None
        except la.MissingExtra as err:
            errors[extra] = {"type": type(err).__name__, "extra": err.extra, "message": str(err)}
        except SystemExit as err:  # the CLI: one logged line, then its usage-error status
            errors[extra] = {"type": "SystemExit", "extra": None, "message": str(err.code)}
        except Exception as err:  # recorded, for the test to show
            errors[extra] = {"type": type(err).__name__, "extra": None, "message": str(err)}
    return errors


def main() -> None:
    out = Path(sys.argv[1])
    import lightning_accel  # noqa: F401  (the import itself must not need an extra)

    loaded = sorted(top for top in ABSENT if any(m == top or m.startswith(top + ".") for m in sys.modules))
    results = {
        "loaded_at_import": loaded,
        "fit": fit_with_the_core_callbacks(out.parent),
        "errors": missing_extras(out),
    }
    out.write_text(json.dumps(results, default=str))


if __name__ == "__main__":
    main()
