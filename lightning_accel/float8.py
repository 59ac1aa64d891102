"""fp8 training of a model's linear layers through torchao's float8 (``convert_to_float8_training``).

fp8 matmuls run on NVIDIA GPUs of compute capability 8.9 and newer (Ada: L4, L40S; Hopper: H100, H200; Blackwell).
They pay on large matmuls (torchtitan: +48% tokens/s on Llama 3 8B with compile) and cost on small ones (the casts
and scales dominate), so the callback converts only the layers where fp8 can pay: ``nn.Linear`` whose in and out
features are multiples of 16 (what ``torch._scaled_mm`` needs), never the output head (its logits lose the most
from fp8), and none that are named in ``skip``. Whether fp8 pays on *your* model is for ``lightning-accel tune``
to measure: it keeps fp8 only when it is faster than bf16 and inside its numerics guard.

Parameters stay in their dtype and under their names (torchao swaps the module, not its weights), so checkpoints
load into the same model without fp8, and resume exactly with it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from typing_extensions import override

from lightning_accel.blocks import find_blocks
from lightning_accel.extras import MissingExtra, available, pip_install

__all__ = [
    "ALIGNMENT",
    "FP8_CAPABILITY",
    "HARDWARE",
    "HEAD_NAMES",
    "RECIPES",
    "Float8Training",
    "Recipe",
    "fp8_hardware",
    "fp8_reasons",
    "output_head",
]

log = logging.getLogger(__name__)

Recipe = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"]
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # torchao's Float8LinearRecipeName values
FP8_CAPABILITY = (8, 9)
ALIGNMENT = 16  # torch._scaled_mm needs both matrix dimensions divisible by 16
# Names an output head goes by (output_head also takes any name with "logit" or ending in "head").
HEAD_NAMES = ("lm_head", "head", "output", "out", "classifier", "logits", "fc_out")
HARDWARE = "an NVIDIA GPU of compute capability 8.9 or newer (Ada: L4, L40S; Hopper: H100, H200; Blackwell)"


def fp8_hardware() -> str | None:
    """``None`` when this machine can train in fp8, else what it lacks."""
    if not torch.cuda.is_available():
        return f"no CUDA GPU on this machine; fp8 matmuls need {HARDWARE}"
    capability = torch.cuda.get_device_capability()
    if capability < FP8_CAPABILITY:
        name = torch.cuda.get_device_name()
        return f"{name} has compute capability {capability[0]}.{capability[1]}; fp8 matmuls need {HARDWARE}"
    return None


def _in_blocks(module: nn.Module) -> set[str]:
    """Names of the modules inside the model's repeated blocks (:func:`~lightning_accel.blocks.find_blocks`)."""
    blocks = {id(b) for b in find_blocks(module)}
    roots = [name for name, m in module.named_modules() if id(m) in blocks]
    return {name for name, _ in module.named_modules() if any(name.startswith(r + ".") for r in roots)}


def output_head(module: nn.Module) -> str | None:
    """The output head among ``module``'s ``nn.Linear`` layers, found by what it is, not by registration order: the
    one whose weight is tied to an embedding's; else one named like a head (``lm_head``, ``to_logits``, a name in
    :data:`HEAD_NAMES`); else, outside the repeated blocks, one with as many outputs as an embedding has rows (the
    vocabulary); else the last one outside the blocks; else the last one."""
    linears = [(name, m) for name, m in module.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        return None
    embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding)]
    tied = [name for name, m in linears if any(m.weight is e.weight for e in embeddings)]
    named = [
        name
        for name, _ in linears
        if (last := name.rsplit(".", 1)[-1]) in HEAD_NAMES or "logit" in last or last.endswith("head")
    ]
    inside = _in_blocks(module)
    outside = [(name, m) for name, m in linears if name not in inside]
    vocab = [name for name, m in outside if any(m.out_features == e.num_embeddings for e in embeddings)]
    for found in (tied, named, vocab, [name for name, _ in outside]):
        if found:
            return found[-1]
    return linears[-1][0]


def _is_transposed_linear(layer: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2 and its kin): a linear layer whose weight is stored as (in, out)."""
    return type(layer).__name__ == "Conv1D" and getattr(getattr(layer, "weight", None), "dim", lambda: 0)() == 2


def fp8_reasons(module: nn.Module, skip: Sequence[str] = (), skip_output_head: bool = True) -> dict[str, str | None]:
    """Every ``nn.Linear`` (and transformers ``Conv1D``) in ``module`` by name: ``None`` when it goes to fp8, else
    why it stays."""
    head = output_head(module) if skip_output_head else None
    reasons: dict[str, str | None] = {}
    for name, layer in module.named_modules():
        if _is_transposed_linear(layer):
            reasons[name] = (
                "a transformers Conv1D (a linear layer with its weight stored transposed), which torchao does not "
                "convert: only nn.Linear trains in fp8. Use a model whose projections are nn.Linear (for GPT-2, "
                "transformers' GPT-2 with nn.Linear layers, or your own port) to train these in fp8"
            )
        elif not isinstance(layer, nn.Linear):
            continue
        elif name in skip:
            reasons[name] = "named in skip"
        elif name == head:
            reasons[name] = "the output head: its logits lose the most precision in fp8"
        elif layer.in_features % ALIGNMENT or layer.out_features % ALIGNMENT:
            reasons[name] = (
                f"{layer.in_features} -> {layer.out_features} features: fp8 matmuls need multiples of {ALIGNMENT}"
            )
        else:
            reasons[name] = None
    return reasons


class Float8Training(Callback):
    """Train the model's suitable ``nn.Linear`` layers in fp8 with torchao (use with ``precision="bf16-mixed"``).

    Args:
        recipe: torchao's scaling recipe: ``"tensorwise"`` (fastest; the only one whose weights FSDP2 all-gathers in
            fp8), ``"rowwise"`` (one scale per row: more accurate, a little slower), ``"rowwise_with_gw_hp"``.
        skip: Names of linear layers (as in ``named_modules()``) to keep in their precision.
        skip_output_head: Keep the output head out of fp8, found by what it is (:func:`output_head`: tied to the
            embedding, named like a head, as wide as the vocabulary, or the last linear layer outside the blocks).
        on_unsupported: Without fp8 hardware: ``"error"`` refuses when the callback is made (at ``Trainer(...)``),
            ``"fallback"`` logs that it trains without fp8 and changes nothing.
        emulate: torchao's emulation (fp8 casts and scales, matmuls in higher precision): runs anywhere, is slow;
            for tests and CPU debugging of the numerics only.
    """

    def __init__(
        self,
        recipe: Recipe = "tensorwise",
        skip: Sequence[str] = (),
        skip_output_head: bool = True,
        on_unsupported: Literal["error", "fallback"] = "error",
        emulate: bool = False,
    ) -> None:
        if recipe not in RECIPES:
            raise ValueError(f"Float8Training: recipe must be one of {RECIPES}, got {recipe!r}")
        if on_unsupported not in ("error", "fallback"):
            raise ValueError(f"Float8Training: on_unsupported must be 'error' or 'fallback', got {on_unsupported!r}")
        self.recipe, self.skip, self.skip_output_head, self.emulate = recipe, tuple(skip), skip_output_head, emulate
        self.converted: list[str] = []  # the layers now in fp8
        self.skipped: dict[str, str] = {}  # the layers kept, and why
        self._fsdp_all_gather = False
        missing = None if emulate else fp8_hardware()
        if missing is None and not available("torchao"):
            if on_unsupported == "error":
                raise MissingExtra("Float8Training", "fp8")
            missing = f"torchao is not installed ({pip_install('fp8')})"
        self.active = missing is None
        if missing is not None and on_unsupported == "error":
            raise ValueError(
                f"Float8Training: {missing}. Use precision='bf16-mixed' without it, or pass "
                "on_unsupported='fallback' to train without fp8 where it is not available."
            )
        if missing is not None:
            log.warning("Float8Training: %s; training without fp8 (on_unsupported='fallback')", missing)

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit" or not self.active or self.converted:
            return
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        reasons = fp8_reasons(pl_module, self.skip, self.skip_output_head)
        self.skipped = {name: why for name, why in reasons.items() if why is not None}
        config = Float8LinearConfig.from_recipe_name(self.recipe)
        # FSDP2 can all-gather the weights already cast to fp8 (half the bytes of bf16), with tensorwise scales only.
        self._fsdp_all_gather = isinstance(trainer.strategy, ModelParallelStrategy) and self.recipe == "tensorwise"
        config = dataclasses.replace(config, emulate=self.emulate, enable_fsdp_float8_all_gather=self._fsdp_all_gather)
        convert_to_float8_training(pl_module, config=config, module_filter_fn=lambda _, name: reasons.get(name) is None)
        self.converted = [name for name, why in reasons.items() if why is None]
        log.info("Float8Training (%s): %d of %d linear layers in fp8", self.recipe, len(self.converted), len(reasons))
        transposed = [name for name, layer in pl_module.named_modules() if _is_transposed_linear(layer)]
        if transposed:
            log.warning(
                "Float8Training: %d transformers Conv1D layers (%s) do the model's matmuls and stay out of fp8: %s",
                len(transposed),
                ", ".join(transposed[:4]) + (", ..." if len(transposed) > 4 else ""),
                self.skipped[transposed[0]],
            )
        for name, why in self.skipped.items():
            log.info("Float8Training: %s stays in %s: %s", name, trainer.precision, why)
        if not self.converted:
            log.warning("Float8Training: no linear layer qualifies for fp8 (see the reasons above); nothing changes")

    @override
    def on_before_zero_grad(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        # After the optimizer step: one all-reduce computes every fp8 weight's scale for the next all-gather.
        if self._fsdp_all_gather and self.converted:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(pl_module)
