"""DeepSpeed ZeRO configs for the ``accel_zero*`` presets.

Lightning fills in what depends on the run (micro-batch size, gradient accumulation, clipping,
fp16/bf16 sections from ``Trainer(precision=...)``); these configs set only the sharding choices.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.accelerators import Accelerator, CUDAAccelerator
from lightning.pytorch.strategies import DeepSpeedStrategy


def zero_config(stage: int, offload_optimizer: bool = False, offload_params: bool = False, bucket_mb: int = 200) -> dict[str, Any]:
    """ZeRO config for ``stage`` 1, 2 or 3, optionally offloading optimizer state / parameters to CPU.

    Args:
        stage: ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters.
        offload_optimizer: Keep optimizer state (and its step) in pinned CPU memory.
        offload_params: Keep parameters in pinned CPU memory (stage 3 only).
        bucket_mb: Size of the reduce/all-gather buckets, in MB (larger overlaps better on fast links).
    """
    if stage not in (1, 2, 3):
        raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage}")
    if offload_params and stage != 3:
        raise ValueError("offload_params needs ZeRO stage 3 (only stage 3 shards parameters)")
    bucket = bucket_mb * 1_000_000
    zero: dict[str, Any] = {
        "stage": stage,
        "overlap_comm": True,  # overlap gradient reduction with the backward pass
        "contiguous_gradients": True,  # avoid fragmentation when gradients are copied into buckets
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
    }
    if stage == 3:
        zero.update(
            stage3_prefetch_bucket_size=bucket,
            stage3_param_persistence_threshold=100_000,  # small params stay whole: fewer tiny all-gathers
            stage3_max_live_parameters=1_000_000_000,
            stage3_gather_16bit_weights_on_model_save=True,  # checkpoints hold full weights
        )
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "zero_optimization": zero,
        # Any torch optimizer works: DeepSpeed only checks that its own CPU Adam is used with offload.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
    }


class AccelDeepSpeedStrategy(DeepSpeedStrategy):
    """``DeepSpeedStrategy`` that refuses a non-CUDA accelerator at ``Trainer(...)`` time.

    Lightning checks this for its own ``deepspeed_*`` names only; without the check a preset string on
    a CPU machine would fail later, deep inside DeepSpeed.
    """

    @property
    def accelerator(self) -> Accelerator | None:
        return self._accelerator

    @accelerator.setter
    def accelerator(self, accelerator: Accelerator | None) -> None:
        if accelerator is not None and not isinstance(accelerator, CUDAAccelerator):
            raise ValueError(
                f"DeepSpeed ZeRO presets need CUDA GPUs, but the accelerator is {type(accelerator).__name__}. "
                "On CPU use strategy='accel_ddp' or 'accel_fsdp_fp32' (FSDP2, runs on gloo)."
            )
        self._accelerator = accelerator
