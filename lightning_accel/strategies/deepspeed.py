"""DeepSpeed ZeRO for the ``accel_zero*`` presets.

Stages 1-2 are Lightning's own ``DeepSpeedStrategy(stage=..., offload_optimizer=...)``; only ZeRO-3
gets a config of ours (:func:`zero3_config`), for the knobs Lightning has no arguments for. Lightning
fills in what depends on the run (micro-batch size, gradient accumulation, clipping, fp16/bf16
sections from ``Trainer(precision=...)``).
"""

from __future__ import annotations

import copy
from typing import Any

from lightning.pytorch.accelerators import Accelerator, CUDAAccelerator
from lightning.pytorch.strategies import DeepSpeedStrategy


def zero3_config(offload: bool = False, bucket_mb: int = 200) -> dict[str, Any]:
    """ZeRO-3 config (parameters, gradients and optimizer state sharded), optionally offloaded to CPU.

    Args:
        offload: Keep optimizer state and parameters in pinned CPU memory (largest models, slowest).
        bucket_mb: Size of the reduce/all-gather/prefetch buckets, in MB (larger overlaps better on fast links).
    """
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
    bucket = bucket_mb * 1_000_000
    zero: dict[str, Any] = {
        "stage": 3,
        "overlap_comm": True,  # overlap gradient reduction with the backward pass
        "contiguous_gradients": True,  # avoid fragmentation when gradients are copied into buckets
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
        "stage3_prefetch_bucket_size": bucket,
        "stage3_param_persistence_threshold": 100_000,  # small params stay whole: fewer tiny all-gathers
        "stage3_max_live_parameters": 1_000_000_000,
        "stage3_gather_16bit_weights_on_model_save": True,  # checkpoints hold full weights
    }
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {"zero_optimization": zero, "zero_allow_untested_optimizer": True}


class AccelDeepSpeedStrategy(DeepSpeedStrategy):
    """``DeepSpeedStrategy`` that offloads with any torch optimizer and refuses a CPU machine at ``Trainer(...)``.

    Takes ``DeepSpeedStrategy``'s arguments unchanged.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if isinstance(kwargs.get("config"), dict):
            # Lightning writes run settings (batch size, precision) into the dict: never into a preset's.
            kwargs["config"] = copy.deepcopy(kwargs["config"])
        super().__init__(*args, **kwargs)
        # DeepSpeed insists on its own CPU Adam when offloading; any torch optimizer works.
        self.config.setdefault("zero_force_ds_cpu_optimizer", False)

    # Checked when the Trainer connects the accelerator, i.e. at ``Trainer(...)``. Lightning's own check
    # (in setup_environment, at fit) comes after its launcher has written MASTER_ADDR, MASTER_PORT and
    # LOCAL_RANK into os.environ: a later DDP run in the same process (a notebook, a test session) then
    # takes itself for an already-launched rank and waits for peers forever. Seen in our test suite.
    # Only the public ``accelerator`` property is overridden, delegating storage to Lightning's.
    @property
    def accelerator(self) -> Accelerator | None:
        return DeepSpeedStrategy.accelerator.fget(self)

    @accelerator.setter
    def accelerator(self, accelerator: Accelerator | None) -> None:
        if accelerator is not None and not isinstance(accelerator, CUDAAccelerator):
            raise ValueError(
                f"DeepSpeed ZeRO presets need CUDA GPUs, but the accelerator is {type(accelerator).__name__}. "
                "On CPU use strategy='accel_ddp' or 'accel_fsdp_fp32' (FSDP2, runs on gloo)."
            )
        DeepSpeedStrategy.accelerator.fset(self, accelerator)
