"""Lightning's DeepSpeed path on DeepSpeed's CPU accelerator, for tests: the same strategy, Trainer loop, checkpoint
writer and loader a GPU run takes, on gloo.

Lightning refuses DeepSpeed without CUDA (``setup_environment``) and so does ``AccelDeepSpeedStrategy`` (at
``Trainer(...)``); DeepSpeed's own engine runs on its CPU accelerator. This subclass lifts only those two checks
and names each rank's CPU device by its index (``cpu:N``), which both read.
"""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported (Lightning imports it lazily)

import deepspeed.ops
import torch
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

from lightning_accel.strategies.deepspeed import AccelDeepSpeedStrategy, zero3_config

# DeepSpeed's CPU collectives would JIT-compile a shared-memory all-reduce first (30-40 s on a fresh machine, and a
# C++ compiler); gloo's serve a test. DeepSpeed keeps this table in its module for edits like this one.
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


class CPUDeepSpeedStrategy(AccelDeepSpeedStrategy):
    @property
    def accelerator(self) -> Accelerator | None:
        return DeepSpeedStrategy.accelerator.fget(self)

    @accelerator.setter
    def accelerator(self, accelerator: Accelerator | None) -> None:
        DeepSpeedStrategy.accelerator.fset(self, accelerator)

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)  # Lightning's DeepSpeedStrategy adds only the CUDA check


def cpu_deepspeed(stage: int, world_size: int) -> CPUDeepSpeedStrategy:
    """ZeRO ``stage`` on ``world_size`` CPU ranks, each device named by its index (DeepSpeed and Lightning check it).
    The presets' settings (``accel_zero2``, ``accel_zero3``), except that under ZeRO-3 every parameter is sliced
    across the ranks, however small (a test's model is)."""
    devices = [torch.device("cpu", i) for i in range(world_size)]
    if stage != 3:
        return CPUDeepSpeedStrategy(stage=stage, parallel_devices=devices)
    config = zero3_config()
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    return CPUDeepSpeedStrategy(config=config, parallel_devices=devices)
