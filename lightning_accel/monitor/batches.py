"""What a batch holds: samples and tokens, for throughput."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["default_batch_size", "default_tokens"]


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for item in values:
        found = _first_tensor(item)
        if found is not None:
            return found
    return None


def default_batch_size(batch: Any) -> int:
    """Leading dimension of the first tensor in the batch."""
    tensor = _first_tensor(batch)
    if tensor is None or tensor.ndim == 0:
        raise ValueError(
            "Cannot infer the batch size (the batch holds no tensor with a batch dimension); pass batch_size_fn="
        )
    return int(tensor.shape[0])


def default_tokens(batch: Any) -> int | None:
    """Token count when the first tensor looks like token ids: an integer tensor of shape (batch, seq)."""
    tensor = _first_tensor(batch)
    if tensor is not None and tensor.ndim == 2 and not tensor.is_floating_point() and tensor.dtype != torch.bool:
        return int(tensor.numel())
    return None
