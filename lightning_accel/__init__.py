"""lightning-accel: make any LightningModule train fast and survive interruptions.

Importing the package registers the strategy presets (``accel_ddp``, ``accel_zero2`` ...) in
Lightning's ``StrategyRegistry`` and, as Lightning does, lets its INFO lines reach a program that configured no
logging (``logs.py``); it does nothing else to the process (docs/architecture.md).
"""

from typing import TYPE_CHECKING, Any

from lightning_accel import data as _data
from lightning_accel.checkpoint import (
    PREEMPTED_EXIT_CODE,
    AtomicCheckpointIO,
    Preempted,
    PreemptionCheckpoint,
    PreemptionNotices,
    find_resume_checkpoint,
)
from lightning_accel.compile import TorchCompile
from lightning_accel.data import ResumableDataLoader, ResumableStreamLoader
from lightning_accel.extras import MissingExtra
from lightning_accel.float8 import Float8Training
from lightning_accel.logs import show_without_setup
from lightning_accel.monitor import (
    HANG_EXIT_CODE,
    GoodputMonitor,
    HangSentinel,
    IdleMonitor,
    Pricing,
    PrometheusExporter,
    UtilizationMonitor,
)
from lightning_accel.precision import auto_precision, choose_precision
from lightning_accel.profile import Finding, TorchProfiler, diagnose
from lightning_accel.strategies import PRESETS, ActivationCheckpointing, register_presets

if TYPE_CHECKING:
    from lightning_accel.data import DALIImageDataModule
    from lightning_accel.tuning import tune

register_presets()
show_without_setup()  # our key lines reach a plain script, as Lightning's do (lightning_accel/logs.py)


def __getattr__(name: str) -> Any:
    # tune() on first use: the search imports LightningCLI and its trial server, which training never needs
    if name == "tune":
        from lightning_accel.tuning import tune

        return tune
    if name == "DALIImageDataModule":  # DALI (the [dali] extra) on first use: a large, slow import
        return _data.DALIImageDataModule
    raise AttributeError(f"module 'lightning_accel' has no attribute {name!r}")


__version__ = "0.1.0"
__all__ = [
    "HANG_EXIT_CODE",
    "PREEMPTED_EXIT_CODE",
    "PRESETS",
    "ActivationCheckpointing",
    "AtomicCheckpointIO",
    "DALIImageDataModule",
    "Finding",
    "Float8Training",
    "GoodputMonitor",
    "HangSentinel",
    "IdleMonitor",
    "MissingExtra",
    "Preempted",
    "PreemptionCheckpoint",
    "PreemptionNotices",
    "Pricing",
    "PrometheusExporter",
    "ResumableDataLoader",
    "ResumableStreamLoader",
    "TorchCompile",
    "TorchProfiler",
    "UtilizationMonitor",
    "auto_precision",
    "choose_precision",
    "diagnose",
    "find_resume_checkpoint",
    "tune",
]
