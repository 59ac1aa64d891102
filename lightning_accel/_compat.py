"""Every Lightning private name lightning-accel relies on, and nowhere else (and one of torch's, one of DeepSpeed's).

Lightning has no public API for these. Each is imported or read here only, and ``tests/test_compat.py`` checks each
against the installed version, so an upgrade that renames or changes one fails that test by name, not a run later.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, get_args

import torch
import torch._dynamo.utils  # (lightning.pytorch imports it anyway)
import torch.distributed as dist
from lightning.fabric.connector import _PRECISION_INPUT, _PRECISION_INPUT_STR, _PRECISION_INPUT_STR_ALIAS_CONVERSION
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, Strategy
from lightning.pytorch.strategies.model_parallel import _materialize_distributed_module
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE

# torch's activation-checkpoint wrappers (FSDP's own), in a private module: re-exported for strategies/
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl as CheckpointImpl,
)
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointWrapper as CheckpointWrapper,
)
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing as apply_activation_checkpointing,
)
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper as checkpoint_wrapper,
)
from torch.distributed.constants import default_pg_timeout
from torch.utils._python_dispatch import _get_current_dispatch_mode
from typing_extensions import override

__all__ = [
    "FIT_LOOP_BATCH_PROGRESS",
    "LIGHTNING_MODULE_ACTION_PREFIX",
    "MODEL_PARALLEL_SETUP_DIGEST",
    "NEWEST_TORCH_CHECKED",
    "PRECISION_ALIASES",
    "PRECISION_STRINGS",
    "RICH_AVAILABLE",
    "SAVE_CHECKPOINT_ACTION",
    "SHARED_RENDEZVOUS_STORE_LOSES_JOINERS",
    "STRATEGY_ACTION_PREFIX",
    "TRAINING_BATCH_ACTION",
    "TRAIN_FETCH_ACTION",
    "PrecisionInput",
    "StepsProgressBar",
    "ddp_kwargs",
    "deepspeed_loads_universal",
    "default_store",
    "dispatch_mode_active",
    "dynamo_counters",
    "graph_break",
    "is_last_batch",
    "log_current_train_batch",
    "materialize_distributed_module",
    "merge_epoch_results",
    "nccl_flight_recorder_dump",
    "optimizers_to_device",
    "process_group_timeout",
    "quiet_known_deprecations",
    "rescale_train_batches",
    "run_due_validation",
    "running_epoch_results",
    "saves_distributed_checkpoint",
    "set_data_parallel_size",
    "set_handler_after_fit",
    "set_train_batches_done",
    "stop_progress_bar",
    "train_batches_in_checkpoint",
    "validation_due_after_this_batch",
    "wrap_validation_runs",
]

# Whether Lightning's default progress bar is its RichProgressBar (rich installed, as it is with our dependencies).
RICH_AVAILABLE = bool(_RICH_AVAILABLE)

# The type of ``Trainer(precision=...)``: our CLI's Trainer accepts the same values (plus "auto-mixed").
PrecisionInput = _PRECISION_INPUT
# The precision strings Lightning accepts, and its short aliases ("bf16" -> "bf16-mixed").
PRECISION_STRINGS: tuple[str, ...] = get_args(_PRECISION_INPUT_STR)
PRECISION_ALIASES: dict[str, str] = dict(_PRECISION_INPUT_STR_ALIAS_CONVERSION)

# Moves meta-device parameters to real memory and runs ``reset_parameters`` (ModelParallelStrategy.setup).
materialize_distributed_module = _materialize_distributed_module
# Moves optimizer state to a device (ModelParallelStrategy.setup, after the optimizers are created).
optimizers_to_device = _optimizers_to_device

# sha256 of ``inspect.getsource(ModelParallelStrategy.setup)`` (first 16 hex digits) that
# ``AccelFSDPStrategy.setup`` mirrors. A Lightning release that changes that method fails
# tests/test_compat.py: compare the two and update ours before updating this digest.
MODEL_PARALLEL_SETUP_DIGEST = "fdf402066d49c198"

# -- torch behaviour we work around ----------------------------------------------------------------------------------
# Each flag says whether this torch has a flaw we work around: the versions it was seen on, and the first version
# assumed fixed. None is fixed in a torch we support yet (up to NEWEST_TORCH_CHECKED), so each bound is the next minor
# release: tests/test_compat.py fails once torch reaches it, and the workaround is then checked again, not carried on.
NEWEST_TORCH_CHECKED = "2.14.1"
# torchrun's shared rendezvous store (the default since 2.4) gives a node that joins a running elastic job no address
# for the workers' store: the nodes already there never publish it again, so the join times out. Seen on 2.13.0.
SHARED_RENDEZVOUS_STORE_LOSES_JOINERS = torch.torch_version.TorchVersion(torch.__version__) < "2.15"


def quiet_known_deprecations() -> None:
    """Silence deprecation warnings our dependencies raise at each other, which nothing on the user's side fixes:
    Lightning 2.6's own ``_pytree`` still builds torch's ``LeafSpec``, deprecated in torch 2.13 (a FutureWarning at
    every fit). For our CLI's output; tests/test_compat.py fails once torch stops raising it, so this goes then."""
    warnings.filterwarnings(
        "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
    )


@contextmanager
def deepspeed_loads_universal(engine: Any) -> Iterator[None]:
    """A DeepSpeed engine reads its universal checkpoint in this block (``"checkpoint": {"load_universal": true}``).

    DeepSpeed reads the flag from its config object at every ``load_checkpoint``, and has no setter: the engine was
    built before anyone knew the checkpoint came from another world size.
    """
    config = engine._config
    before = config.load_universal_checkpoint
    config.load_universal_checkpoint = True
    try:
        yield
    finally:
        config.load_universal_checkpoint = before


def set_data_parallel_size(strategy: ModelParallelStrategy, size: int) -> None:
    """Fix the data-parallel mesh size (the constructor only takes ``"auto"``: one shard per node)."""
    strategy._data_parallel_size = size


def saves_distributed_checkpoint(strategy: Strategy) -> bool:
    """Whether ``strategy`` writes a sharded checkpoint folder instead of one file (FSDP, ModelParallel)."""
    return bool(getattr(strategy, "_save_distributed_checkpoint", False))


def is_last_batch(trainer: Trainer) -> bool:
    """Whether the batch the fit loop is on is its epoch's last (Lightning's private loop classes)."""
    return bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)


def process_group_timeout(strategy: Strategy) -> timedelta:
    """The collective timeout a DDP / ModelParallel strategy passes to ``init_process_group``."""
    return getattr(strategy, "_timeout", None) or default_pg_timeout


def ddp_kwargs(strategy: DDPStrategy) -> dict[str, Any]:
    """The keyword arguments ``strategy`` passes to ``DistributedDataParallel`` (read by our preset tests)."""
    return dict(strategy._ddp_kwargs)


# Lightning's profiler action names the goodput ledger charges (``Trainer.profiler.start/stop``). The loop's
# class name is private and part of the fetch action's name; the others are documented profiler output.
TRAIN_FETCH_ACTION = "[_TrainingEpochLoop].train_dataloader_next"
TRAINING_BATCH_ACTION = "run_training_batch"
SAVE_CHECKPOINT_ACTION = "save_checkpoint"
STRATEGY_ACTION_PREFIX = "[Strategy]"  # + "<StrategyClass>.batch_to_device" / ".training_step"
LIGHTNING_MODULE_ACTION_PREFIX = "[LightningModule]"  # + "<ModuleClass>.optimizer_step" (a module hook)


def dispatch_mode_active() -> bool:
    """Whether a TorchDispatchMode (e.g. a ``FlopCounterMode`` counting a batch) is active: a compiled function
    first called under one is skipped by dynamo for good and runs eagerly from then on (torch has no public
    way to ask)."""
    return _get_current_dispatch_mode() is not None


def wrap_validation_runs(trainer: Trainer, enter: Callable[[], None], leave: Callable[[], None]) -> Callable[[], None]:
    """Call ``enter`` before and ``leave`` after every run of the fit loop's validation loop, all of it (loader
    set-up, worker start, steps, hooks: no profiler action or hook spans that); returns the undo.

    Replaces ``run`` on this loop instance only (Lightning's private loop attributes, ``fit_loop.epoch_loop``).
    """
    loop = trainer.fit_loop.epoch_loop.val_loop
    original = loop.run

    def run_validation() -> Any:
        enter()
        try:
            return original()
        finally:
            leave()

    loop.run = run_validation

    def undo() -> None:
        loop.__dict__.pop("run", None)

    return undo


def log_current_train_batch(trainer: Trainer) -> None:
    """Hand the current training batch's logged values to the loggers now, as the fit loop does right after the
    ``on_train_batch_end`` hooks: for a batch after which the fit stops inside that hook (a preemption)."""
    connector = trainer._logger_connector
    connector.on_batch_end()
    connector.update_train_step_metrics()


def set_handler_after_fit(trainer: Trainer, signum: int, handler: Any) -> None:
    """The handler Lightning's signal connector puts back for ``signum`` at the end of the fit (in the Trainer's
    teardown, before ``on_fit_end`` and the teardown hooks run); Lightning records the one found when the fit
    started."""
    connector = trainer._signal_connector
    if signum in connector._original_handlers:
        connector._original_handlers[signum] = handler


# The training epoch's running aggregates of ``self.log(..., on_epoch=True)`` values: Lightning keeps them in the fit
# loop's private result collection and does not save them in checkpoints.
_REDUCTIONS = ("mean", "sum", "max", "min")


def running_epoch_results(trainer: Trainer) -> dict[str, dict[str, Any]]:
    """Each tensor value logged with ``on_epoch=True`` in this training epoch so far: its reduction, its running
    value and (for a mean) the batch size it has summed over. Values logged as a torchmetrics ``Metric`` are left
    out: their state is the metric's own."""
    saved: dict[str, dict[str, Any]] = {}
    for key, result in trainer.fit_loop.epoch_loop._results.items():
        meta = result.meta
        if not (result.is_tensor and meta.on_epoch and result.update_called):
            continue
        reduction = next((r for r in _REDUCTIONS if getattr(meta, f"is_{r}_reduction")), None)
        if reduction is None:
            continue  # a custom reduce_fx: cannot be merged
        entry = {"reduction": reduction, "value": result.value.detach().clone()}
        if reduction == "mean":
            entry["cumulated_batch_size"] = result.cumulated_batch_size.detach().clone()
        saved[key] = entry
    return saved


def merge_epoch_results(trainer: Trainer, saved: dict[str, dict[str, Any]]) -> list[str]:
    """Fold ``saved`` (:func:`running_epoch_results` of the interrupted attempt) into this epoch's running values,
    for the keys logged again by now; returns the keys merged."""
    results = trainer.fit_loop.epoch_loop._results
    merged = []
    for key, entry in saved.items():
        result = results.get(key)
        if result is None or not result.update_called:
            continue
        value = entry["value"].to(result.value.device, result.value.dtype)
        if entry["reduction"] in ("mean", "sum"):
            result.value = result.value + value
        else:
            result.value = result.meta.reduce_fx(result.value, value)
        if entry["reduction"] == "mean":
            result.cumulated_batch_size = result.cumulated_batch_size + entry["cumulated_batch_size"].to(
                result.cumulated_batch_size.device
            )
        merged.append(key)
    return merged


def validation_due_after_this_batch(trainer: Trainer) -> bool:
    """Whether the fit loop will run validation right after the training batch it is on (its own decision, made
    after the ``on_train_batch_end`` hooks; ask it from there)."""
    return bool(trainer.fit_loop.epoch_loop._should_check_val_fx(trainer.fit_loop._data_fetcher))


def run_due_validation(trainer: Trainer) -> None:
    """Run the validation that was due right after the batch a checkpoint was saved at, as the training epoch loop
    runs it there (its ``on_advance_end``): the validation loop, then the step-interval ``ReduceLROnPlateau``
    schedulers that follow it. Call it from ``on_train_start`` of the resumed fit."""
    loop = trainer.fit_loop.epoch_loop
    loop.val_loop.restarting = False  # a fresh validation run, not the finish of one the checkpoint was saved in
    trainer.validating = True
    first_loop_iter = trainer._logger_connector._first_loop_iter
    loop.val_loop.run()
    trainer.training = True
    trainer._logger_connector._first_loop_iter = first_loop_iter
    loop.update_lr_schedulers("step", update_plateau_schedulers=True)


def stop_progress_bar(trainer: Trainer) -> None:
    """Draw the rich progress bar's last frame now (Lightning does at teardown, after every callback's on_fit_end):
    a summary printed next comes after the bar, not above it. Stopping twice is harmless."""
    bar = trainer.progress_bar_callback
    if isinstance(bar, RichProgressBar):
        bar._stop_progress()


class StepsProgressBar(RichProgressBar):
    """Lightning's default ``RichProgressBar``, for a run bounded by ``max_steps``: its description reads "Epoch 0"
    instead of "Epoch 0/-2" (Lightning writes ``max_epochs - 1`` and a step-bounded run has ``max_epochs=-1``), and
    the numbers beside the bar start with ``step 60/120``. It overrides a private method of the bar."""

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs is None or self.trainer.max_epochs < 0:
            return f"{f'Epoch {current_epoch}':{len(self.validation_description)}}"  # padded as Lightning's
        return super()._get_train_description(current_epoch)

    @override
    def get_metrics(self, trainer: Trainer, pl_module: Any) -> dict[str, int | str | float | dict[str, float]]:
        metrics = super().get_metrics(trainer, pl_module)
        if trainer.max_steps > 0:
            return {"step": f"{trainer.global_step}/{trainer.max_steps}", **metrics}
        return metrics


# -- torch.distributed private names the hang sentinel uses (monitor/sentinel.py) -----------------------------
def default_store() -> Any:
    """The default process group's c10d store (torchrun's or the strategy's TCPStore), or ``None``."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.distributed_c10d._get_default_store()


def nccl_flight_recorder_dump() -> bytes | None:
    """The NCCL flight recorder's record of recent collectives (pickled, as torch's ``fr_trace`` tool reads it),
    or ``None`` where there is none (no CUDA, no NCCL, or a torch without it)."""
    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace", None)
    if dump is None or not torch.cuda.is_available():
        return None
    try:
        return bytes(dump())
    except RuntimeError:  # no NCCL process group, or the recorder is off (TORCH_NCCL_TRACE_BUFFER_SIZE unset)
        return None


# Where the fit loop's per-rank batch counters sit in a checkpoint (``FitLoop.state_dict`` -> ``_TrainingEpochLoop``'s
# ``batch_progress``: ``current`` is this epoch's, ``total`` the run's, each ready/started/processed/completed).
FIT_LOOP_BATCH_PROGRESS = ("loops", "fit_loop", "epoch_loop.batch_progress")


def rescale_train_batches(checkpoint: dict[str, Any], saved_world_size: int, world_size: int) -> int:
    """Re-count the fit loop's per-rank batch counters in ``checkpoint`` for ``world_size`` ranks, before Lightning
    restores its loops from it (its ``batch_idx``, accumulation boundaries and last-batch logic read them).

    ``current`` must be a whole number of batches per rank at the new size (the caller checks); ``total`` keeps the
    earlier epochs' batches at the rate they had. Returns the new ``current`` batch count.
    """
    progress = _fit_loop_batch_progress(checkpoint)
    if progress is None:
        return 0  # no fit loop saved (a weights-only checkpoint): nothing to re-count
    current, total = progress["current"], progress["total"]
    ready = current["ready"] * saved_world_size // world_size
    earlier = round((total["ready"] - current["ready"]) * saved_world_size / world_size)
    _recount(current, total, ready, earlier)
    return int(ready)


def _recount(current: dict[str, int], total: dict[str, int], ready: int, earlier: int) -> None:
    """Set this epoch's batch counters to ``ready`` and the run's to ``earlier`` (its earlier epochs') plus those.
    Only the batch count changes: a checkpoint written in on_train_batch_end has completed = ready - 1, and the
    restart logic reads that offset to know where the save happened."""
    was = current["ready"]
    for key, count in dict(current).items():
        current[key] = ready + count - was
        total[key] = earlier + current[key]


def set_train_batches_done(trainer: Any, ready: int) -> None:
    """Re-count the restored fit loop's batches of this epoch to ``ready`` per rank (``on_train_start`` of a resume
    whose per-device batch changed: Lightning reads them when the epoch starts). The run's ``total`` keeps the
    earlier epochs' batches; the offsets between ready, started, processed and completed, which tell Lightning where
    the save happened, are kept."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    state = progress.state_dict()
    _recount(state["current"], state["total"], ready, earlier=state["total"]["ready"] - state["current"]["ready"])
    progress.load_state_dict(state)


def train_batches_in_checkpoint(checkpoint: dict[str, Any]) -> int:
    """This epoch's batches per rank that ``checkpoint`` records as ready (0 when it has no fit loop)."""
    progress = _fit_loop_batch_progress(checkpoint)
    return 0 if progress is None else int(progress["current"]["ready"])


def _fit_loop_batch_progress(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    progress: Any = checkpoint
    for key in FIT_LOOP_BATCH_PROGRESS:
        if not isinstance(progress, dict) or key not in progress:
            return None
        progress = progress[key]
    return progress


# -- torch's private names for the tests: dynamo's counters and graph breaks (torch.compiler has no public ones) ----
def dynamo_counters() -> Any:
    """``torch._dynamo.utils.counters``: how many graphs dynamo captured (``["stats"]["unique_graphs"]``)."""
    return torch._dynamo.utils.counters


def graph_break() -> None:
    """``torch._dynamo.graph_break()``: a forward dynamo cannot capture as one graph."""
    torch._dynamo.graph_break()
