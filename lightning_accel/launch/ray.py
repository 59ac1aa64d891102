"""Run a recipe on a Ray cluster with Ray Train's Lightning integration (the optional ``[ray]`` extra).

``lightning-accel fit --config recipe.yaml --ray.num_workers 2 [--ray.max_failures 2] [--ray.use_gpu]``, or
:func:`fit_on_ray` from Python. Each Ray Train worker runs the same ``lightning-accel fit`` with Ray's
``RayDDPStrategy``, ``RayLightningEnvironment`` and ``prepare_trainer`` in place of the recipe's strategy,
devices and plugins (Ray owns the process group and places the workers); everything else in the recipe, our
callbacks included, runs as it would anywhere. :class:`RayReport` sends the run's metrics (the goodput ledger's
too) to Ray. When a worker dies, Ray's ``FailureConfig(max_failures)`` restarts the group and the recipe's
``--ckpt_path auto`` resumes from the newest valid ``PreemptionCheckpoint`` on shared storage (Ray's own
checkpoints are not used: ours carry the exact-resume state).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_accel.checkpoint import PreemptionCheckpoint
from lightning_accel.extras import require
from lightning_accel.recipe import AccelCLI, build_cli

__all__ = ["RayReport", "fit_on_ray", "newest_checkpoint", "split_ray_args", "worker_count"]

log = logging.getLogger(__name__)


class RayReport(Callback):
    """Report the logged metrics and the goodput ledger's to Ray every ``every_n_steps``, and after each save of
    a ``PreemptionCheckpoint`` with a Ray checkpoint that points at it (``latest.json``: the path and step), so
    ``Result.checkpoint`` names our newest checkpoint. Every rank reports at the same steps, as Ray requires."""

    def __init__(self, every_n_steps: int = 10) -> None:
        self.every_n_steps = every_n_steps
        self._saves = 0
        self._last_step = -1

    @staticmethod
    def _metrics(trainer: Trainer) -> dict[str, float]:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1}
        for callback in trainer.callbacks:
            results = getattr(callback, "results", None)  # GoodputMonitor's ledger, throughput and MFU
            if isinstance(results, dict):
                metrics.update({k: float(v) for k, v in results.items() if isinstance(v, (int, float))})
        return {**metrics, "step": float(trainer.global_step)}

    def _report(self, trainer: Trainer, final: bool = False) -> None:
        import ray.train  # lazy: Ray is the optional [ray] extra

        saved = [p for c in trainer.callbacks if isinstance(c, PreemptionCheckpoint) for p in c.saved]
        # Ray's Result carries the metrics of the last report with a checkpoint: the final one always has it
        if not saved or (len(saved) == self._saves and not final) or not trainer.is_global_zero:
            self._saves = len(saved)
            ray.train.report(self._metrics(trainer))
            return
        self._saves = len(saved)
        with tempfile.TemporaryDirectory() as folder:
            pointer = {"path": str(Path(saved[-1]).resolve()), "global_step": trainer.global_step}
            (Path(folder) / "latest.json").write_text(json.dumps(pointer))
            ray.train.report(self._metrics(trainer), checkpoint=ray.train.Checkpoint.from_directory(folder))

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        # once per optimizer step (micro-batches of an accumulation window share the step)
        if trainer.global_step % self.every_n_steps == 0 and trainer.global_step != self._last_step:
            self._last_step = trainer.global_step
            self._report(trainer)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._report(trainer, final=True)


def _worker(config: dict[str, Any]) -> None:
    """One Ray Train worker: ``lightning-accel fit`` with Ray's strategy, environment and devices."""
    os.chdir(config["cwd"])  # Ray starts workers in its own run folder: relative paths are the driver's

    class RayCLI(AccelCLI):
        def instantiate_trainer(self, **kwargs: Any) -> Trainer:
            from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment, prepare_trainer

            kwargs.update(strategy=RayDDPStrategy(), plugins=[RayLightningEnvironment()], devices="auto")
            trainer = super().instantiate_trainer(**kwargs)
            trainer.callbacks.append(RayReport(config["report_every_n_steps"]))
            return prepare_trainer(trainer)

    build_cli(config["args"], cli_class=RayCLI)


def newest_checkpoint(result: Any) -> dict[str, Any] | None:
    """What ``RayReport``'s last Ray checkpoint points at in a Ray ``Result``: ``{"path", "global_step"}`` of our newest
    ``PreemptionCheckpoint`` file; ``None`` when the run reported none."""
    if result.checkpoint is None:
        return None
    with result.checkpoint.as_directory() as folder:
        return json.loads((Path(folder) / "latest.json").read_text())


def worker_count(value: str) -> int | tuple[int, int]:
    """``--ray.num_workers``: ``N`` workers, or ``MIN:MAX`` for Ray Train's elastic scaling (Ray >= 2.50, whose
    ``ScalingConfig`` takes a range: the group starts with what the cluster has, at least MIN, and is resized as
    nodes leave and join; each resize resumes the recipe's newest checkpoint at the new world size)."""
    low, colon, high = value.partition(":")
    try:
        counts = (int(low), int(high)) if colon else (int(low), int(low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX workers, got {value!r}") from None
    if not 1 <= counts[0] <= counts[1]:
        raise argparse.ArgumentTypeError(f"expected 1 <= MIN <= MAX workers, got {value!r}")
    return counts if colon else counts[0]


def fit_on_ray(
    args: list[str],
    num_workers: int | tuple[int, int] = 2,
    use_gpu: bool = False,
    max_failures: int = 0,
    storage_path: str | Path | None = None,
    report_every_n_steps: int = 10,
    resize_check_s: float = 60.0,
) -> Any:
    """Run ``lightning-accel fit ARGS`` on ``num_workers`` Ray Train workers (``(min, max)``: elastic, see
    :func:`worker_count`, with the cluster looked at for a new size every ``resize_check_s`` seconds while the group
    is healthy: Ray's ``elastic_resize_monitor_interval_s``); returns Ray's ``Result``.

    Connects to the cluster in ``RAY_ADDRESS`` (or starts a local one, as ``ray.init()`` does). ``args`` are
    those of ``lightning-accel fit`` (without the subcommand); use ``--ckpt_path auto`` with a
    ``PreemptionCheckpoint`` on storage every worker sees, so restarts resume. Workers run in this process's
    working directory, so relative paths (the recipe, its folders) mean what they mean here; on a cluster of
    several machines that directory must exist on each (shared storage).
    """
    require("ray", "lightning-accel fit --ray.*")
    if min(num_workers if isinstance(num_workers, tuple) else (num_workers,)) < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    if not ray.is_initialized():
        ray.init()
    trainer = TorchTrainer(
        _worker,
        train_loop_config={"args": ["fit", *args], "report_every_n_steps": report_every_n_steps, "cwd": os.getcwd()},
        scaling_config=ScalingConfig(
            num_workers=num_workers,
            use_gpu=use_gpu,
            resources_per_worker={"CPU": 1},
            elastic_resize_monitor_interval_s=resize_check_s,
        ),
        run_config=RunConfig(
            storage_path=str(Path(storage_path or "runs/ray").resolve()),
            failure_config=FailureConfig(max_failures=max_failures),
        ),
    )
    return trainer.fit()


def split_ray_args(argv: list[str]) -> tuple[argparse.Namespace | None, list[str]]:
    """``(--ray.* options, the rest)``; ``None`` when no ``--ray.`` option is given."""
    if not any(arg.startswith("--ray.") for arg in argv):
        return None, argv
    parser = argparse.ArgumentParser(prog="lightning-accel fit --ray.num_workers N", add_help=False)
    parser.add_argument("--ray.num_workers", dest="num_workers", type=worker_count, default=2)
    parser.add_argument("--ray.max_failures", dest="max_failures", type=int, default=0)
    parser.add_argument("--ray.use_gpu", dest="use_gpu", action="store_true")
    parser.add_argument("--ray.storage_path", dest="storage_path", default=None)
    parser.add_argument("--ray.report_every_n_steps", dest="report_every_n_steps", type=int, default=10)
    parser.add_argument("--ray.resize_check_s", dest="resize_check_s", type=float, default=60.0)
    return parser.parse_known_args(argv)
