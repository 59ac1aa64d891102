"""Automatic precision choice: bf16 on GPUs that have it, fp16 + loss scaling on older GPUs, fp8 on Hopper (opt-in),
fp32 on CPUs (where our benchmark measures bf16 autocast slower).

The result is a plain Lightning precision string, so it works with every strategy (DDP, DeepSpeed, FSDP
pick their own precision plugin from it)::

    Trainer(precision=auto_precision())            # decides from the hardware, logs why
    Trainer(precision=auto_precision("16-mixed"))  # explicit choice: validated, never overridden
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

import torch

from lightning_accel._compat import PRECISION_ALIASES, PRECISION_STRINGS

__all__ = ["AUTO", "DeviceCapabilities", "PrecisionChoice", "auto_precision", "choose_precision"]

log = logging.getLogger(__name__)

AUTO = "auto-mixed"


@dataclass(frozen=True)
class DeviceCapabilities:
    """What the training device can do, as far as precision is concerned."""

    device_type: str  # "cuda" or "cpu"
    name: str
    bf16: bool
    fp8: bool  # compute capability >= 8.9 (Ada/Hopper) with Transformer Engine installed

    @classmethod
    def detect(cls, accelerator: str = "auto") -> DeviceCapabilities:
        """Probe the device Lightning would train on (``accelerator`` as given to the Trainer)."""
        # A GPU accelerator without a visible GPU is Lightning's error to report, not ours.
        if accelerator not in ("auto", "gpu", "cuda") or not torch.cuda.is_available():
            return cls("cpu", "cpu", bf16=True, fp8=False)
        major, minor = torch.cuda.get_device_capability()
        te = importlib.util.find_spec("transformer_engine") is not None
        return cls(
            "cuda",
            torch.cuda.get_device_name(),
            bf16=torch.cuda.is_bf16_supported(),
            fp8=te and (major, minor) >= (8, 9),
        )


@dataclass(frozen=True)
class PrecisionChoice:
    """A Lightning precision string and the reason it was chosen."""

    precision: str
    reason: str


def choose_precision(
    requested: str | int | None = AUTO, caps: DeviceCapabilities | None = None, allow_fp8: bool = False
) -> PrecisionChoice:
    """Decide the precision for ``caps`` (detected when ``None``). Pure: no logging, no side effects.

    Args:
        requested: ``"auto-mixed"`` (or ``None``) to decide from the hardware; any Lightning precision
            (``"bf16-mixed"``, ``"16-mixed"``, ``"32-true"``, ``"transformer-engine"`` ...) to use it as-is
            after checking the hardware supports it.
        caps: Device capabilities; detected from the visible device when ``None``.
        allow_fp8: Let ``auto-mixed`` pick fp8 (Transformer Engine) where supported. Off by default since
            fp8 changes numerics more than bf16 does.

    Raises:
        ValueError: unknown precision, or one this hardware cannot run (the message names the fix).
    """
    caps = caps or DeviceCapabilities.detect()
    req = AUTO if requested is None else PRECISION_ALIASES.get(str(requested), str(requested))
    if req == AUTO:
        if caps.device_type == "cpu":
            # benchmarks/precision_compile.py: bf16-mixed trains at 0.69-0.82x fp32 on CPUs, AMX/AVX512-BF16
            # ones included (autocast's casts cost more than the faster matmuls save); measure with `tune`.
            return PrecisionChoice(
                "32-true",
                f"{caps.name}: bf16 autocast measured slower than fp32 on CPUs (benchmarks/precision_compile.py); "
                "pass 'bf16-mixed' to use it anyway",
            )
        if allow_fp8 and caps.fp8:
            return PrecisionChoice(
                "transformer-engine", f"{caps.name} supports fp8 and Transformer Engine is installed"
            )
        if caps.bf16:
            return PrecisionChoice("bf16-mixed", f"{caps.name} supports bf16: no loss scaling needed")
        return PrecisionChoice("16-mixed", f"{caps.name} lacks bf16: fp16 autocast with dynamic loss scaling")
    if req not in PRECISION_STRINGS:
        raise ValueError(f"Unknown precision {requested!r}. Use {AUTO!r} or one of: {', '.join(PRECISION_STRINGS)}")
    if req.startswith("bf16") and not caps.bf16:
        raise ValueError(f"precision={requested!r} needs bf16, which {caps.name} lacks; use '16-mixed' or {AUTO!r}")
    if req.startswith("transformer-engine") and not caps.fp8:
        raise ValueError(
            f"precision={requested!r} needs an fp8-capable GPU (compute capability >= 8.9) and the "
            f"transformer_engine package; {caps.name} does not qualify. Use {AUTO!r}"
        )
    return PrecisionChoice(req, "explicitly requested")


def auto_precision(requested: str | int | None = AUTO, accelerator: str = "auto", allow_fp8: bool = False) -> str:
    """Return the Lightning precision string to pass as ``Trainer(precision=...)``, logging the choice."""
    choice = choose_precision(requested, DeviceCapabilities.detect(accelerator), allow_fp8=allow_fp8)
    log.info("lightning_accel precision: %s (%s)", choice.precision, choice.reason)
    return choice.precision
