"""What the core install leaves out: each optional feature's pip extra, and the one error that names it.

``pip install lightning-accel`` installs what every callback needs (Lightning, torch, the monitors' Prometheus
client). DALI, DeepSpeed, torchao, Ray, HolisticTraceAnalysis and the object-store backends are extras, so a user
of GoodputMonitor or PreemptionCheckpoint does not download a GiB of CUDA wheels. A feature that needs one checks at
construction (:func:`require`) and raises :class:`MissingExtra`, naming the command that installs it, before any
training runs.
"""

from __future__ import annotations

import importlib.util

__all__ = ["EXTRAS", "MissingExtra", "available", "pip_install", "require"]

# Each extra (pyproject.toml's [project.optional-dependencies]) and the module it provides.
EXTRAS: dict[str, str] = {
    "dali": "nvidia.dali",
    "deepspeed": "deepspeed",
    "fp8": "torchao",
    "ray": "ray.train",
    "profile": "hta",
    "cloud": "s3fs",
}


def pip_install(extra: str) -> str:
    """The command that installs ``extra``, as every message that names one says it."""
    return f"pip install 'lightning-accel[{extra}]'"


class MissingExtra(ImportError):
    """A feature needs a package the core install leaves out; the message names the pip extra that installs it
    (``message``: the caller's own wording of that, as a bucket URL's check has)."""

    def __init__(self, feature: str, extra: str, module: str | None = None, message: str | None = None) -> None:
        self.feature, self.extra, self.module = feature, extra, module or EXTRAS[extra]
        default = f"{feature} needs {self.module}, which the core install leaves out: {pip_install(extra)} (or [all])"
        super().__init__(message or default, name=self.module)


def available(module: str) -> bool:
    """Whether ``module`` can be imported here, without importing it (DALI's and DeepSpeed's imports are heavy)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a broken install
        return False


def require(extra: str, feature: str, module: str | None = None) -> None:
    """Raise :class:`MissingExtra` now if ``extra``'s module (or ``module``) is not installed."""
    if not available(module or EXTRAS[extra]):
        raise MissingExtra(feature, extra, module)
