"""Activation checkpointing on a model the test defines: same losses and gradients, less kept for backward, exact
resume; batch norm inside a checkpointed block is warned about."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy
from torch.utils.data import TensorDataset

from lightning_accel import ActivationCheckpointing, PreemptionCheckpoint, ResumableDataLoader, find_resume_checkpoint
from lightning_accel.checkpoint import Preempted
from lightning_accel.strategies import activation_checkpointing, checkpoint_blocks, find_block_classes
from tests.conftest import SigtermAt, tiny_trainer_kwargs


class Block(nn.Module):
    """A transformer-style MLP block: LayerNorm, two matmuls, GELU, Dropout, a residual."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.down(nn.functional.gelu(self.up(self.norm(x)))))


class Stack(LightningModule):
    def __init__(self, depth: int = 4, width: int = 64) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(8, width), nn.Linear(width, 2)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def loss_grads_and_kept_bytes(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    """One training step's loss, gradients and the bytes autograd kept for backward."""
    kept = []

    def pack(t):
        kept.append(t.numel() * t.element_size())
        return t

    torch.manual_seed(1)  # the same dropout masks
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, sum(kept)


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_same_loss_and_gradients_with_less_kept_for_backward(policy, monkeypatch):
    decisions = []
    keep = activation_checkpointing._keep_matmuls

    def recording(ctx, op, *args, **kwargs):
        decisions.append((ctx.is_recompute, keep(ctx, op, *args, **kwargs) == CheckpointPolicy.MUST_SAVE))
        return keep(ctx, op, *args, **kwargs)

    monkeypatch.setattr(activation_checkpointing, "_keep_matmuls", recording)
    torch.manual_seed(0)
    plain = Stack().train()
    wrapped = copy.deepcopy(plain)
    assert checkpoint_blocks(wrapped, find_block_classes(wrapped), policy) == 4  # the four blocks, counted
    assert wrapped.state_dict().keys() == plain.state_dict().keys()  # keys unchanged: loads into a plain model
    x, y = torch.randn(32, 8), torch.randint(0, 2, (32,))
    loss, grads, kept = loss_grads_and_kept_bytes(plain, x, y)
    loss_ac, grads_ac, kept_ac = loss_grads_and_kept_bytes(wrapped, x, y)
    assert torch.allclose(loss, loss_ac, atol=1e-6, rtol=0)
    for name, grad in grads.items():
        assert torch.allclose(grad, grads_ac[name], atol=1e-6, rtol=0), name
    # Outside the checkpointed blocks autograd keeps only their inputs (what "selective" keeps inside them is held
    # by the checkpoint itself: counted below by its decisions)
    assert kept_ac < 0.1 * kept, (kept_ac, kept)
    first_pass = [saved for recompute, saved in decisions if not recompute]
    if policy == "selective":  # the two matmuls of each of the four blocks are kept; norm, GELU, dropout are not
        assert sum(first_pass) == 8 and len(first_pass) > 8
    else:
        assert decisions == []


def test_the_callback_resumes_bitwise_and_names_bad_settings(tmp_path):
    def fit(root: Path, stop_at: int | None = None, ckpt_path: str | None = None) -> Stack:
        torch.manual_seed(0)
        model = Stack(depth=2, width=16)
        data = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
        callbacks = [ActivationCheckpointing("selective"), PreemptionCheckpoint(root / "ck")]
        callbacks += [SigtermAt(stop_at)] if stop_at is not None else []
        trainer = Trainer(**tiny_trainer_kwargs(root, max_steps=12, callbacks=callbacks))
        try:
            trainer.fit(model, ResumableDataLoader(data, batch_size=8, per_sample_seed=False), ckpt_path=ckpt_path)
        except Preempted:
            pass
        assert callbacks[0].wrapped == 2
        return model

    whole = fit(tmp_path / "whole")
    fit(tmp_path / "cut", stop_at=5)
    resumed = fit(tmp_path / "cut", ckpt_path=find_resume_checkpoint(tmp_path / "cut" / "ck"))
    for a, b in zip(whole.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="must be one of \\('full', 'selective'\\), got 'some'"):
        ActivationCheckpointing("some")


def test_batch_norm_inside_a_checkpointed_block_is_warned_about(tmp_path):
    class NormBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.norm = nn.Linear(8, 8), nn.BatchNorm1d(8)

        def forward(self, x):
            return self.norm(self.lin(x))

    class Model(Stack):
        def __init__(self) -> None:
            super().__init__(depth=0, width=8)
            self.blocks = nn.ModuleList([NormBlock(), NormBlock()])

    data = TensorDataset(torch.randn(16, 8), torch.randint(0, 2, (16,)))
    trainer = Trainer(**tiny_trainer_kwargs(tmp_path, max_steps=1, callbacks=[ActivationCheckpointing()]))
    with pytest.warns(UserWarning, match=r"hold \['BatchNorm1d'\], whose running statistics are updated again"):
        trainer.fit(Model(), ResumableDataLoader(data, batch_size=8, per_sample_seed=False))


def test_only_the_blocks_are_wrapped_not_a_head_of_the_same_class_beside_them(tmp_path):
    """Blocks that are nn.Sequential in a ModuleList, and an nn.Sequential head beside them: the head is not
    checkpointed (it was, since the blocks were found by class)."""

    class SequentialStack(Stack):
        def __init__(self) -> None:
            super().__init__(depth=0, width=16)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(3))
            self.out = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 2))  # the head

    model = SequentialStack()
    callback = ActivationCheckpointing()
    data = TensorDataset(torch.randn(16, 8), torch.randint(0, 2, (16,)))
    trainer = Trainer(**tiny_trainer_kwargs(tmp_path, max_steps=1, callbacks=[callback]))
    trainer.fit(model, ResumableDataLoader(data, batch_size=8, per_sample_seed=False))
    assert callback.wrapped == 3
    assert all(isinstance(b, activation_checkpointing.CheckpointWrapper) for b in model.blocks)
    assert not isinstance(model.out, activation_checkpointing.CheckpointWrapper)
