"""``torch.compile`` as a callback, with an eager fallback when compilation fails."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from typing_extensions import override

from lightning_accel._compat import dispatch_mode_active
from lightning_accel.phases import COMPILE_ACTION

__all__ = ["TorchCompile"]

log = logging.getLogger(__name__)


class _CompiledForward:
    """Replaces ``module.forward``: runs the compiled graph, falls back to eager if compilation fails.

    Compilation is lazy in torch (it happens at the first call), so failures can only be caught here. torch
    compiles again when grad mode or train/eval mode changes (a sanity check, then training), so the first
    call in each such mode is timed as compilation and announced to the Trainer's profiler.
    """

    def __init__(self, owner: TorchCompile, name: str, module: nn.Module, compile_kwargs: dict[str, Any]) -> None:
        self.owner, self.name, self.module = owner, name, module
        self.eager: Callable[..., Any] = module.forward
        self.compiled: Callable[..., Any] = torch.compile(self.eager, **compile_kwargs)
        self.seen_modes: set[tuple[bool, bool]] = set()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        mode = (torch.is_grad_enabled(), self.module.training)
        if mode in self.seen_modes:
            return self.compiled(*args, **kwargs)
        if dispatch_mode_active():
            # A FLOP count (GoodputMonitor's first batch, Lightning's measure_flops) runs under a dispatch mode;
            # compiling under it would make dynamo skip this forward for good. Count it eagerly, compile next call.
            return self.eager(*args, **kwargs)
        self.seen_modes.add(mode)
        profiler = self.owner.profiler
        if profiler is not None:
            profiler.start(COMPILE_ACTION)
        start = time.perf_counter()
        try:
            out = self.compiled(*args, **kwargs)
        except Exception as err:
            if not self.owner.fallback:
                raise
            log.warning("torch.compile failed for %r (%s: %s); running it eagerly", self.name, type(err).__name__, err)
            self.owner.failed[self.name] = f"{type(err).__name__}: {err}"
            self.module.__dict__.pop("forward", None)  # restore the class's eager forward
            return self.module(*args, **kwargs)
        finally:
            elapsed = time.perf_counter() - start  # inside the profiler's region, never longer
            if profiler is not None:
                profiler.stop(COMPILE_ACTION)
        self.owner.compile_time_s[self.name] = self.owner.compile_time_s.get(self.name, 0.0) + elapsed
        self.owner.backward_pending |= mode[0]
        log.info("compiled %r in %.2fs (first call with grad=%s, training=%s)", self.name, elapsed, *mode)
        return out


class TorchCompile(Callback):
    """Compile the LightningModule's ``forward`` (or named submodules) with ``torch.compile`` at setup.

    Compilation is applied in place to ``forward``, not by wrapping the module, so parameter names,
    checkpoints and the strategy's own wrapping (DDP, FSDP) are unchanged. torch compiles lazily, at
    the first call, and under DDP that call runs inside DDP's forward: dynamo sees the active DDP
    module and its DDPOptimizer splits the graph at gradient-bucket boundaries, so all-reduce still
    overlaps the backward pass, which is what compiling after wrapping is recommended for.

    Args:
        modules: Dotted names of submodules to compile (e.g. ``["model.encoder"]``); ``None`` compiles the
            LightningModule's own ``forward``.
        mode: ``torch.compile`` mode (``"default"``, ``"reduce-overhead"``, ``"max-autotune"``...).
        fullgraph: Require a single graph (no graph breaks).
        dynamic: Dynamic-shape compilation (``None`` lets torch decide).
        backend: ``torch.compile`` backend.
        fallback: On a compilation error, log a warning and run eagerly. ``False`` re-raises.

    Attributes:
        compile_time_s: Seconds of the compiling calls per module: the first forward in each grad/train mode
            (that call's own run included); the first backward after a compiled forward is timed as
            compilation too (AOTAutograd compiles the backward graph then), under ``"backward"``.
        failed: Modules that fell back to eager, with the error.
    """

    def __init__(
        self,
        modules: Sequence[str] | None = None,
        mode: str | None = None,
        fullgraph: bool = False,
        dynamic: bool | None = None,
        backend: str = "inductor",
        fallback: bool = True,
    ) -> None:
        self.modules = list(modules) if modules is not None else None
        self.compile_kwargs: dict[str, Any] = {
            "mode": mode,
            "fullgraph": fullgraph,
            "dynamic": dynamic,
            "backend": backend,
        }
        self.fallback = fallback
        self.compile_time_s: dict[str, float] = {}
        self.failed: dict[str, str] = {}
        self._patched: list[nn.Module] = []
        self.profiler: Any = None  # the Trainer's, while fitting: compile time is announced to it
        self.backward_pending = False
        self._timing_backward: float | None = None

    @override
    def setup(
        self, trainer: Trainer, pl_module: LightningModule, stage: Literal["fit", "validate", "test", "predict"]
    ) -> None:
        self.profiler = trainer.profiler
        if self._patched:  # setup runs again for every trainer.fit/validate call
            return
        for name in self.modules or [""]:
            try:
                module = pl_module.get_submodule(name)
            except AttributeError as err:
                raise ValueError(f"TorchCompile: {type(pl_module).__name__} has no submodule {name!r}") from err
            module.forward = _CompiledForward(self, name or type(pl_module).__name__, module, self.compile_kwargs)
            self._patched.append(module)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.profiler = trainer.profiler  # a monitor may have wrapped it in its own setup

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        if self.backward_pending:
            self.backward_pending = False
            trainer.profiler.start(COMPILE_ACTION)
            self._timing_backward = time.perf_counter()

    @override
    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._timing_backward is not None:
            elapsed = time.perf_counter() - self._timing_backward
            trainer.profiler.stop(COMPILE_ACTION)
            self.compile_time_s["backward"] = self.compile_time_s.get("backward", 0.0) + elapsed
            self._timing_backward = None

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.profiler = None
        # Leave the user's module as we found it (eager), e.g. before it is pickled or reused.
        for module in self._patched:
            module.__dict__.pop("forward", None)
        self._patched.clear()
