"""lightning-accel: make any LightningModule train fast and survive interruptions.

Importing the package registers the strategy presets (``accel_ddp``, ``accel_zero2`` ...) in
Lightning's ``StrategyRegistry``; it does nothing else to the process (docs/architecture.md).
"""

from lightning_accel import tune  # a callable package: lightning_accel.tune(...) runs the search
from lightning_accel.checkpoint import (
    PREEMPTED_EXIT_CODE,
    AtomicCheckpointIO,
    Preempted,
    PreemptionCheckpoint,
    PreemptionNotices,
    find_resume_checkpoint,
)
from lightning_accel.compile import TorchCompile
from lightning_accel.data import (
    ResumableDataLoader,
    ResumableStreamLoader,
    SyntheticClassificationDataModule,
    SyntheticTokenDataModule,
)
from lightning_accel.extras import MissingExtra
from lightning_accel.float8 import Float8Training
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
from lightning_accel.strategies import (
    PRESETS,
    ActivationCheckpointing,
    close_gloo_process_group_at_exit,
    register_presets,
)

register_presets()

__version__ = "0.1.0"
__all__ = [
    "HANG_EXIT_CODE",
    "PREEMPTED_EXIT_CODE",
    "PRESETS",
    "ActivationCheckpointing",
    "AtomicCheckpointIO",
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
    "SyntheticClassificationDataModule",
    "SyntheticTokenDataModule",
    "TorchCompile",
    "TorchProfiler",
    "UtilizationMonitor",
    "auto_precision",
    "choose_precision",
    "close_gloo_process_group_at_exit",
    "diagnose",
    "find_resume_checkpoint",
    "register_presets",
    "tune",
]
