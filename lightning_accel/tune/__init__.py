"""Measure, don't guess: tune precision, compile, the loader and the batch size on the user's own model.

    lightning-accel tune --config recipe.yaml [--budget 5m] [--out tuned.yaml]

or, from code, ``lightning_accel.tune(model=..., datamodule=..., trainer_kwargs=...)``: this package is
callable (``lightning_accel.tune(...)`` is :func:`tune`) and still holds its names
(``lightning_accel.tune.TrialSettings``). See docs/tune.md.
"""

from __future__ import annotations

import inspect
import logging
import sys
import time
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_accel.tune.report import plot, print_report, show_trial, wide_console, write_json, write_tuned_yaml
from lightning_accel.tune.search import Search, Trial, TuneResult, data_knobs, parse_budget, pickle_objects
from lightning_accel.tune.space import Candidate
from lightning_accel.tune.trial import TrialResult, TrialSettings, temporary_workdir

__all__ = ["Candidate", "TrialSettings", "TuneResult", "tune"]

log = logging.getLogger(__name__)


def _compile_of(trainer: Any) -> tuple[str, str | None]:
    from lightning_accel.compile import TorchCompile

    found = [c for c in trainer.callbacks if isinstance(c, TorchCompile)]
    if not found:
        return "off", None
    return ("module" if found[0].modules is None else "blocks"), found[0].compile_kwargs.get("mode")


def _block_names(model: Any) -> list[str]:
    from lightning_accel.strategies.fsdp import find_block_classes

    blocks = tuple(find_block_classes(model))
    return [name for name, m in model.named_modules() if name and blocks and isinstance(m, blocks)]


def _planned_samples(trainer: Any) -> Any:
    """The untuned run's planned samples per device, from its limits and the baseline trial's batch and epoch."""
    max_steps, max_epochs = trainer.max_steps, trainer.max_epochs
    accumulate = trainer.accumulate_grad_batches

    def planned(r: TrialResult) -> float | None:
        if not r.batch_size:
            return None
        if max_steps and max_steps > 0:
            return float(max_steps * accumulate * r.batch_size)
        if max_epochs and max_epochs > 0 and r.batches_per_epoch:
            return float(max_epochs * r.batches_per_epoch * r.batch_size)
        return None  # unbounded run: compile time is not amortized

    return planned


def tune(
    config: str | Path | None = None,
    *,
    model: Any = None,
    datamodule: Any = None,
    trainer_kwargs: dict[str, Any] | None = None,
    overrides: Sequence[str] = (),
    budget: str | float = "5m",
    out: str | Path | None = None,
    keep_global_batch: bool = False,
    max_batch: int | None = None,
    loss_tolerance: float = 0.05,
    min_gain: float = 0.02,
    settings: TrialSettings | None = None,
    show: bool = True,
) -> TuneResult:
    """Try precision, compile, loader and batch settings on this model and data, each trial in a fresh process.

    Args:
        config: A recipe YAML (as for ``lightning-accel fit``); ``overrides`` are extra CLI arguments for it.
        model / datamodule / trainer_kwargs: Instead of a recipe: untrained objects (picklable, defined at
            module level) and the ``Trainer`` arguments of the run to tune; ``datamodule=None`` for a model
            with its own ``train_dataloader()`` (its loader knobs are then the model's).
        budget: Wall-clock limit for the whole search (``300``, ``"90s"``, ``"5m"``); no trial starts that
            the remaining budget cannot finish, and a running one is stopped at the limit.
        out: The tuned recipe (config only; default ``runs/tune/<recipe>/tuned.yaml``). ``tuned.json`` (every
            trial) and ``tuned.png`` go beside it; with objects, only ``out``'s folder is used, if given.
        keep_global_batch: Keep ``batch_size x accumulate_grad_batches`` when trying larger batches.
        max_batch: Largest batch size to try (default 16x the recipe's).
        loss_tolerance: Largest relative drift of the mean loss over the first batches from the fp32 eager
            reference's before a precision or compile candidate is rejected.
        min_gain: A candidate replaces the best so far only when faster by more than this share.
        settings: Trial length (warm-up batches, measured seconds).
        show: Print the live progress and the final table.

    Returns:
        The :class:`TuneResult`: every trial with its verdict, the baseline, the chosen candidate, speedup.
    """
    if (config is None) == (model is None):
        raise ValueError("tune needs either config= (a recipe YAML) or model= (with datamodule= and trainer_kwargs=)")
    seconds = parse_budget(budget)
    started = time.perf_counter()
    workdir = temporary_workdir()
    if config is not None:
        from lightning_accel.cli import build_cli

        config = Path(config)
        if not config.is_file():
            raise FileNotFoundError(f"recipe {str(config)!r} does not exist")
        cli = build_cli(["--config", str(config), *overrides], run=False)
        trainer, model, datamodule = cli.trainer, cli.model, cli.datamodule
        params = inspect.signature(type(datamodule).__init__).parameters
        knobs = data_knobs(datamodule, params)
        spec: dict[str, Any] = {"config": str(config), "overrides": list(overrides)}
        out = Path(out) if out is not None else Path("runs/tune") / config.stem / "tuned.yaml"
    else:
        from lightning.pytorch.utilities.model_helpers import is_overridden

        from lightning_accel.cli import AccelTrainer

        if datamodule is None and not is_overridden("train_dataloader", model):
            raise ValueError(
                "tune(model=...) needs datamodule= too (the data the model trains on), unless the model defines "
                "its own train_dataloader()"
            )
        trainer_kwargs = dict(trainer_kwargs or {})
        trainer = AccelTrainer(**trainer_kwargs)  # read for its precision, devices and limits only
        knobs = data_knobs(datamodule if datamodule is not None else model)  # where train_dataloader() lives
        pickle_objects(model, datamodule, trainer_kwargs, workdir / "objects.pkl")
        spec = {"objects": str(workdir / "objects.pkl")}
        out = Path(out) if out is not None else None
    spec["recipe_accumulate"] = trainer.accumulate_grad_batches
    # Multi-device trials start their ranks by re-running their command line: a new interpreter each.
    spec["fork"] = trainer.world_size == 1
    accelerator = "gpu" if trainer.accelerator.__class__.__name__ == "CUDAAccelerator" else "cpu"
    scope, mode = _compile_of(trainer)
    blocks = _block_names(model)
    baseline = Candidate(precision=str(trainer.precision), compile=scope, compile_mode=mode)  # type: ignore[arg-type]
    search = Search(
        spec,
        knobs,
        accelerator,
        has_blocks=bool(blocks),
        budget_s=seconds - (time.perf_counter() - started),
        planned=_planned_samples(trainer),
        settings=settings,
        loss_tolerance=loss_tolerance,
        min_gain=min_gain,
        keep_global_batch=keep_global_batch,
        max_batch=max_batch,
        workdir=workdir,
    )
    with _Progress(show, seconds, search) as on_trial:
        search.on_trial = on_trial
        result = search.run(baseline, baseline_is_reference=baseline.precision == "32-true" and scope == "off")
    result.elapsed_s = time.perf_counter() - started
    if show:
        print_report(result)
    if out is not None:
        write_json(result, out.with_suffix(".json"))
        plot(result, out.with_suffix(".png"))
        if config is not None:
            write_tuned_yaml(config, result, out, blocks)
            log.info("tuned recipe: %s (run it: lightning-accel fit --config %s)", out, out)
    return result


class _Progress:
    """A live bar over the budget (rich), one line per finished trial; a no-op when ``show`` is false."""

    def __init__(self, show: bool, budget_s: float, search: Search) -> None:
        self.show, self.budget_s, self.search = show, budget_s, search

    def __enter__(self) -> Any:
        if not self.show:
            return lambda trial: None
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(
            TextColumn("tune"),
            BarColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            console=wide_console(),
            transient=False,
        )
        self.task = self.bar.add_task("baseline", total=self.budget_s)
        self.bar.start()

        def on_trial(trial: Trial) -> None:
            self.bar.console.print(show_trial(trial), highlight=False, markup=False)
            elapsed = time.perf_counter() - self.search.start
            done = f"{len(self.search.trials)} trials"
            self.bar.update(self.task, completed=min(elapsed, self.budget_s), description=done)

        return on_trial

    def __exit__(self, *exc: Any) -> None:
        if self.show:
            self.bar.update(self.task, completed=self.budget_s)
            self.bar.stop()


class _CallableModule(types.ModuleType):
    """``lightning_accel.tune(...)`` calls :func:`tune`, and the package's other names stay reachable."""

    def __call__(self, *args: Any, **kwargs: Any) -> TuneResult:
        return tune(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
