"""Automatic precision choice per device capability, explicit overrides, and a real bf16 run on CPU."""

from __future__ import annotations

import logging

import pytest
import torch
from lightning.pytorch import Trainer

from lightning_accel.demos import MLPClassifier, SyntheticClassificationDataModule
from lightning_accel.precision import DeviceCapabilities, auto_precision, choose_precision

from .conftest import tiny_trainer_kwargs

CPU = DeviceCapabilities("cpu", "cpu", bf16=True, fp8=False)
V100 = DeviceCapabilities("cuda", "Tesla V100", bf16=False, fp8=False)
A100 = DeviceCapabilities("cuda", "NVIDIA A100", bf16=True, fp8=False)
H100_TE = DeviceCapabilities("cuda", "NVIDIA H100", bf16=True, fp8=True)


@pytest.mark.parametrize(
    ("caps", "allow_fp8", "expected"),
    [
        (CPU, False, "32-true"),  # bf16 autocast is slower than fp32 on CPUs (benchmarks/precision_compile.py)
        (CPU, True, "32-true"),
        (V100, False, "16-mixed"),
        (A100, True, "bf16-mixed"),
        (H100_TE, False, "bf16-mixed"),
        (H100_TE, True, "transformer-engine"),
    ],
)
def test_auto_choice_per_capability(caps, allow_fp8, expected):
    choice = choose_precision("auto-mixed", caps, allow_fp8=allow_fp8)
    assert choice.precision == expected
    assert caps.name in choice.reason


@pytest.mark.parametrize(
    ("requested", "expected"),
    [("32-true", "32-true"), ("16-mixed", "16-mixed"), (16, "16-mixed"), ("bf16", "bf16-mixed")],
)
def test_explicit_choice_wins(requested, expected):
    choice = choose_precision(requested, A100)
    assert choice.precision == expected and choice.reason == "explicitly requested"


@pytest.mark.parametrize(
    ("requested", "caps", "message"),
    [
        ("bf16-mixed", V100, "needs bf16, which Tesla V100 lacks; use '16-mixed'"),
        ("transformer-engine", CPU, "needs an fp8-capable GPU"),
        ("fp7", CPU, "Unknown precision 'fp7'"),
    ],
)
def test_unsupported_explicit_choice_is_a_clear_error(requested, caps, message):
    with pytest.raises(ValueError, match=message):
        choose_precision(requested, caps)


def test_detect_on_this_machine_and_log(caplog):
    expected = (
        "32-true" if not torch.cuda.is_available() else "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    )
    with caplog.at_level(logging.INFO, logger="lightning_accel.precision"):
        assert auto_precision() == expected
    assert f"precision: {expected} (" in caplog.text


def test_bf16_autocast_really_runs_on_cpu(tmp_path):
    seen: list[torch.dtype] = []
    model = MLPClassifier(input_dim=8, hidden_dim=16, num_classes=3)
    model.net[0].register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    dm = SyntheticClassificationDataModule(num_samples=64, input_dim=8, num_classes=3, batch_size=32)
    trainer = Trainer(**tiny_trainer_kwargs(tmp_path, precision=auto_precision("bf16-mixed"), max_steps=2))
    trainer.fit(model, datamodule=dm)
    assert seen == [torch.bfloat16, torch.bfloat16]
    assert next(model.parameters()).dtype == torch.float32  # master weights stay fp32
