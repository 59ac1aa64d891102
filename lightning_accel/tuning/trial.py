"""One tuning trial, the process side: the user's recipe (or pickled module and data) with one :class:`Candidate`.

The trial process (started by ``server.py``) trains ``warmup`` batches (compilation, allocator and worker
start-up), then measures for at least ``measure_s`` seconds, records the losses of the first batches for the
numerics guard, and writes one JSON :class:`TrialResult`.

    python -m lightning_accel.tuning SPEC.json RESULT.json      (see __main__.py)
"""

from __future__ import annotations

import json
import logging
import math
import pickle
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
from lightning.pytorch import Callback, seed_everything
from lightning.pytorch.callbacks import Checkpoint
from torch.utils.flop_counter import FlopCounterMode
from typing_extensions import override

from lightning_accel.blocks import find_blocks
from lightning_accel.compile import TorchCompile
from lightning_accel.float8 import Float8Training
from lightning_accel.logs import defer_to_root
from lightning_accel.monitor.batches import default_batch_size
from lightning_accel.monitor.peaks import peak_flops, precision_dtype
from lightning_accel.recipe import AccelTrainer, build_cli
from lightning_accel.strategies.activation_checkpointing import ActivationCheckpointing

__all__ = [
    "DATA_KNOBS",
    "OWN_FEATURES",
    "TrialProbe",
    "TrialResult",
    "TrialSettings",
    "data_knob_holders",
    "run_trial_process",
]

log = logging.getLogger(__name__)

# Loader knobs tune can set: each an attribute of the DataModule, or an entry of its hparams
# (save_hyperparameters()), that train_dataloader() reads.
DATA_KNOBS = ("batch_size", "num_workers", "pin_memory", "persistent_workers")


def data_knob_holders(owner: Any, knob: str) -> list[Any]:
    """Where ``owner`` (the DataModule, or a module with its own train_dataloader()) keeps ``knob``: the attribute
    and/or ``hparams`` entry, the places Lightning's BatchSizeFinder looks (its own lookup needs a module attached
    to a Trainer, so it cannot serve here)."""
    holders = [owner] if hasattr(owner, knob) else []
    hparams = getattr(owner, "hparams", None)
    if hparams is not None and knob in hparams:
        holders.append(hparams)  # an AttributeDict: setattr and getattr reach its entries
    return holders


@dataclass
class TrialSettings:
    """How long a trial trains: ``warmup`` batches unmeasured, then ``measure_s`` seconds (batch bounds apply)."""

    warmup: int = 5
    """Unmeasured batches first: compilation, allocator and loader-worker start-up."""
    measure_s: float = 3.0
    """Measured seconds per trial (at least ``min_batches``, at most ``max_batches`` batches)."""
    min_batches: int = 8
    """Fewest measured batches, however long they take."""
    max_batches: int = 400
    """Most measured batches, however short they are."""
    loss_batches: int = 8
    """First batches whose losses the numerics guard compares with the fp32 eager reference's."""


@dataclass
class TrialResult:
    """What one trial measured (``error`` set when it did not finish)."""

    samples_per_sec: float | None = None
    step_s: float | None = None
    batches_measured: int = 0
    losses: list[float] = field(default_factory=list)
    compile_s: float = 0.0
    peak_memory_mb: float | None = None
    memory_total_mb: float | None = None
    flops_per_batch: float | None = None
    peak_flops: float | None = None
    batches_per_epoch: int | None = None
    batch_size: int | None = None
    world_size: int = 1  # devices the trial trained on: samples/s and batch_size are per device
    wall_s: float = 0.0
    error: str | None = None
    oom: bool = False


class TrialProbe(Callback):
    """Times the measured batches, keeps the first losses, counts FLOPs of the first batch, samples memory."""

    def __init__(self, settings: TrialSettings, count_flops: bool) -> None:
        self.s, self.count_flops = settings, count_flops
        self.batches, self.samples, self.losses = 0, 0, []
        self.start: float | None = None
        self.elapsed: float | None = None
        self.flops: float | None = None
        self.peak_rss, self._counter, self._process = 0, None, psutil.Process()
        self.batch_size: int | None = None

    def _sync(self, pl_module: Any) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)

    @override
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.batches == 0 and self.count_flops:
            self._counter = FlopCounterMode(display=False)
            self._counter.__enter__()
        if self.batches == self.s.warmup:
            self._sync(pl_module)
            self.start = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self.flops, self._counter = float(self._counter.get_total_flops()) or None, None
        if self.batch_size is None:
            self.batch_size = default_batch_size(batch)
        if len(self.losses) < self.s.loss_batches:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            self.losses.append(float(loss.detach()) if loss is not None else math.nan)
        self.batches += 1
        self.peak_rss = max(self.peak_rss, self._process.memory_info().rss)
        if self.start is None:
            return
        self.samples += default_batch_size(batch)
        measured = self.batches - self.s.warmup
        done = measured >= self.s.min_batches and (
            time.perf_counter() - self.start >= self.s.measure_s or measured >= self.s.max_batches
        )
        # Under DDP every rank must stop at the same batch: any rank's clock decides for all.
        if trainer.world_size > 1:
            done = trainer.strategy.reduce_boolean_decision(done, all=False)
        if done:
            self._sync(pl_module)
            self.elapsed = time.perf_counter() - self.start
            trainer.should_stop = True


def _build(spec: dict[str, Any]) -> tuple[Any, Any, Any]:
    """The Trainer, module and DataModule of the spec, with the candidate's trainer-level settings applied."""
    cand, settings = spec["candidate"], TrialSettings(**spec["settings"])
    accumulate = cand.get("accumulate_grad_batches") or spec.get("recipe_accumulate") or 1
    cap = math.ceil((settings.warmup + settings.max_batches) / accumulate) + 1
    trainer_overrides: dict[str, Any] = {
        "max_steps": cap,
        "max_epochs": -1,
        "limit_val_batches": 0,
        "num_sanity_val_steps": 0,
        "logger": False,
        "enable_progress_bar": False,
        "default_root_dir": spec["root"],
    }
    if cand.get("precision"):
        trainer_overrides["precision"] = cand["precision"]
    if cand.get("accumulate_grad_batches"):
        trainer_overrides["accumulate_grad_batches"] = cand["accumulate_grad_batches"]
    if spec.get("config"):
        args = ["--config", spec["config"], *spec.get("overrides", [])]
        for key, value in trainer_overrides.items():
            args += [f"--trainer.{key}", json.dumps(value) if isinstance(value, bool) else str(value)]
        cli = build_cli(args, run=False)
        return cli.trainer, cli.model, cli.datamodule
    with open(spec["objects"], "rb") as f:
        model, datamodule, trainer_kwargs = pickle.load(f)
    seed_everything(spec.get("seed", 0), workers=True)
    return AccelTrainer(**{**trainer_kwargs, **trainer_overrides}), model, datamodule


def run_trial_process(spec_path: str, out_path: str) -> None:
    """Entry of the trial process: build, apply the candidate, train, write the :class:`TrialResult`."""
    logging.basicConfig(level=logging.WARNING)
    defer_to_root()  # a trial logs warnings only
    spec = json.loads(Path(spec_path).read_text())
    result, started = TrialResult(), time.perf_counter()
    rank = 0
    try:
        rank = _run(spec, result)
    except Exception as err:  # reported as the trial's verdict, with the type, not a traceback
        result.oom = isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()
        result.error = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300] if str(err).strip() else ''}"
    result.wall_s = time.perf_counter() - started
    if rank == 0:
        Path(out_path).write_text(json.dumps(asdict(result)))


# The callbacks a recipe may bring that tune measures like any candidate: (class, Candidate field, its argument).
OWN_FEATURES = (
    (ActivationCheckpointing, "activation_checkpointing", "policy"),
    (Float8Training, "float8", "recipe"),
)


def _apply_own_features(trainer: Any, cand: dict[str, Any]) -> None:
    """Activation checkpointing and fp8 as the candidate has them. The recipe's own callback stays as it is (its
    blocks, its skips) where the candidate keeps its setting (the baseline carries it), and goes where the candidate
    measures without it or with another setting."""
    for kind, knob, attr in OWN_FEATURES:
        wanted, own = cand.get(knob), [c for c in trainer.callbacks if isinstance(c, kind)]
        if own and getattr(own[0], attr) == wanted:
            continue
        trainer.callbacks[:] = [c for c in trainer.callbacks if not isinstance(c, kind)]
        if wanted:
            trainer.callbacks.append(kind(**{attr: wanted}))


def _run(spec: dict[str, Any], result: TrialResult) -> int:
    """Train the trial into ``result``; returns the global rank (only rank 0 writes the result)."""
    cand, settings = spec["candidate"], TrialSettings(**spec["settings"])
    trainer, model, datamodule = _build(spec)
    loader_owner = datamodule if datamodule is not None else model  # a module may define train_dataloader()
    for knob in DATA_KNOBS:
        if cand.get(knob) is not None:
            for holder in data_knob_holders(loader_owner, knob):  # all of them, as BatchSizeFinder does
                setattr(holder, knob, cand[knob])
    # Checkpoints are not part of what a trial measures; the recipe's compile, activation checkpointing and fp8
    # are the candidate's, unless the spec measures the recipe as it is ("as_is": a benchmark of a tuned recipe).
    drop = Checkpoint if spec.get("as_is") else (Checkpoint, TorchCompile)
    trainer.callbacks[:] = [c for c in trainer.callbacks if not isinstance(c, drop)]
    if cand.get("compile", "off") != "off":
        modules = None
        if cand["compile"] == "blocks":
            blocks = {id(m) for m in find_blocks(model)}  # the blocks only, not a head of their class
            modules = [name for name, m in model.named_modules() if name and id(m) in blocks]
        trainer.callbacks.append(TorchCompile(modules=modules, mode=cand.get("compile_mode"), fallback=False))
    if not spec.get("as_is"):
        _apply_own_features(trainer, cand)
    compiling = cand.get("compile", "off") != "off" or any(isinstance(c, TorchCompile) for c in trainer.callbacks)
    probe = TrialProbe(settings, count_flops=not compiling)
    trainer.callbacks.append(probe)
    trainer.fit(model, datamodule=datamodule)
    if probe.elapsed is None:
        raise RuntimeError(
            f"the run ended after {probe.batches} batches, before {settings.warmup} warm-up and "
            f"{settings.min_batches} measured ones (a short epoch limit or early stopping?)"
        )
    compiled = [c for c in trainer.callbacks if isinstance(c, TorchCompile)]
    result.compile_s = sum(sum(c.compile_time_s.values()) for c in compiled)
    measured = probe.batches - settings.warmup
    result.samples_per_sec = probe.samples / probe.elapsed
    result.step_s = probe.elapsed / measured
    result.batches_measured = measured
    result.losses = probe.losses
    result.flops_per_batch = probe.flops
    result.batch_size = probe.batch_size
    result.world_size = trainer.world_size
    per_epoch = trainer.num_training_batches
    result.batches_per_epoch = int(per_epoch) if math.isfinite(per_epoch) else None
    device = model.device
    result.peak_flops, _ = peak_flops(device, precision_dtype(str(trainer.precision)))
    if device.type == "cuda":
        result.peak_memory_mb = torch.cuda.max_memory_allocated(device) / 2**20
        result.memory_total_mb = torch.cuda.get_device_properties(device).total_memory / 2**20
    else:
        result.peak_memory_mb = probe.peak_rss / 2**20
        result.memory_total_mb = psutil.virtual_memory().total / 2**20
    return trainer.global_rank
