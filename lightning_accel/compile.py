"""``torch.compile`` as a callback, with an eager fallback when compilation fails."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn

log = logging.getLogger(__name__)


class _CompiledForward:
    """Replaces ``module.forward``: runs the compiled graph, falls back to eager if compilation fails.

    Compilation is lazy in torch (it happens at the first call), so failures can only be caught here.
    """

    def __init__(self, owner: CompileCallback, name: str, module: nn.Module, compile_kwargs: dict[str, Any]) -> None:
        self.owner, self.name, self.module = owner, name, module
        self.eager: Callable[..., Any] = module.forward
        self.compiled: Callable[..., Any] = torch.compile(self.eager, **compile_kwargs)
        self.first_call = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.first_call:
            return self.compiled(*args, **kwargs)
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
            self.first_call = False
        self.owner.compile_time_s[self.name] = time.perf_counter() - start
        log.info(
            "compiled %r in %.2fs (first call, includes the compiled run)",
            self.name,
            self.owner.compile_time_s[self.name],
        )
        return out


class CompileCallback(Callback):
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
        compile_time_s: Seconds of the first (compiling) call per compiled module.
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

    def setup(
        self, trainer: Trainer, pl_module: LightningModule, stage: Literal["fit", "validate", "test", "predict"]
    ) -> None:
        if self._patched:  # setup runs again for every trainer.fit/validate call
            return
        for name in self.modules or [""]:
            try:
                module = pl_module.get_submodule(name)
            except AttributeError as err:
                raise ValueError(f"CompileCallback: {type(pl_module).__name__} has no submodule {name!r}") from err
            module.forward = _CompiledForward(self, name or type(pl_module).__name__, module, self.compile_kwargs)
            self._patched.append(module)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Leave the user's module as we found it (eager), e.g. before it is pickled or reused.
        for module in self._patched:
            module.__dict__.pop("forward", None)
        self._patched.clear()
