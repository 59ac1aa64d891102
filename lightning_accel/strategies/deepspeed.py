"""DeepSpeed ZeRO for the ``accel_zero*`` presets.

Stages 1-2 are Lightning's own ``DeepSpeedStrategy(stage=..., offload_optimizer=...)``; only ZeRO-3
gets a config of ours (:func:`zero3_config`), for the knobs Lightning has no arguments for. Lightning
fills in what depends on the run (micro-batch size, gradient accumulation, clipping, fp16/bf16
sections from ``Trainer(precision=...)``). A checkpoint saved on another number of ranks loads through
DeepSpeed's universal checkpoint (``deepspeed_universal.py``).
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

from lightning.pytorch.accelerators import Accelerator, CUDAAccelerator
from lightning.pytorch.strategies import DeepSpeedStrategy
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_accel._compat import deepspeed_loads_universal
from lightning_accel.extras import require
from lightning_accel.storage.shards import verify_shards
from lightning_accel.strategies.deepspeed_universal import saved_data_parallel_size, universal_checkpoint_for
from lightning_accel.strategies.process_group import close_gloo_process_group_at_exit

__all__ = ["AccelDeepSpeedStrategy", "zero3_config"]

log = logging.getLogger(__name__)


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
    """``DeepSpeedStrategy`` that offloads with any torch optimizer, refuses a CPU machine at ``Trainer(...)``, and
    resumes a ZeRO checkpoint on another number of ranks (nodes left or joined).

    Takes ``DeepSpeedStrategy``'s arguments unchanged.
    """

    # Read by PreemptionCheckpoint: a checkpoint from another world size loads here (Lightning's own strategy refuses).
    follows_world_size = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        require("deepspeed", "AccelDeepSpeedStrategy (the accel_zero presets)")
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
    @override
    def accelerator(self) -> Accelerator | None:
        return DeepSpeedStrategy.accelerator.fget(self)

    @accelerator.setter
    @override
    def accelerator(self, accelerator: Accelerator | None) -> None:
        if accelerator is not None and not isinstance(accelerator, CUDAAccelerator):
            raise ValueError(
                f"DeepSpeed ZeRO presets need CUDA GPUs, but the accelerator is {type(accelerator).__name__}. "
                "On CPU use strategy='accel_ddp' or 'accel_fsdp_fp32' (FSDP2, runs on gloo)."
            )
        DeepSpeedStrategy.accelerator.fset(self, accelerator)

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        close_gloo_process_group_at_exit()  # acts at exit only on gloo (DeepSpeed's CPU engine); see process_group.py

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's backward, with the loss divided by the accumulation once, not twice.

        In automatic optimization Lightning divides each micro-batch's loss by ``accumulate_grad_batches`` and
        DeepSpeed's ``engine.backward`` divides it again by its own accumulation (discussed in Lightning #6170): a step
        then averages gradients over ``accumulation**2`` batches, and the learning rate in effect shrinks with the
        accumulation. Here DeepSpeed is told not to divide, so a ZeRO step equals a DDP step, whatever the
        accumulation, and a resume that changes the accumulation (another world size) keeps the gradient's scale.
        """
        if self.lightning_module.automatic_optimization:
            kwargs.setdefault("scale_wrt_gas", False)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's load; a ZeRO checkpoint written by another number of ranks is first converted to DeepSpeed's
        universal checkpoint (by rank 0, once, inside the checkpoint folder) and loaded from it."""
        folder = Path(checkpoint_path)
        if folder.is_dir():  # a sealed folder's shards are first checked, each rank its share (storage.shards)
            verify_shards(folder, self.global_rank, self.world_size)
        saved = saved_data_parallel_size(folder) if folder.is_dir() else None
        if saved is None or saved == self.world_size or (self.load_full_weights and self.zero_stage_3):
            return super().load_checkpoint(checkpoint_path, weights_only)
        error = None
        if self.is_global_zero:
            log.warning(
                "%s was saved by %d data-parallel rank(s), this run has %d: loading it through DeepSpeed's universal "
                "checkpoint",
                folder,
                saved,
                self.world_size,
            )
            try:
                universal_checkpoint_for(folder, self.deepspeed_engine.basic_optimizer)
            except RuntimeError as err:
                error = str(err)
        error = self.broadcast(error)  # every rank fails alike, none waits for a conversion that will not come
        if error:
            raise RuntimeError(error)
        with deepspeed_loads_universal(self.deepspeed_engine):
            return super().load_checkpoint(checkpoint_path, weights_only)

    @override
    def on_train_start(self) -> None:
        """DeepSpeed counts gradient accumulation itself, from the Trainer's at setup; a resume on another number of
        ranks (PreemptionCheckpoint) changes the Trainer's after that, so the engine follows here."""
        super().on_train_start()
        engine = self.deepspeed_engine
        accumulation = int(self.lightning_module.trainer.accumulate_grad_batches)
        if engine.gradient_accumulation_steps() == accumulation:
            return
        log.info("DeepSpeed gradient accumulation %d -> %d", engine.gradient_accumulation_steps(), accumulation)
        engine.set_train_batch_size(engine.train_micro_batch_size_per_gpu() * accumulation * engine.dp_world_size)
        # The ZeRO-1/2 optimizer keeps its own copy from construction: it picks how offloaded gradients accumulate.
        if hasattr(engine.optimizer, "gradient_accumulation_steps"):
            engine.optimizer.gradient_accumulation_steps = accumulation
        self.config["gradient_accumulation_steps"] = accumulation
