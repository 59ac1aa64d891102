"""DDP, DeepSpeed ZeRO and FSDP2 presets, registered as Lightning strategy strings."""

from lightning_accel.strategies.deepspeed import AccelDeepSpeedStrategy, zero_config
from lightning_accel.strategies.fsdp import AccelFSDPStrategy, find_block_classes
from lightning_accel.strategies.presets import PRESETS, Preset, check_strategy_name, register_presets

__all__ = ["PRESETS", "AccelDeepSpeedStrategy", "AccelFSDPStrategy", "Preset", "check_strategy_name", "find_block_classes", "register_presets", "zero_config"]
