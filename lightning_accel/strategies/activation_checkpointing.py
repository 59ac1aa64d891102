"""Activation checkpointing of a model's repeated blocks: memory for recompute, on any strategy.

Torch's own checkpoint wrappers (``apply_activation_checkpointing``, non-reentrant) around the blocks that
``find_block_classes`` finds (the classes held in ``nn.ModuleList``s), or the classes named. ``"full"`` keeps only
each block's input and recomputes all of it in backward; ``"selective"`` also keeps the outputs of the matrix
multiplications (the expensive ops) and recomputes the cheap ones (norms, activations, dropout masks' use), through
torch's selective checkpoint contexts. State-dict keys are unchanged (the wrappers strip their prefix), Dropout
draws the same masks in the recompute (the RNG state is saved), so losses and gradients equal those without it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial
from typing import Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from typing_extensions import override

from lightning_accel._compat import (
    CheckpointImpl,
    CheckpointWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from lightning_accel.blocks import find_block_classes, find_blocks

__all__ = ["POLICIES", "ActivationCheckpointing", "Policy", "checkpoint_blocks"]

log = logging.getLogger(__name__)

Policy = Literal["full", "selective"]
POLICIES = ("full", "selective")

# Kept by "selective": the matrix multiplications, which cost far more to recompute than to keep.
_KEEP = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _keep_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _KEEP else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_blocks(
    module: nn.Module,
    block_classes: set[type[nn.Module]],
    policy: Policy = "full",
    instances: Sequence[nn.Module] | None = None,
) -> int:
    """Wrap every instance of ``block_classes`` in ``module`` (or only ``instances``, when given) with a checkpoint
    wrapper, in place; returns how many."""
    if policy not in POLICIES:
        raise ValueError(f"activation checkpointing policy must be one of {POLICIES}, got {policy!r}")
    blocks = tuple(block_classes)
    if not blocks:
        return 0
    ids = {id(m) for m in instances} if instances is not None else None
    kwargs: dict[str, Any] = {"checkpoint_impl": CheckpointImpl.NO_REENTRANT}
    if policy == "selective":
        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, _keep_matmuls)
    apply_activation_checkpointing(
        module,
        checkpoint_wrapper_fn=partial(checkpoint_wrapper, **kwargs),
        check_fn=lambda m: isinstance(m, blocks) and (ids is None or id(m) in ids),
    )
    return sum(isinstance(m, CheckpointWrapper) for m in module.modules())


class ActivationCheckpointing(Callback):
    """Recompute the repeated blocks' activations in backward instead of keeping them: less memory, more compute.

    Args:
        policy: ``"full"`` (keep each block's input only) or ``"selective"`` (also keep matmul outputs).
        blocks: Class names of the blocks; ``None`` finds the classes held in ``nn.ModuleList``s.
    """

    def __init__(self, policy: Policy = "full", blocks: Sequence[str] | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"ActivationCheckpointing(policy=...) must be one of {POLICIES}, got {policy!r}")
        self.policy, self.blocks = policy, list(blocks) if blocks is not None else None
        self.wrapped = 0

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit" or any(isinstance(m, CheckpointWrapper) for m in pl_module.modules()):
            return  # wrapped already (a second fit of the same module, or a strategy that did it)
        classes = find_block_classes(pl_module, self.blocks)
        if not classes:
            rank_zero_warn(
                f"ActivationCheckpointing: {type(pl_module).__name__} holds no repeated blocks (nn.ModuleList) to "
                "checkpoint; name them with ActivationCheckpointing(blocks=[...]). Nothing is checkpointed."
            )
            return
        batch_norms = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
        in_blocks = find_blocks(pl_module, self.blocks)  # the blocks only: not a head of the same class beside them
        norms = {type(n).__name__ for b in in_blocks for n in b.modules() if isinstance(n, batch_norms)}
        if norms:
            rank_zero_warn(
                f"ActivationCheckpointing: the checkpointed blocks hold {sorted(norms)}, whose running statistics "
                "are updated again when the block is recomputed in backward (twice per step): losses and gradients "
                "are unchanged, the running statistics are not. Checkpoint blocks without batch norm, or exclude "
                "them with blocks=[...]."
            )
        self.wrapped = checkpoint_blocks(pl_module, classes, self.policy, instances=in_blocks)
        names = sorted(c.__name__ for c in classes)
        log.info("activation checkpointing (%s): %d blocks of %s", self.policy, self.wrapped, names)
