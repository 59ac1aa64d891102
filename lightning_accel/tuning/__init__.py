"""Measure, don't guess: tune precision, compile, the loader and the batch size on the user's own model.

    lightning-accel tune --config recipe.yaml [--budget 5m] [--out tuned.yaml]

or, from code, ``lightning_accel.tune(model=..., datamodule=..., trainer_kwargs=...)``: :func:`tune`, a plain
function, which the top-level package imports on first use (so ``import lightning_accel`` does not import
LightningCLI and the trial server). The search's pieces live here, under ``lightning_accel.tuning``. See docs/tune.md.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.utilities.model_helpers import is_overridden
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from lightning_accel.blocks import find_blocks
from lightning_accel.compile import TorchCompile
from lightning_accel.monitor.summary import wide_console
from lightning_accel.recipe import AccelTrainer, build_cli
from lightning_accel.tuning.config import TuneConfig, parse_budget
from lightning_accel.tuning.report import plot, print_report, trial_line, write_json, write_tuned_yaml
from lightning_accel.tuning.search import Search, Trial, TuneResult, data_knobs, pickle_objects
from lightning_accel.tuning.server import temporary_workdir
from lightning_accel.tuning.space import Candidate
from lightning_accel.tuning.trial import OWN_FEATURES, TrialResult, TrialSettings

__all__ = ["Candidate", "TrialSettings", "TuneConfig", "TuneResult", "parse_budget", "tune"]

log = logging.getLogger(__name__)


def _compile_of(trainer: Any) -> tuple[str, str | None]:
    found = [c for c in trainer.callbacks if isinstance(c, TorchCompile)]
    if not found:
        return "off", None
    return ("module" if found[0].modules is None else "blocks"), found[0].compile_kwargs.get("mode")


def _own_features(trainer: Any) -> dict[str, str]:
    """The recipe's own activation checkpointing policy and fp8 recipe, as candidate fields (measured, not kept)."""
    return {
        knob: getattr(c, attr) for c in trainer.callbacks for kind, knob, attr in OWN_FEATURES if isinstance(c, kind)
    }


def _block_names(model: Any) -> list[str]:
    blocks = {id(m) for m in find_blocks(model)}  # the blocks only, not a head of their class
    return [name for name, m in model.named_modules() if name and id(m) in blocks]


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
    options: TuneConfig | None = None,
    show: bool = True,
    **fields: Any,
) -> TuneResult:
    """Try precision, compile, loader and batch settings on this model and data, each trial in a fresh process.

    Args:
        config: A recipe YAML (as for ``lightning-accel fit``); ``overrides`` are extra CLI arguments for it.
        model / datamodule / trainer_kwargs: Instead of a recipe: untrained objects (picklable, defined at
            module level) and the ``Trainer`` arguments of the run to tune; ``datamodule=None`` for a model
            with its own ``train_dataloader()`` (its loader knobs are then the model's).
        options: How the search runs (:class:`TuneConfig`: budget, out, keep_global_batch, max_batch,
            loss_tolerance, min_gain, settings); or pass those as keywords (``budget="90s"``, ``max_batch=256``).
        show: Print the live progress and the final table.

    Returns:
        The :class:`TuneResult`: every trial with its verdict, the baseline, the chosen candidate, speedup.
    """
    if (config is None) == (model is None):
        raise ValueError("tune needs either config= (a recipe YAML) or model= (with datamodule= and trainer_kwargs=)")
    if options is not None and fields:
        raise TypeError(f"tune() takes options= or TuneConfig keywords, not both (got options and {sorted(fields)})")
    options = options or TuneConfig.from_options(**fields)
    started = time.perf_counter()
    workdir = temporary_workdir()
    out = options.out
    if config is not None:
        config = Path(config)
        if not config.is_file():
            raise FileNotFoundError(f"recipe {str(config)!r} does not exist")
        cli = build_cli(["--config", str(config), *overrides], run=False)
        trainer, model, datamodule = cli.trainer, cli.model, cli.datamodule
        params = inspect.signature(type(datamodule).__init__).parameters
        knobs = data_knobs(datamodule, params)
        spec: dict[str, Any] = {"config": str(config), "overrides": list(overrides)}
        out = out if out is not None else Path("runs/tune") / config.stem / "tuned.yaml"
    else:
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
    spec["recipe_accumulate"] = trainer.accumulate_grad_batches
    # Multi-device trials start their ranks by re-running their command line: a new interpreter each.
    spec["fork"] = trainer.world_size == 1
    accelerator = "gpu" if isinstance(trainer.accelerator, CUDAAccelerator) else "cpu"
    scope, mode = _compile_of(trainer)
    blocks = _block_names(model)
    baseline = Candidate(precision=str(trainer.precision), compile=scope, compile_mode=mode, **_own_features(trainer))  # type: ignore[arg-type]
    search = Search(
        spec,
        knobs,
        accelerator,
        has_blocks=bool(blocks),
        budget_s=options.budget_s - (time.perf_counter() - started),
        planned=_planned_samples(trainer),
        config=options,
        workdir=workdir,
    )
    with _Progress(show, options.budget_s, search) as on_trial:
        search.on_trial = on_trial
        reference = baseline.precision == "32-true" and scope == "off" and not baseline.float8
        result = search.run(baseline, baseline_is_reference=reference)
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
        self.bar = Progress(
            TextColumn("tune"),
            BarColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            console=wide_console(stderr=True),
            transient=False,
        )
        self.task = self.bar.add_task("baseline", total=self.budget_s)
        self.bar.start()

        def on_trial(trial: Trial) -> None:
            self.bar.console.print(trial_line(trial), highlight=False, markup=False)
            elapsed = time.perf_counter() - self.search.start
            done = f"{len(self.search.trials)} trials"
            self.bar.update(self.task, completed=min(elapsed, self.budget_s), description=done)

        return on_trial

    def __exit__(self, *exc: Any) -> None:
        if self.show:
            self.bar.update(self.task, completed=self.budget_s)
            self.bar.stop()
