"""Shared fixtures. Everything here runs on the CPU; GPU-only tests skip with a reason."""

from __future__ import annotations

import os

import pytest
import torch

# Two cores: one intra-op thread per test process keeps DDP tests from oversubscribing the machine.
torch.set_num_threads(1)
os.environ.setdefault("PYTHONHASHSEED", "0")

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none")


def tiny_trainer_kwargs(tmp_path, **overrides):
    """Quiet, fast Trainer settings for tests."""
    kwargs = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=str(tmp_path),
    )
    kwargs.update(overrides)
    return kwargs
