"""DDP, DeepSpeed ZeRO and FSDP2 presets, registered as Lightning strategy strings."""

from lightning_accel.strategies.deepspeed import AccelDeepSpeedStrategy, zero3_config
from lightning_accel.strategies.fsdp import AccelFSDPStrategy, find_block_classes
from lightning_accel.strategies.presets import PRESETS, Preset, check_strategy_name, register_presets
from lightning_accel.strategies.process_group import (
    AccelDDPStrategy,
    close_gloo_process_group,
    close_gloo_process_group_at_exit,
    init_for_strategy,
)
from lightning_accel.strategies.ray_train import RayReport, fit_on_ray

__all__ = [
    "PRESETS",
    "AccelDDPStrategy",
    "AccelDeepSpeedStrategy",
    "AccelFSDPStrategy",
    "Preset",
    "RayReport",
    "check_strategy_name",
    "close_gloo_process_group",
    "close_gloo_process_group_at_exit",
    "find_block_classes",
    "fit_on_ray",
    "init_for_strategy",
    "register_presets",
    "zero3_config",
]
