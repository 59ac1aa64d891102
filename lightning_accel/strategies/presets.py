"""Strategy presets registered in Lightning's ``StrategyRegistry`` under ``accel_*`` names.

Stock names (``"ddp"``, ``"deepspeed_stage_2"``, ``"fsdp"``) are untouched; ours sit beside them.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

from lightning.pytorch.strategies import Strategy, StrategyRegistry

from lightning_accel.strategies.deepspeed import AccelDeepSpeedStrategy, zero3_config
from lightning_accel.strategies.fsdp import AccelFSDPStrategy
from lightning_accel.strategies.process_group import AccelDDPStrategy

__all__ = ["PRESETS", "Preset", "check_strategy_name", "register_presets"]


@dataclass(frozen=True)
class Preset:
    strategy: type[Strategy]
    description: str
    kwargs: dict[str, Any] = field(default_factory=dict)


_DDP = {
    # Larger buckets than torch's 25 MB: fewer all-reduce launches, still overlapped with backward.
    "bucket_cap_mb": 100,
    # Gradients are views into the all-reduce buckets: saves one gradient-sized copy and its memory.
    "gradient_as_bucket_view": True,
    "find_unused_parameters": False,
}

PRESETS: dict[str, Preset] = {
    "accel_ddp": Preset(AccelDDPStrategy, "DDP with 100 MB buckets and gradients as bucket views", dict(_DDP)),
    "accel_ddp_static": Preset(
        AccelDDPStrategy,
        "accel_ddp plus static_graph=True (same parameters used every step: enables more overlap)",
        {**_DDP, "static_graph": True},
    ),
    "accel_zero2": Preset(
        AccelDeepSpeedStrategy, "DeepSpeed ZeRO-2: shard optimizer state and gradients", {"stage": 2}
    ),
    "accel_zero2_offload": Preset(
        AccelDeepSpeedStrategy,
        "ZeRO-2 with optimizer state offloaded to CPU",
        {"stage": 2, "offload_optimizer": True, "pin_memory": True},
    ),
    "accel_zero3": Preset(
        AccelDeepSpeedStrategy, "DeepSpeed ZeRO-3: also shard parameters", {"config": zero3_config()}
    ),
    "accel_zero3_offload": Preset(
        AccelDeepSpeedStrategy,
        "ZeRO-3 with optimizer state and parameters offloaded to CPU (largest models, slowest)",
        {"config": zero3_config(offload=True)},
    ),
    "accel_fsdp": Preset(
        AccelFSDPStrategy,
        "FSDP2 auto-sharding each repeated block, bf16 compute, fp32 reduce",
        {"mixed_precision": "bf16"},
    ),
    "accel_fsdp_fp32": Preset(AccelFSDPStrategy, "FSDP2 auto-sharding in fp32 (runs on CPU/gloo too)", {}),
    "accel_fsdp_ac": Preset(
        AccelFSDPStrategy,
        "accel_fsdp plus activation checkpointing of each block (less memory, ~30% more compute)",
        {"mixed_precision": "bf16", "activation_checkpointing": True},
    ),
}


def register_presets() -> None:
    """Register every preset in ``StrategyRegistry`` (idempotent; called on ``import lightning_accel``)."""
    for name, preset in PRESETS.items():
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, preset.strategy, description=preset.description, **preset.kwargs)


def check_strategy_name(name: str) -> str:
    """Return ``name`` if Lightning knows it; else raise a ValueError listing our presets and a close match."""
    if name in StrategyRegistry or name == "auto":
        return name
    known = sorted(StrategyRegistry.available_strategies())
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(
        f"Unknown strategy {name!r}.{hint} lightning-accel presets: {', '.join(PRESETS)}. "
        f"All registered strategies: {', '.join(known)}"
    )
