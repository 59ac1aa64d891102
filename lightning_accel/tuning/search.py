"""The budgeted search: stages of trials on the user's own model and data, each in a fresh process.

Order: the untuned recipe (the baseline), the fp32 eager reference if the baseline is not one, the loader,
precision x compile, the batch size, then a confirmation round of the winner beside the baseline. A
candidate replaces the best so far only when it is faster by more than ``min_gain``; compile time is
amortized over the recipe's planned samples; a candidate whose first losses drift from the fp32 eager
reference's by more than ``loss_tolerance`` is rejected. Nothing starts that the budget cannot finish.
"""

from __future__ import annotations

import logging
import math
import pickle
import shutil
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_accel.float8 import fp8_hardware
from lightning_accel.tuning.config import TuneConfig
from lightning_accel.tuning.server import run_trial, temporary_workdir
from lightning_accel.tuning.space import (
    Candidate,
    DataKnobs,
    activation_checkpointing_candidates,
    batch_candidates,
    float8_candidates,
    loader_candidates,
    precision_compile_candidates,
    without_own_candidates,
)
from lightning_accel.tuning.trial import DATA_KNOBS, TrialResult, data_knob_holders

__all__ = [
    "BATCH_STOP_NOISE",
    "FIRST_COMPILE_S",
    "RESERVE_S",
    "WALL_MARGIN",
    "Search",
    "Trial",
    "TuneResult",
    "data_knobs",
    "pickle_objects",
]

log = logging.getLogger(__name__)

RESERVE_S = 3.0  # kept back from the budget for the report
# Trial wall times vary from run to run: without a margin, a trial estimated to just fit is started and then
# stopped at the budget, and all it ran is wasted.
WALL_MARGIN = 1.1
# The least a first compiled trial is expected to add: a cold compile costs seconds (tens on a small CPU host) no
# matter how short the eager trials are, so an estimate scaled from them alone starts compile trials the budget
# then stops, leaving the later stages no time.
FIRST_COMPILE_S = 15.0
# The least drop of a larger batch, against the best so far, that ends the batch stage. Two runs of the baseline
# can agree by chance far more closely than the machine's real run-to-run spread, so the measured noise alone would
# let one slow reading end the stage before the batch sizes that are fastest.
BATCH_STOP_NOISE = 0.10


@dataclass
class Trial:
    """One measured (or skipped) candidate and what was decided about it."""

    stage: str
    candidate: Candidate
    result: TrialResult | None = None
    verdict: str = ""
    amortized_sps: float | None = None
    mfu: float | None = None
    repeats: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.result is not None and self.result.error is None and self.amortized_sps is not None

    @property
    def accepted(self) -> bool:
        """Measured and not rejected by the numerics guard: a candidate the final choice may fall on."""
        return self.ok and not self.verdict.startswith("rejected")

    def as_dict(self) -> dict[str, Any]:
        r = self.result
        return {
            "stage": self.stage,
            "candidate": self.candidate.as_dict(),
            "label": self.candidate.label(),
            "samples_per_sec": r.samples_per_sec if r else None,
            "amortized_samples_per_sec": self.amortized_sps,
            "mfu": self.mfu,
            "peak_memory_mb": r.peak_memory_mb if r else None,
            "compile_s": r.compile_s if r else None,
            "wall_s": r.wall_s if r else None,
            "first_losses": r.losses if r else [],
            "repeats_samples_per_sec": self.repeats,
            "verdict": self.verdict,
            "error": r.error if r else None,
        }


@dataclass
class TuneResult:
    """The search's outcome: every trial, the untuned baseline and the chosen candidate."""

    trials: list[Trial]
    baseline: Trial
    best: Trial
    budget_s: float
    elapsed_s: float
    planned_samples: float | None
    notes: list[str] = field(default_factory=list)
    noise: float = 0.0

    @property
    def speedup(self) -> float:
        """Chosen over untuned, amortized samples/s (confirmation round included)."""
        return (self.best.amortized_sps or 0.0) / (self.baseline.amortized_sps or math.inf)

    def as_dict(self) -> dict[str, Any]:
        return {
            "budget_s": self.budget_s,
            "elapsed_s": self.elapsed_s,
            "planned_samples": self.planned_samples,
            "run_to_run_noise": self.noise,
            "speedup_vs_untuned": self.speedup,
            "best": self.best.as_dict(),
            "baseline": self.baseline.as_dict(),
            "trials": [t.as_dict() for t in self.trials],
            "notes": self.notes,
        }


class Search:
    """Runs the stages within ``budget_s``; ``spec`` says how a trial builds the run (config or pickled objects)."""

    def __init__(
        self,
        spec: dict[str, Any],
        data: DataKnobs,
        accelerator: str,
        has_blocks: bool,
        budget_s: float,
        planned: Callable[[TrialResult], float | None],
        config: TuneConfig | None = None,
        on_trial: Callable[[Trial], None] | None = None,
        workdir: Path | None = None,
    ) -> None:
        self.spec, self.data, self.accelerator, self.has_blocks = spec, data, accelerator, has_blocks
        self.memory_bound = False  # the batch stage stopped at the memory limit (activation checkpointing may help)
        self.budget_s, self.planned = budget_s, planned
        self.config = config or TuneConfig()
        self.on_trial = on_trial or (lambda trial: None)
        self.workdir = workdir or temporary_workdir()
        self.trials: list[Trial] = []
        self.notes: list[str] = []
        self.start = time.perf_counter()
        self.planned_samples: float | None = None
        self.reference: Trial | None = None
        self.noise = 0.0  # relative difference of two runs of the baseline: smaller gains are not trusted

    # -- budget -------------------------------------------------------------------------------------
    def seconds_left(self) -> float:
        """Budget seconds a trial may still use (the report's reserve kept back)."""
        return self.budget_s - (time.perf_counter() - self.start) - RESERVE_S

    def estimate(self, candidate: Candidate) -> float:
        """Seconds a trial will take, with ``WALL_MARGIN`` on top: a candidate run before, its own last run; a
        compiled one, the slowest compiled trial so far; an eager one, the median eager trial or the latest,
        whichever is longer (a larger batch's warm-up takes longer); with none like it yet, the median trial
        (for compiling, five times that and at least ``FIRST_COMPILE_S`` more)."""
        own = [t.result.wall_s for t in self.trials if t.ok and t.candidate == candidate]
        if own:
            return own[-1] * WALL_MARGIN
        walls = [t.result.wall_s for t in self.trials if t.ok]
        compiled = candidate.compile != "off"
        like = [t.result.wall_s for t in self.trials if t.ok and (t.candidate.compile != "off") == compiled]
        if like:  # compile times differ by scope: the slowest; eager trials: the typical one or the latest
            return (max(like) if compiled else max(statistics.median(like), like[-1])) * WALL_MARGIN
        if not walls:
            return 0.0
        typical = statistics.median(walls)
        # Compiling, a guess until one is measured: a cold compile costs seconds whatever the trial's length.
        return (max(5.0 * typical, typical + FIRST_COMPILE_S) if compiled else typical) * WALL_MARGIN

    # -- one trial ----------------------------------------------------------------------------------
    def measure(self, stage: str, candidate: Candidate, keep_s: float = 0.0) -> Trial:
        """Run ``candidate`` unless the budget, less ``keep_s`` held for later stages, cannot finish it."""
        trial = Trial(stage, candidate)
        need, left = self.estimate(candidate), self.seconds_left() - keep_s
        if left <= 0 or need > left:
            kept = f" ({keep_s:.0f}s more kept for the later stages)" if keep_s else ""
            trial.verdict = f"skipped: {max(left, 0):.0f}s of budget to spend{kept}, a trial like it takes ~{need:.0f}s"
            self.trials.append(trial)
            return trial
        spec = {**self.spec, "candidate": candidate.as_dict(), "settings": vars(self.config.settings)}
        folder = self.workdir / f"trial_{len(self.trials):02d}"
        trial.result = run_trial(spec, timeout_s=left, workdir=folder)
        shutil.rmtree(folder / "root", ignore_errors=True)
        r = trial.result
        if r.error is not None:
            trial.verdict = ("out of memory: " if r.oom else "failed: ") + r.error
        else:
            if self.planned_samples is None:
                self.planned_samples = self.planned(r)
            trial.amortized_sps = self.amortize(r.samples_per_sec or 0.0, r.compile_s)
            trial.repeats.append(r.samples_per_sec or 0.0)
            if r.flops_per_batch and r.peak_flops and r.batch_size:
                trial.mfu = r.flops_per_batch / r.batch_size * (r.samples_per_sec or 0.0) / r.peak_flops
        self.trials.append(trial)
        return trial

    def amortize(self, samples_per_sec: float, compile_s: float) -> float:
        if not self.planned_samples or samples_per_sec <= 0:
            return samples_per_sec
        return self.planned_samples / (compile_s + self.planned_samples / samples_per_sec)

    def numerics_rejection(self, trial: Trial) -> str | None:
        """Why the candidate's numerics are rejected against the fp32 eager reference (``None``: accepted)."""
        assert trial.result is not None
        losses = trial.result.losses
        if not losses or not all(math.isfinite(x) for x in losses):
            return f"rejected: non-finite loss in the first batches {losses[:4]}"
        ref = self.reference
        if ref is None or ref is trial or ref.result is None or not ref.result.losses:
            return None
        same_batches = (trial.candidate.batch_size, trial.candidate.accumulate_grad_batches) == (
            ref.candidate.batch_size,
            ref.candidate.accumulate_grad_batches,
        )
        if not same_batches:
            return None  # other batches give other losses; its precision and compile were checked before
        n = min(len(losses), len(ref.result.losses))
        mine, theirs = statistics.fmean(losses[:n]), statistics.fmean(ref.result.losses[:n])
        drift = abs(mine - theirs) / max(abs(theirs), 1e-12)
        if drift > self.config.loss_tolerance:
            return (
                f"rejected: mean loss of the first {n} batches {mine:.4g} vs fp32 eager {theirs:.4g} "
                f"(drift {drift:.1%} > {self.config.loss_tolerance:.0%})"
            )
        return None

    # -- stages -------------------------------------------------------------------------------------
    def stage(self, name: str, candidates: Iterable[Candidate], best: Trial, keep_trials: int = 0) -> Trial:
        """Try ``candidates`` from ``best``, holding back the time of ``keep_trials`` eager trials for later."""
        seen = {t.candidate for t in self.trials if t.result is not None}
        for candidate in candidates:
            if candidate in seen:
                continue
            seen.add(candidate)
            trial = self.measure(name, candidate, keep_s=keep_trials * self.estimate(Candidate()))
            if trial.result is None:  # skipped for the budget: a cheaper candidate may still fit
                self.on_trial(trial)
                continue
            if trial.result.error is not None:
                self.on_trial(trial)
                if name == "batch":
                    self.memory_bound = self.memory_bound or bool(trial.result.oom)
                    break  # a larger batch will not fit either
                continue
            rejected = self.numerics_rejection(trial)
            if not rejected and self.is_close_call(trial, best):
                self.rerun(trial)  # inside the run-to-run noise: one more run of each before deciding
                self.rerun(best)
            if rejected:
                trial.verdict = rejected
            elif self.faster(trial, best):
                trial.verdict = f"faster: {trial.amortized_sps / best.amortized_sps:.2f}x the best so far"
                best = trial
            else:
                ratio = trial.amortized_sps / best.amortized_sps
                trial.verdict = f"not faster: {ratio:.2f}x the best so far"
                if name == "batch" and ratio < 1 - max(self.noise, BATCH_STOP_NOISE):
                    self.on_trial(trial)
                    break  # throughput has stopped growing with the batch (by more than the noise)
            if name == "batch" and self.near_memory_limit(trial):
                self.memory_bound = True
                trial.verdict += "; memory near the limit, no larger batch"
                self.on_trial(trial)
                break
            self.on_trial(trial)
        return best

    def faster(self, trial: Trial, than: Trial) -> bool:
        return (trial.amortized_sps or 0) > (than.amortized_sps or 0) * (1 + self.config.min_gain)

    def is_close_call(self, trial: Trial, best: Trial) -> bool:
        """Within the measured noise of the best so far, and the budget allows a run of each again."""
        if not self.noise or not trial.amortized_sps or not best.amortized_sps:
            return False
        ratio = trial.amortized_sps / best.amortized_sps
        cost = self.estimate(trial.candidate) + self.estimate(best.candidate)
        return abs(ratio - 1) <= self.noise and ratio > 1 - self.noise / 2 and self.seconds_left() > 2 * cost

    def near_memory_limit(self, trial: Trial) -> bool:
        r = trial.result
        if r is None or r.peak_memory_mb is None or not r.memory_total_mb:
            return False
        # doubling the batch roughly doubles activations; keep 10% headroom
        return 2 * r.peak_memory_mb > 0.9 * r.memory_total_mb

    def measure_noise(self, baseline: Trial) -> None:
        """Run the baseline a second time: how far two runs of the same settings differ on this machine."""
        if self.seconds_left() < 8 * self.estimate(baseline.candidate):
            self.notes.append("the budget is too short to measure run-to-run noise: changes need min_gain only")
            return
        self.rerun(baseline)
        if len(baseline.repeats) == 2:
            a, b = baseline.repeats
            self.noise = abs(a - b) / statistics.fmean(baseline.repeats)
            self.notes.append(
                f"two runs of the untuned recipe differ by {self.noise:.1%}: a candidate within that of the best "
                "so far was run again beside it before deciding"
            )

    def rerun(self, trial: Trial) -> None:
        """Measure ``trial``'s candidate once more; its samples/s becomes the mean of its runs."""
        spec = {**self.spec, "candidate": trial.candidate.as_dict(), "settings": vars(self.config.settings)}
        folder = self.workdir / f"rerun_{len(trial.repeats)}_{trial.stage}"
        r = run_trial(spec, timeout_s=self.seconds_left(), workdir=folder)
        shutil.rmtree(folder / "root", ignore_errors=True)
        if r.error is None and r.samples_per_sec:
            trial.repeats.append(r.samples_per_sec)
            compile_s = trial.result.compile_s if trial.result else 0.0
            trial.amortized_sps = self.amortize(statistics.fmean(trial.repeats), compile_s)

    def confirm(self, baseline: Trial, best: Trial, rounds: int = 3) -> None:
        """Measure the winner and the baseline again, alternating, up to ``rounds`` more times each as the budget
        allows, so one noisy run cannot decide; each one's samples/s becomes the mean of its runs."""
        for round_ in range(rounds):
            for trial in (best, baseline):
                if self.seconds_left() < self.estimate(trial.candidate):
                    if round_ == 0:
                        self.notes.append("no budget left to confirm the choice: it rests on one run of each")
                    return
                self.rerun(trial)

    def settle(self, best: Trial) -> Trial:
        """The final choice by every run so far: the fastest accepted trial unless within ``min_gain`` of the pick.

        A challenger that rests on fewer runs than the confirmed pick is run again, as the budget allows, until
        it rests on as many: one lucky run must not displace a mean of several (it did, before this).
        """
        while True:
            accepted = [t for t in self.trials if t.accepted]
            fastest = max(accepted, key=lambda t: t.amortized_sps or 0.0)
            if fastest is best or not self.faster(fastest, best):
                return best
            if len(fastest.repeats) < len(best.repeats) and self.seconds_left() >= self.estimate(fastest.candidate):
                runs = len(fastest.repeats)
                self.rerun(fastest)
                if len(fastest.repeats) > runs:
                    continue
            self.notes.append(
                f"{fastest.candidate.label()} ended faster than {best.candidate.label()} by more than "
                f"{self.config.min_gain:.0%} over all runs ({len(fastest.repeats)} vs {len(best.repeats)}): "
                "chosen instead"
            )
            best.verdict = (
                f"not chosen: {best.amortized_sps or 0:.1f} samples/s over {len(best.repeats)} runs, "
                f"{(best.amortized_sps or 0) / (fastest.amortized_sps or math.inf):.2f}x the chosen"
            )
            best = fastest

    def batch_stages(self, best: Trial) -> Trial:
        """Larger batches; then, where memory stopped them, activation checkpointing for the next one."""
        if self.data.has("batch_size"):
            base_batch = int(self.data.values["batch_size"])
            limit = self.config.max_batch or base_batch * 16
            accumulate = int(self.spec.get("recipe_accumulate") or 1)
            keep = self.config.keep_global_batch
            larger = batch_candidates(best.candidate, base_batch, keep, limit, accumulate)
            best = self.stage("batch", larger, best, keep_trials=2)
            if self.memory_bound and self.has_blocks:  # memory, not speed, stopped the batch: trade recompute for it
                more = activation_checkpointing_candidates(best.candidate, base_batch, keep, limit, accumulate)
                best = self.stage("activation checkpointing", more, best, keep_trials=2)
            else:
                self.notes.append(
                    "activation checkpointing not tried: "
                    + (
                        "the model has no repeated blocks to wrap"
                        if not self.has_blocks
                        else "memory did not limit the batch size (it recomputes activations to save memory, so "
                        "it pays only where memory is what stops a larger batch)"
                    )
                )
        else:
            self.notes.append(
                "the loader's owner (the DataModule, or the module with its own train_dataloader()) has no batch_size "
                "attribute or hparam: the batch size was not tuned (nor activation checkpointing, which buys a "
                "larger batch)"
            )
        return best

    def run(self, baseline_candidate: Candidate, baseline_is_reference: bool) -> TuneResult:
        baseline = self.measure("baseline", baseline_candidate)
        if not baseline.ok:
            self.on_trial(baseline)
            reason = baseline.verdict or "did not run"
            raise RuntimeError(f"the untuned recipe itself does not train, so nothing can be tuned: {reason}")
        baseline.verdict = "untuned recipe"
        self.on_trial(baseline)
        self.measure_noise(baseline)
        if baseline_is_reference:
            self.reference = baseline
        else:
            fp32_eager = baseline_candidate.with_(precision="32-true", compile="off", float8=None)
            ref = self.measure("reference", fp32_eager)
            ref.verdict = "fp32 eager: the numerics reference" if ref.ok else ref.verdict
            self.reference = ref if ref.ok else None
            self.on_trial(ref)
        best = baseline
        # Earlier stages leave time for the batch stage (about three doublings) and the confirmation round.
        if self.data.has("num_workers"):
            loader = loader_candidates(best.candidate, self.data, self.accelerator)
            best = self.stage("loader", loader, best, keep_trials=6)
        else:
            self.notes.append(
                "loader not tuned: the loader's owner has no num_workers attribute or hparam to set (pin_memory and "
                "persistent_workers go with it)"
            )
        options = precision_compile_candidates(best.candidate, self.accelerator, self.has_blocks)
        best = self.stage("precision x compile", options, best, keep_trials=5)
        # the recipe's own activation checkpointing and fp8 cost time: measured without them, kept only if they pay
        own = without_own_candidates(baseline.candidate, best.candidate, self.accelerator)
        best = self.stage("the recipe's own", own, best, keep_trials=3)
        missing = fp8_hardware() if self.accelerator == "gpu" else "not a GPU run"
        if missing:
            self.notes.append(f"fp8 not tried: {missing}")
        best = self.stage("fp8", float8_candidates(best.candidate, self.accelerator), best, keep_trials=2)
        best = self.batch_stages(best)
        if best is not baseline:
            self.confirm(baseline, best)
        best = self.settle(best)
        if best is not baseline and (best.amortized_sps or 0) <= (baseline.amortized_sps or 0):
            self.notes.append(
                f"{best.candidate.label()} was not faster than the untuned recipe over all runs: keeping the recipe"
            )
            best = baseline
        best.verdict = "chosen" if best is not baseline else "chosen: the untuned recipe is the fastest"
        return TuneResult(
            trials=self.trials,
            baseline=baseline,
            best=best,
            budget_s=self.budget_s,
            elapsed_s=time.perf_counter() - self.start,
            planned_samples=self.planned_samples,
            notes=self.notes,
            noise=self.noise,
        )


def data_knobs(datamodule: Any, init_params: Iterable[str] | None = None) -> DataKnobs:
    """The loader knobs ``datamodule`` (or a module with its own train_dataloader()) keeps as attributes or hparams
    (for recipes, only ``__init__`` parameters)."""
    allowed = set(init_params) if init_params is not None else None
    values = {}
    for knob in DATA_KNOBS:
        holders = data_knob_holders(datamodule, knob)
        if holders and (allowed is None or knob in allowed):
            values[knob] = getattr(holders[0], knob)
    return DataKnobs(values)


def pickle_objects(model: Any, datamodule: Any, trainer_kwargs: dict[str, Any], path: Path) -> None:
    """Freeze the untrained module, the data and the Trainer arguments, so every trial starts from the same state."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(path, "wb") as f:
            pickle.dump((model, datamodule, trainer_kwargs), f)
    except (pickle.PicklingError, AttributeError, TypeError) as err:
        raise TypeError(
            f"tune runs every trial in a fresh process and needs to pickle the module, DataModule and Trainer "
            f"arguments: {err}. Define them at module level (not inside a function), or tune a recipe instead"
        ) from err
