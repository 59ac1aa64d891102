"""``lightning-accel`` command line: LightningCLI with our recipes, ``precision: auto-mixed`` and ``ckpt_path: auto``.

Usage::

    lightning-accel fit --config recipes/tiny_gpt_cpu.yaml
    lightning-accel fit --config recipes/tiny_gpt_cpu.yaml --trainer.max_steps 50 --ckpt_path auto
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Literal

from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import LightningCLI

import lightning_accel  # noqa: F401  (registers the strategy presets)
from lightning_accel._compat import PrecisionInput
from lightning_accel.checkpoint import PreemptionCheckpoint, find_resume_checkpoint
from lightning_accel.precision import auto_precision
from lightning_accel.strategies import check_strategy_name, close_gloo_process_group_at_exit

log = logging.getLogger(__name__)


class AccelTrainer(Trainer):
    """``Trainer`` that also accepts ``precision="auto-mixed"`` (resolved by :func:`auto_precision`).

    Everything else is passed to :class:`lightning.pytorch.Trainer` unchanged.
    """

    def __init__(
        self, *args: Any, precision: PrecisionInput | Literal["auto-mixed"] | None = None, **kwargs: Any
    ) -> None:
        if precision is not None:  # "auto-mixed" is resolved; an explicit choice is checked against the hardware
            precision = auto_precision(precision, accelerator=str(kwargs.get("accelerator", "auto")))
        if isinstance(kwargs.get("strategy"), str):
            check_strategy_name(kwargs["strategy"])
        super().__init__(*args, precision=precision, **kwargs)


class AccelCLI(LightningCLI):
    """LightningCLI whose ``fit --ckpt_path auto`` resumes from the newest valid checkpoint."""

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        try:
            return super().instantiate_trainer(**kwargs)
        except ValueError as err:  # a bad precision/strategy value: report it like any other config error
            self.parser.error(f"invalid trainer configuration: {err}")

    def before_fit(self) -> None:
        cfg = self.config[self.subcommand]
        if cfg.get("ckpt_path") != "auto":
            return
        cb = next((c for c in self.trainer.callbacks if isinstance(c, PreemptionCheckpoint)), None)
        if cb is None:
            self.parser.error("--ckpt_path auto needs a PreemptionCheckpoint callback (it names the folder to search)")
        found = find_resume_checkpoint(cb.dirpath)
        log.info("ckpt_path=auto: %s", f"resuming from {found}" if found else "no valid checkpoint, starting fresh")
        cfg["ckpt_path"] = found
        self.config_init[self.subcommand]["ckpt_path"] = found


def build_cli(args: list[str] | None = None) -> AccelCLI:
    """Parse ``args`` (default: ``sys.argv``), build the objects and run the subcommand."""
    return AccelCLI(
        LightningModule,
        LightningDataModule,
        trainer_class=AccelTrainer,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
        auto_configure_optimizers=False,
    )


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``lightning-accel`` console script."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    close_gloo_process_group_at_exit()  # our program: safe for stock strategies on gloo too
    build_cli(args)


if __name__ == "__main__":
    main(sys.argv[1:])
