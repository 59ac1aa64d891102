"""What checkpoints cost a user, end to end: ours (sync, async) beside Lightning's and torch DCP's async saves.

Issue #18's case: a 25M-parameter MLP trained with SGD + momentum (a checkpoint of about 200 MB: weights and
momentum), 60 steps, a checkpoint every 10 steps, every variant in the same run, in alternating rounds:

- ``none``: the same fit without checkpoints (the reference);
- ``ours_sync`` / ``ours_async``: ``PreemptionCheckpoint(every_n_steps=10, keep_last=2[, async_save=True])``
  (atomic rename, fsync, manifest with a checksum, exact-resume state);
- ``lightning_async``: ``ModelCheckpoint(every_n_train_steps=10, save_top_k=2)`` with
  ``plugins=[AsyncCheckpointIO()]``, what a Lightning user picks;
- ``dcp_async``: a callback calling ``torch.distributed.checkpoint.async_save`` on the model's and the
  optimizer's state dicts every 10 steps (one save in flight, as torch's docs show). It keeps every
  checkpoint: no deletions, which the others pay for (deleting a 200 MB file takes about 30 ms here).

Reported per variant: fit time over ``none`` (what the user pays), the stall (how long the saving
callback's ``on_train_batch_end`` holds the training thread at a saving step), and the slowdown of the
three steps after each save (while a write is in flight) over the median step of ``none``.

    python -m benchmarks.checkpoint_async [--params-m 25] [--steps 60] [--every 10] [--rounds 3] [--gpu]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO

from benchmarks.harness import RESULTS, quiet_trainer, write
from lightning_accel import PreemptionCheckpoint
from lightning_accel.demos import MLPClassifier, SyntheticClassificationDataModule

VARIANTS = ("none", "ours_sync", "ours_async", "lightning_async", "dcp_async")
AFTER = 3  # steps after a save whose slowdown is reported


class MomentumMLP(MLPClassifier):
    """SGD with momentum: the optimizer state is as large as the weights, as in most real runs."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class StepTimes(Callback):
    """Wall time of each training batch, hooks of every callback included (from one batch start to the next)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start: float | None = None
        self.started_at = 0.0  # perf_counter at the first batch: what comes before it is the fit's start-up
        self.ended_at = 0.0  # perf_counter at on_train_end: what follows, to fit returning, is teardown's wait

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        now = time.perf_counter()
        if self._start is not None:
            self.times.append(now - self._start)
        else:
            self.started_at = now
        self._start = now

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.ended_at = time.perf_counter()
        if self._start is not None:
            self.times.append(self.ended_at - self._start)


class DCPAsyncSave(Callback):
    """What torch's docs show: ``dcp.async_save`` of the model and optimizer state, one save in flight. ``folder`` may
    be a bucket URL: DCP then picks its fsspec writer (benchmarks/object_storage.py)."""

    def __init__(self, folder: Path | str, every_n_steps: int) -> None:
        self.folder, self.every = str(folder).rstrip("/"), every_n_steps
        self.pending: Future | None = None

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.global_step % self.every:
            return
        self._wait()
        state = {"model": pl_module.state_dict(), "optimizer": trainer.optimizers[0].state_dict()}
        self.pending = dcp.async_save(state, checkpoint_id=f"{self.folder}/step={trainer.global_step}", no_dist=True)

    def _wait(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.pending = None

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._wait()


def fit(variant: str, hidden: int, steps: int, every: int, folder: Path, gpu: bool) -> dict[str, Any]:
    """One fit of ``variant``: wall time (the last write included) and per-step times."""
    timer = StepTimes()
    callbacks: list[Callback] = [timer]
    extra: dict[str, Any] = {}
    if variant.startswith("ours"):
        callbacks.append(
            PreemptionCheckpoint(folder, every_n_steps=every, keep_last=2, async_save=variant == "ours_async")
        )
    elif variant == "lightning_async":
        callbacks.append(ModelCheckpoint(folder, every_n_train_steps=every, save_top_k=2, monitor="step", mode="max"))
        extra = {"plugins": [AsyncCheckpointIO()], "enable_checkpointing": True}
    elif variant == "dcp_async":
        callbacks.append(DCPAsyncSave(folder, every))
    hook_s = _time_saving_hook(callbacks[-1], every) if variant != "none" else []
    model = MomentumMLP(input_dim=hidden, hidden_dim=hidden, num_layers=3, num_classes=4)
    trainer = quiet_trainer(accelerator="gpu" if gpu else "cpu", max_steps=steps, callbacks=callbacks, **extra)
    data = SyntheticClassificationDataModule(num_samples=16 * steps, input_dim=hidden, batch_size=16)
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)  # teardown waits for the last write of every async variant
    fit_s = time.perf_counter() - start
    written = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.exists() else 0
    shutil.rmtree(folder, ignore_errors=True)
    return {"fit_s": fit_s, "step_s": timer.times, "stall_s": hook_s, "kept_mb": written / 1e6}


def _time_saving_hook(callback: Callback, every: int) -> list[float]:
    """Time the saving callback's ``on_train_batch_end`` at saving steps: how long the training thread is held."""
    times: list[float] = []
    hook = callback.on_train_batch_end

    def timed(trainer: Trainer, *args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        hook(trainer, *args, **kwargs)
        if trainer.global_step % every == 0:
            times.append(time.perf_counter() - start)

    callback.on_train_batch_end = timed  # type: ignore[method-assign]
    return times


def run(params_m: float = 25, steps: int = 60, every: int = 10, rounds: int = 3, gpu: bool = False) -> dict:
    hidden = int((params_m * 1e6 / 3) ** 0.5)  # three hidden x hidden weight matrices (num_layers=3)
    fits: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(dir=Path(__file__).resolve().parent) as tmp:
        for r in range(rounds):
            for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:  # alternate the order: drift cancels
                fits[variant].append(fit(variant, hidden, steps, every, Path(tmp) / variant, gpu))
    base_step = statistics.median(t for f in fits["none"] for t in f["step_s"][1:])
    saving = [i for i in range(len(fits["none"][0]["step_s"])) if (i + 1) % every == 0]
    variants: dict[str, dict[str, float]] = {}
    for variant, runs in fits.items():
        stall = [t for f in runs for t in f.get("stall_s", [])]
        after = [
            f["step_s"][j] for f in runs for i in saving for j in range(i + 1, i + 1 + AFTER) if j < len(f["step_s"])
        ]
        # paired: each round's fit over that round's reference (the machine drifts between rounds)
        paired = [f["fit_s"] / n["fit_s"] for f, n in zip(runs, fits["none"], strict=True)]
        variants[variant] = {
            "fit_s": statistics.median(f["fit_s"] for f in runs),
            "fit_over_none": statistics.median(paired),
            "stall_ms": 1000 * statistics.median(stall) if stall else 0.0,
            "after_save_slowdown": statistics.mean(after) / base_step if after else 1.0,
            "kept_mb": runs[-1]["kept_mb"],
        }
    ours = variants["ours_async"]
    # the best peer is the one with the lower median cost; ours is paired with it round by round (the
    # smaller of two noisy peers in each round would favour the peers by noise alone)
    best = min(("lightning_async", "dcp_async"), key=lambda name: variants[name]["fit_over_none"])
    per_round = [o["fit_s"] / p["fit_s"] for o, p in zip(fits["ours_async"], fits[best], strict=True)]
    return {
        "params_m": params_m,
        "checkpoint_mb": variants["ours_sync"]["kept_mb"] / 2,  # fp32 weights + momentum (two kept)
        "steps": steps,
        "every_n_steps": every,
        "rounds": rounds,
        "median_step_ms_without_checkpoints": 1000 * base_step,
        "variants": variants,
        "best_peer": best,
        "ours_async_over_best_peer_fit": statistics.median(per_round),
        "ours_async_over_best_peer_fit_per_round": per_round,
        "ours_async_stall_over_dcp": ours["stall_ms"] / max(variants["dcp_async"]["stall_ms"], 1e-3),
        "raw_fit_s": {v: [f["fit_s"] for f in runs] for v, runs in fits.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params-m", type=float, default=25)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--gpu", action="store_true")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON and PNG")
    args = p.parse_args()
    torch.set_num_threads(2)
    result = run(args.params_m, args.steps, args.every, args.rounds, args.gpu)
    v = result["variants"]
    ratios = {name: v[name]["fit_over_none"] for name in VARIANTS[1:]}
    write("checkpoint_async", result, ratios, "fit time over the fit without checkpoints", out=args.out)
    for name in VARIANTS:
        print(
            f"{name:16} fit {v[name]['fit_s']:6.2f}s  x{v[name]['fit_over_none']:.2f}  stall "
            f"{v[name]['stall_ms']:7.1f} ms  steps after a save x{v[name]['after_save_slowdown']:.2f}"
        )
    print(
        f"ours async / best peer ({result['best_peer']}), end to end: {result['ours_async_over_best_peer_fit']:.3f}; "
        f"stall / DCP's: {result['ours_async_stall_over_dcp']:.2f}"
    )


if __name__ == "__main__":
    main()
