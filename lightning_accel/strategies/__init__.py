"""DDP, DeepSpeed ZeRO and FSDP2 presets, registered as Lightning strategy strings."""

from lightning_accel.blocks import find_block_classes
from lightning_accel.strategies.activation_checkpointing import ActivationCheckpointing, checkpoint_blocks
from lightning_accel.strategies.deepspeed import AccelDeepSpeedStrategy, zero3_config
from lightning_accel.strategies.fsdp import AccelFSDPStrategy
from lightning_accel.strategies.presets import PRESETS, Preset, check_strategy_name, register_presets
from lightning_accel.strategies.process_group import (
    AccelDDPStrategy,
    close_gloo_process_group,
    close_gloo_process_group_at_exit,
    init_restart_safe_process_group,
)

__all__ = [
    "PRESETS",
    "AccelDDPStrategy",
    "AccelDeepSpeedStrategy",
    "AccelFSDPStrategy",
    "ActivationCheckpointing",
    "Preset",
    "check_strategy_name",
    "checkpoint_blocks",
    "close_gloo_process_group",
    "close_gloo_process_group_at_exit",
    "find_block_classes",
    "init_restart_safe_process_group",
    "register_presets",
    "zero3_config",
]
