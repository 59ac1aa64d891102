"""What ``tune`` may change, and the candidates of each search stage.

A :class:`Candidate` is one setting of every knob; ``None`` means "as the recipe has it". The search
runs in stages (the loader, then precision x compile, then the batch size), each stage starting from
the best candidate so far, so its cost grows with the number of options, not their product.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

from lightning_accel.float8 import fp8_hardware
from lightning_accel.host import usable_cores

__all__ = [
    "Candidate",
    "CompileScope",
    "DataKnobs",
    "activation_checkpointing_candidates",
    "batch_candidates",
    "float8_candidates",
    "loader_candidates",
    "precision_compile_candidates",
    "precisions_for",
    "without_own_candidates",
]

CompileScope = Literal["off", "blocks", "module"]


@dataclass(frozen=True)
class Candidate:
    """One setting of the tuned knobs (``None``: leave the recipe's value).

    Attributes:
        precision: Trainer precision (``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ``"transformer-engine"``).
        compile: ``"off"``, ``"blocks"`` (each repeated block, e.g. every transformer layer) or ``"module"``.
        compile_mode: ``torch.compile`` mode (GPU only: ``"reduce-overhead"``, ``"max-autotune-no-cudagraphs"``).
        num_workers / pin_memory / persistent_workers: the DataModule's loader settings.
        batch_size: The DataModule's per-device batch size.
        accumulate_grad_batches: Set when the global batch is kept while the batch size changes.
        float8: torchao fp8 recipe (``"tensorwise"``, ``"rowwise"``) through ``Float8Training``; GPUs with fp8 only.
        activation_checkpointing: ``ActivationCheckpointing`` policy (``"selective"``, ``"full"``): memory for a
            larger batch.

    For ``float8`` and ``activation_checkpointing``, ``None`` means none: a recipe's own callback is carried by
    the baseline candidate, so that it is measured, and dropped where it only costs, like any other choice.
    """

    precision: str | None = None
    compile: CompileScope = "off"
    compile_mode: str | None = None
    num_workers: int | None = None
    pin_memory: bool | None = None
    persistent_workers: bool | None = None
    batch_size: int | None = None
    accumulate_grad_batches: int | None = None
    float8: str | None = None
    activation_checkpointing: str | None = None

    def with_(self, **changes: Any) -> Candidate:
        return dataclasses.replace(self, **changes)

    def label(self) -> str:
        """Short human-readable form: only what is set."""
        parts = [self.precision or "recipe precision"]
        parts.append("eager" if self.compile == "off" else f"compile {self.compile}")
        if self.compile_mode:
            parts[-1] += f" ({self.compile_mode})"
        if self.num_workers is not None:
            parts.append(f"{self.num_workers} workers")
        if self.pin_memory:
            parts.append("pinned")
        if self.batch_size is not None:
            parts.append(f"batch {self.batch_size}")
        if self.accumulate_grad_batches is not None:
            parts.append(f"accumulate {self.accumulate_grad_batches}")
        if self.float8:
            parts.append(f"fp8 {self.float8}")
        if self.activation_checkpointing:
            parts.append(f"activation checkpointing {self.activation_checkpointing}")
        return ", ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class DataKnobs:
    """Which loader knobs the user's DataModule takes (as ``__init__`` parameters and attributes), and its values."""

    values: dict[str, Any]

    def has(self, name: str) -> bool:
        return name in self.values


def precisions_for(accelerator: str) -> list[str]:
    """The precisions worth trying on this machine, fp32 first (the numerics reference)."""
    if accelerator != "gpu" or not torch.cuda.is_available():
        return ["32-true", "bf16-mixed"]  # CPU autocast: bf16 only
    found = ["32-true"]
    if torch.cuda.is_bf16_supported():
        found.append("bf16-mixed")
    found.append("16-mixed")
    major, _ = torch.cuda.get_device_capability()
    try:
        import transformer_engine  # noqa: F401

        if major >= 9:  # fp8 tensor cores: Hopper and newer
            found.append("transformer-engine")
    except ImportError:
        pass
    return found


def loader_candidates(best: Candidate, data: DataKnobs, accelerator: str) -> Iterator[Candidate]:
    """Worker counts (0, 2, half and all of the cores), pinned memory on GPUs, persistent workers with any."""
    if not data.has("num_workers"):
        return
    cores = usable_cores()
    current = data.values["num_workers"] if best.num_workers is None else best.num_workers
    for workers in sorted({0, 2, max(1, cores // 2), cores} - {current}):
        change: dict[str, Any] = {"num_workers": workers}
        if data.has("persistent_workers"):
            change["persistent_workers"] = workers > 0
        if data.has("pin_memory") and accelerator == "gpu":
            change["pin_memory"] = True
        yield best.with_(**change)


def precision_compile_candidates(best: Candidate, accelerator: str, has_blocks: bool) -> Iterator[Candidate]:
    """Each precision eager, then compiled (per block where the model repeats blocks, then whole), GPU modes last."""
    scopes: list[CompileScope] = ["off", "module"] + (["blocks"] if has_blocks else [])
    for scope in scopes:
        for precision in precisions_for(accelerator):
            yield best.with_(precision=precision, compile=scope, compile_mode=None)
    if accelerator == "gpu":
        for mode in ("max-autotune-no-cudagraphs", "reduce-overhead"):
            yield best.with_(compile="module", compile_mode=mode)


def batch_candidates(
    best: Candidate, base_batch: int, keep_global_batch: bool, max_batch: int, base_accumulate: int = 1
) -> Iterator[Candidate]:
    """Doubling batch sizes from the current one; with ``keep_global_batch``, fewer accumulation steps to match.

    ``base_batch`` and ``base_accumulate`` are the recipe's, for a candidate that does not change them.
    """
    batch = best.batch_size or base_batch
    accumulate = best.accumulate_grad_batches or base_accumulate
    global_batch = batch * accumulate
    while batch * 2 <= max_batch:
        batch *= 2
        if keep_global_batch:
            if global_batch % batch:
                return
            yield best.with_(batch_size=batch, accumulate_grad_batches=global_batch // batch)
        else:
            yield best.with_(batch_size=batch)


def float8_candidates(best: Candidate, accelerator: str) -> Iterator[Candidate]:
    """fp8 through torchao over bf16 (tensorwise, then rowwise), on GPUs that have fp8 only."""
    if accelerator != "gpu" or fp8_hardware() is not None:
        return
    for recipe in ("tensorwise", "rowwise"):
        yield best.with_(float8=recipe, precision="bf16-mixed")


def without_own_candidates(baseline: Candidate, best: Candidate, accelerator: str) -> Iterator[Candidate]:
    """The recipe's own activation checkpointing or fp8, taken off (and the other policy or recipe tried): each
    costs time, and pays only where it buys memory or speed. Nothing when the recipe has neither."""
    if baseline.activation_checkpointing:
        yield best.with_(activation_checkpointing=None)
        other = "selective" if baseline.activation_checkpointing == "full" else "full"
        yield best.with_(activation_checkpointing=other)
    if baseline.float8:
        yield best.with_(float8=None)
        if accelerator == "gpu" and fp8_hardware() is None:
            yield best.with_(float8="rowwise" if baseline.float8 == "tensorwise" else "tensorwise")


def activation_checkpointing_candidates(
    best: Candidate, base_batch: int, keep_global_batch: bool, max_batch: int, base_accumulate: int = 1
) -> Iterator[Candidate]:
    """Each policy (selective first: it recomputes less) at the next larger batch, which did not fit without it."""
    for policy in ("selective", "full"):
        with_policy = best.with_(activation_checkpointing=policy)
        larger = next(batch_candidates(with_policy, base_batch, keep_global_batch, max_batch, base_accumulate), None)
        if larger is not None:
            yield larger
