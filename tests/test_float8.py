"""Float8Training: which layers go to fp8 and why, checkpoints that load without fp8, refusals that name the fix.

On this CPU machine fp8 runs in torchao's emulation (fp8 casts and scales, matmuls in higher precision): the
conversion, the filter, the state dict and the resume are the same code paths as on a GPU; the speed is not
(benchmarks/gpu_check.sh measures fp8 against bf16 on an H200).
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel import Float8Training, PreemptionCheckpoint, ResumableDataLoader, find_resume_checkpoint
from lightning_accel.float8 import fp8_reasons, output_head
from tests.conftest import requires_cuda, tiny_trainer_kwargs


class Tower(LightningModule):
    """Four linear layers the test defines: two fp8-shaped, one with 30 inputs, and the output head; BatchNorm and
    Dropout between them, a per-step LR schedule."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(30, 64)  # 30 inputs: not a multiple of 16
        self.body = nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Dropout(0.1))
        self.mix = nn.Linear(128, 64)
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        return self.head(torch.relu(self.mix(self.body(self.embed(x)))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        return [opt], [{"scheduler": torch.optim.lr_scheduler.StepLR(opt, 2, 0.5), "interval": "step"}]


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(64, 30, generator=g), torch.randint(0, 10, (64,), generator=g))


def fit(tmp_path, callbacks, max_steps=4, ckpt_path=None) -> Tower:
    torch.manual_seed(0)
    model = Tower()
    trainer = Trainer(**tiny_trainer_kwargs(tmp_path, max_steps=max_steps, callbacks=callbacks))
    trainer.fit(model, ResumableDataLoader(data(), batch_size=16, seed=1), ckpt_path=ckpt_path)
    return model


def test_the_filter_admits_exactly_the_layers_fp8_can_pay_on_and_says_why_for_the_rest(tmp_path, caplog):
    fp8 = Float8Training(emulate=True)
    with caplog.at_level("INFO"):
        model = fit(tmp_path, [fp8], max_steps=2)
    assert fp8.converted == ["body.0", "mix"]
    assert set(fp8.skipped) == {"embed", "head"}
    assert "30 -> 64 features: fp8 matmuls need multiples of 16" in fp8.skipped["embed"]
    assert "output head" in fp8.skipped["head"]
    kinds = {name: type(m).__name__ for name, m in model.named_modules() if name in ("embed", "body.0", "mix", "head")}
    assert kinds == {"embed": "Linear", "body.0": "Float8Linear", "mix": "Float8Linear", "head": "Linear"}
    assert "2 of 4 linear layers in fp8" in caplog.text and "embed stays in 32-true: 30 -> 64 features" in caplog.text
    # skip by name; the head judged like the others when asked (10 outputs: still not fp8-shaped)
    assert fp8_reasons(Tower(), skip=["mix"], skip_output_head=False) == {
        "embed": fp8.skipped["embed"],
        "body.0": None,
        "mix": "named in skip",
        "head": "64 -> 10 features: fp8 matmuls need multiples of 16",
    }


class Conv1D(nn.Module):
    """transformers' GPT-2 projection, as it is defined there: a linear layer with its weight stored (in, out)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*x.shape[:-1], self.nf)


class GPT2Like(nn.Module):
    """Embeddings, blocks whose projections are Conv1D, and an lm_head tied to the token embedding."""

    def __init__(self, vocab: int = 64, width: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.h = nn.ModuleList(nn.ModuleDict({"c_attn": Conv1D(3 * width, width), "c_proj": Conv1D(width, width),
                                              "c_fc": Conv1D(4 * width, width), "mlp_proj": Conv1D(width, 4 * width)})
                               for _ in range(depth))  # fmt: skip
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight


class HeadFirst(nn.Module):
    """Registers its head first, under a name outside HEAD_NAMES, then the blocks: the head is still the head."""

    def __init__(self, vocab: int = 64, width: int = 32) -> None:
        super().__init__()
        self.to_logits = nn.Linear(width, vocab)
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(2))


class Untied(nn.Module):
    """No head name, no tied weights: the vocabulary-wide layer outside the blocks, registered before an adapter."""

    def __init__(self, vocab: int = 48, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        self.project = nn.Linear(width, vocab)
        self.adapter = nn.Linear(width, width)


def test_the_head_is_found_by_what_it_is_and_conv1d_layers_are_named_with_why():
    gpt2 = fp8_reasons(GPT2Like())
    assert "output head" in gpt2["lm_head"]  # tied to the embedding
    conv = [name for name, why in gpt2.items() if why is not None and "Conv1D" in why]
    assert len(conv) == 8 and all("only nn.Linear trains in fp8" in gpt2[name] for name in conv)
    assert output_head(HeadFirst()) == "to_logits"
    reasons = fp8_reasons(HeadFirst())
    assert "output head" in reasons["to_logits"] and reasons["blocks.1.0"] is None  # a block's last layer: fp8
    assert output_head(Untied()) == "project"  # as wide as the vocabulary
    assert output_head(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))) == "1"  # nothing else to go by: the last


def test_an_fp8_checkpoint_loads_into_the_model_without_fp8_and_resumes_bitwise(tmp_path):
    """Same keys, same dtypes: the plain model takes the fp8 run's weights strictly. Stopped at step 3 and resumed
    with fp8 to step 6, the weights equal an uninterrupted fp8 run's bit for bit."""
    whole = fit(tmp_path / "whole", [Float8Training(emulate=True)], max_steps=6)
    plain = Tower()
    assert plain.load_state_dict(whole.state_dict(), strict=True).missing_keys == []
    assert {k: v.dtype for k, v in plain.state_dict().items()} == {k: v.dtype for k, v in whole.state_dict().items()}
    ck = tmp_path / "ck"
    fit(tmp_path / "first", [Float8Training(emulate=True), PreemptionCheckpoint(ck, every_n_steps=3)], max_steps=3)
    resumed = fit(
        tmp_path / "second",
        [Float8Training(emulate=True), PreemptionCheckpoint(ck, every_n_steps=3)],
        max_steps=6,
        ckpt_path=find_resume_checkpoint(ck),
    )
    expected = whole.state_dict()
    assert all(torch.equal(t, expected[k]) for k, t in resumed.state_dict().items())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without an fp8 GPU")
def test_without_fp8_hardware_it_refuses_at_construction_or_falls_back_when_asked(tmp_path, caplog):
    with pytest.raises(ValueError, match=r"no CUDA GPU on this machine; fp8 matmuls need an NVIDIA GPU of compute"):
        Float8Training()
    with pytest.raises(ValueError, match=r"recipe must be one of \('tensorwise', 'rowwise'"):
        Float8Training(recipe="blockwise", emulate=True)
    with pytest.raises(ValueError, match="on_unsupported must be 'error' or 'fallback'"):
        Float8Training(on_unsupported="ignore", emulate=True)
    with caplog.at_level("WARNING"):
        fallback = Float8Training(on_unsupported="fallback")
    assert not fallback.active and "training without fp8 (on_unsupported='fallback')" in caplog.text
    model = fit(tmp_path, [fallback], max_steps=1)
    assert fallback.converted == [] and not any("Float8" in type(m).__name__ for m in model.modules())


@requires_cuda
def test_fp8_trains_on_a_gpu_that_has_it(tmp_path):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs an fp8 GPU (compute capability 8.9+); this one is older")
    fp8 = Float8Training()
    torch.manual_seed(0)
    trainer = Trainer(
        accelerator="gpu",
        devices=1,
        precision="bf16-mixed",
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[fp8],
    )
    trainer.fit(Tower(), DataLoader(data(), batch_size=16))
    assert fp8.converted == ["body.0", "mix"]


def test_fp8_composes_with_torch_compile(tmp_path):
    """Float8Training then TorchCompile: the converted forward compiles (no fallback to eager) and trains."""
    from lightning_accel import TorchCompile

    fp8, compiled = Float8Training(emulate=True), TorchCompile(backend="aot_eager", fallback=False)
    model = fit(tmp_path, [fp8, compiled], max_steps=2)
    assert fp8.converted == ["body.0", "mix"] and not compiled.failed and sum(compiled.compile_time_s.values()) > 0
    assert all(torch.isfinite(p).all() for p in model.parameters())


class Blocks(LightningModule):
    """Repeated blocks (what ActivationCheckpointing wraps) of fp8-shaped linear layers, with Dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(30, 64), nn.Linear(64, 10)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 128), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, 64))
            for _ in range(2)
        )

    def training_step(self, batch, batch_idx):
        x = self.inp(batch[0])
        for block in self.blocks:
            x = x + block(x)
        return nn.functional.cross_entropy(self.out(x), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_fp8_composes_with_activation_checkpointing_and_compile(tmp_path):
    """fp8 layers inside checkpointed blocks: the recompute gives the same weights as without checkpointing (Dropout
    masks replayed), and the whole stack also compiles."""
    from lightning_accel import ActivationCheckpointing, TorchCompile

    def train(callbacks) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = Blocks()
        trainer = Trainer(**tiny_trainer_kwargs(tmp_path, max_steps=3, callbacks=callbacks))
        trainer.fit(model, ResumableDataLoader(data(), batch_size=16, seed=1))
        return model.state_dict()

    fp8_only = Float8Training(emulate=True)
    plain = train([fp8_only])
    fp8, ac = Float8Training(emulate=True), ActivationCheckpointing(policy="selective")
    checkpointed = train([fp8, ac])
    assert fp8.converted == fp8_only.converted == [f"blocks.{i}.{j}" for i in (0, 1) for j in (1, 4)]
    assert ac.wrapped and set(checkpointed) == set(plain)
    for name, value in plain.items():
        torch.testing.assert_close(checkpointed[name], value, rtol=0, atol=1e-6, msg=name)
    compiled = TorchCompile(backend="aot_eager", fallback=False)
    train([Float8Training(emulate=True), ActivationCheckpointing(policy="full"), compiled])
    assert not compiled.failed
