"""DeepSpeed ZeRO checkpoints across a change of world size, through DeepSpeed's universal checkpoint.

A ZeRO checkpoint holds one optimizer partition per data-parallel rank, cut for that number of ranks; DeepSpeed's
engine refuses to load it on another number. DeepSpeed's own converter (``deepspeed.checkpoint.ds_to_universal``)
rewrites it as one file per parameter (fp32 weights, optimizer moments), which an engine with ``load_universal``
on loads at any size. :func:`universal_checkpoint_for` runs that converter, once, beside the saved tag:

    <checkpoint folder>/latest              "checkpoint" (Lightning's tag)
    <checkpoint folder>/checkpoint/         the ZeRO shards, as saved
    <checkpoint folder>/checkpoint_universal/   written here: per-parameter files and the model states
    <checkpoint folder>/latest_universal    "checkpoint_universal", written last (the conversion is complete)

A folder converted before (by an earlier resume, or ahead of time with DeepSpeed's ``ds_to_universal.py`` and
more workers) is used as it is.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import re
import shutil
import time
from pathlib import Path

from torch.optim import Optimizer

__all__ = ["ADAM_FAMILY", "ADAM_MOMENTS", "saved_data_parallel_size", "saved_tag", "universal_checkpoint_for"]

log = logging.getLogger(__name__)

LATEST, LATEST_UNIVERSAL = "latest", "latest_universal"
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")  # the optimizer state a universal checkpoint carries, beside fp32 weights
# Optimizers whose whole state is those moments (and a step count): torch's, and DeepSpeed's own Adam kernels.
ADAM_FAMILY = ("Adam", "AdamW", "FusedAdam", "DeepSpeedCPUAdam")
# One optimizer partition per data-parallel rank, for model-parallel rank 0 (Lightning runs no tensor parallelism).
_OPTIMIZER_PARTITION = re.compile(r"^(bf16_)?zero_pp_rank_\d+_mp_rank_00_optim_states\.pt$")


def saved_tag(folder: str | Path) -> str | None:
    """The tag a DeepSpeed checkpoint folder's ``latest`` file names (Lightning saves under ``"checkpoint"``)."""
    latest = Path(folder) / LATEST
    return latest.read_text().strip() if latest.is_file() else None


def saved_data_parallel_size(folder: str | Path) -> int | None:
    """How many data-parallel ranks wrote the ZeRO checkpoint in ``folder`` (its optimizer partitions); ``None``
    when it holds none (not a ZeRO checkpoint, or saved without optimizer state)."""
    tag = saved_tag(folder)
    if tag is None or not (Path(folder) / tag).is_dir():
        return None
    partitions = [p for p in (Path(folder) / tag).iterdir() if _OPTIMIZER_PARTITION.match(p.name)]
    return len(partitions) or None


def universal_checkpoint_for(folder: str | Path, optimizer: Optimizer | None = None) -> Path:
    """Convert the ZeRO checkpoint in ``folder`` to DeepSpeed's universal checkpoint beside it, unless that is done.

    Call on one rank, with the others waiting. ``optimizer`` is the run's (DeepSpeed's ``basic_optimizer``): one
    outside :data:`ADAM_FAMILY` is refused before anything is read, since its state would not survive the
    conversion. Returns the universal tag's folder. Raises ``RuntimeError`` naming the folder and the fix when
    DeepSpeed cannot convert it; a half-written conversion is removed.
    """
    folder = Path(folder)
    tag = saved_tag(folder)
    if tag is None:
        raise RuntimeError(f"{folder} has no DeepSpeed 'latest' file: not a DeepSpeed checkpoint folder.")
    if optimizer is not None and type(optimizer).__name__ not in ADAM_FAMILY:
        raise RuntimeError(_not_adam(folder / tag, f"the optimizer is {type(optimizer).__name__}"))
    out = folder / f"{tag}_universal"
    latest = folder / LATEST_UNIVERSAL
    if latest.is_file() and latest.read_text().strip() == out.name and out.is_dir():
        log.info("using the universal checkpoint already in %s", out)
        return out
    shutil.rmtree(out, ignore_errors=True)  # an earlier conversion that did not finish
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    args = argparse.Namespace(
        input_folder=str(folder / tag),
        output_folder=str(out),
        num_extract_workers=1,  # no worker processes forked from a training rank (gloo/NCCL threads)
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,  # a plain model (not Megatron's) carries no universal-checkpoint info of its own
    )
    started = time.perf_counter()
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):  # the converter prints its progress
            ds_to_universal(args)
    except Exception as err:
        shutil.rmtree(out, ignore_errors=True)
        latest.unlink(missing_ok=True)
        if isinstance(err, KeyError) and err.args and err.args[0] in ADAM_MOMENTS:
            raise RuntimeError(_not_adam(folder / tag, f"its optimizer state has no {err.args[0]!r}")) from err
        raise RuntimeError(
            f"DeepSpeed could not convert {folder / tag} to its universal checkpoint ({type(err).__name__}: {err}). "
            "Resume on the number of ranks that saved it, or convert it yourself with DeepSpeed's "
            f"ds_to_universal.py --input_folder {folder / tag} --output_folder {out}."
        ) from err
    log.debug("ds_to_universal printed:\n%s", printed.getvalue())
    log.info("converted %s to DeepSpeed's universal checkpoint in %.1f s", folder / tag, time.perf_counter() - started)
    return out


def _not_adam(shards: Path, why: str) -> str:
    return (
        f"{shards} cannot be converted to DeepSpeed's universal checkpoint: {why}. The universal checkpoint carries "
        f"Adam-family state only (fp32 weights, {' and '.join(ADAM_MOMENTS)}: {', '.join(ADAM_FAMILY)}). Resume on "
        "the number of ranks that saved it, or train with one of those optimizers to resume on another."
    )
