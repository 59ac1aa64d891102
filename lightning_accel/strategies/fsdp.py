"""FSDP2 (``torch.distributed.fsdp.fully_shard``) applied automatically, with no change to the module.

Lightning's ``ModelParallelStrategy`` expects the user to shard inside ``configure_model``; this
subclass does it for any LightningModule: each repeated block (the children of ``nn.ModuleList``s, or
the classes you name) becomes one FSDP unit, optionally activation-checkpointed, then each direct child
holding other parameters (so ``training_step`` may call ``self.net(x)`` rather than ``self(x)``), then the root.
It runs wherever FSDP2 does, the CPU on gloo included.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.constants import default_pg_timeout
from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecisionPolicy, fully_shard
from typing_extensions import override

from lightning_accel._compat import materialize_distributed_module, optimizers_to_device, set_data_parallel_size
from lightning_accel.blocks import children_beside_blocks, find_block_classes
from lightning_accel.storage.shards import verify_shards
from lightning_accel.strategies.activation_checkpointing import checkpoint_blocks
from lightning_accel.strategies.process_group import close_gloo_process_group_at_exit, init_restart_safe_process_group

__all__ = ["AccelFSDPStrategy"]

log = logging.getLogger(__name__)


class AccelFSDPStrategy(ModelParallelStrategy):
    """Fully sharded data parallel (FSDP2) over all devices, sharding the module automatically.

    Args:
        block_classes: Class names of the blocks to shard individually; ``None`` detects them.
        activation_checkpointing: Recompute each block's activations in the backward pass.
        mixed_precision: ``"bf16"`` computes in bf16 with fp32 master weights and fp32 gradient reduction;
            ``None`` keeps fp32. (This replaces ``Trainer(precision="bf16-mixed")`` autocast for FSDP.)
        reshard_after_forward: Free gathered parameters after forward (ZeRO-3 memory); ``False`` keeps
            them until backward (ZeRO-2-like, faster, more memory).
        save_distributed_checkpoint: Save a sharded folder (``True``) or one full file on rank 0.
        process_group_backend: ``"nccl"``/``"gloo"``; ``None`` picks by device.
        timeout: Collective timeout.
        shard_children: Make each direct child holding parameters outside the blocks a unit too, so a
            ``training_step`` that calls ``self.net(x)`` rather than ``self(x)`` works. ``False`` leaves them to the
            root unit: needed when ``forward`` reads a child's parameters without calling that child
            (``x @ self.embed.weight.T``), since a child unit's parameters are gathered only while it runs.
    """

    def __init__(
        self,
        block_classes: Sequence[str] | None = None,
        activation_checkpointing: bool = False,
        mixed_precision: str | None = None,
        reshard_after_forward: bool = True,
        save_distributed_checkpoint: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        shard_children: bool = True,
    ) -> None:
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        if mixed_precision not in (None, "bf16"):
            raise ValueError(f"mixed_precision must be None or 'bf16', got {mixed_precision!r}")
        self.block_classes = list(block_classes) if block_classes else None
        self.activation_checkpointing = activation_checkpointing
        self.mixed_precision = mixed_precision
        self.reshard_after_forward = reshard_after_forward
        self.shard_children = shard_children

    def shard(self, module: nn.Module) -> set[type[nn.Module]]:
        """Apply activation checkpointing and ``fully_shard`` to ``module`` in place; returns the block classes."""
        blocks = find_block_classes(module, self.block_classes)
        children = children_beside_blocks(module, blocks) if self.shard_children else []
        if not blocks:
            log.warning(
                "no repeated blocks found in %s: sharding %s",
                type(module).__name__,
                f"its {len(children)} child module(s) each as a unit, then the rest" if children else "it as one unit",
            )
        if self.activation_checkpointing and blocks:
            checkpoint_blocks(module, set(blocks), "full")
        mp = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if self.mixed_precision
            else MixedPrecisionPolicy()
        )
        kwargs: dict[str, Any] = {"mesh": self.device_mesh["data_parallel"], "mp_policy": mp}
        for m in list(module.modules()):
            if isinstance(m, tuple(blocks)):
                fully_shard(m, reshard_after_forward=self.reshard_after_forward, **kwargs)
        for child in children:  # gathered when called, whether or not training_step goes through forward
            fully_shard(child, reshard_after_forward=self.reshard_after_forward, **kwargs)
        fully_shard(module, **kwargs)
        rank_zero_info(
            f"accel_fsdp: sharded {sorted(c.__name__ for c in blocks)} over {self.world_size} ranks "
            f"(activation checkpointing: {self.activation_checkpointing}, mixed precision: {self.mixed_precision})"
        )
        return blocks

    @override
    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's load; a sealed folder's shards are first checked, each rank its share (storage.shards)."""
        path = Path(self.broadcast(checkpoint_path))  # rank 0's path, as Lightning's load takes it
        if path.is_dir():
            verify_shards(path, self.global_rank, self.world_size)
        return super().load_checkpoint(path, weights_only)

    @override
    def setup_environment(self) -> None:
        # Pure data parallelism: every process is one shard ("auto" would give one shard per node).
        set_data_parallel_size(self, self.num_nodes * self.num_processes)
        init_restart_safe_process_group(self)  # under torchrun: a group that survives its restarts
        super().setup_environment()

    def setup_distributed(self) -> None:
        super().setup_distributed()
        close_gloo_process_group_at_exit()  # closes the group at exit only if it is gloo

    @override
    def setup(self, trainer: Trainer) -> None:
        # ModelParallelStrategy.setup (its digest is pinned in _compat.py), with our automatic sharding
        # in place of the configure_model() it requires.
        assert self.model is not None and self.accelerator is not None  # set by the Trainer before setup()
        self.accelerator.setup(trainer)
        if any(isinstance(m, FullyShardedDataParallel) for m in self.model.modules()):
            raise TypeError(
                f"{type(self).__name__} shards with FSDP2 itself, but the model already holds FSDP1 "
                "FullyShardedDataParallel modules: remove that wrapping, or use strategy='fsdp'"
            )
        materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.shard(self.model)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)
