"""Where the time of a checkpointing run goes: GoodputMonitor beside Lightning's ThroughputMonitor, same run.

The case from issue #12: Lightning's BoringModel with ``PreemptionCheckpoint(every_n_steps=5)``. Both
monitors watch the same fit. Lightning's reports samples/s over training time; ours must agree with it
(target: within 15%) and, unlike a gap-based "data wait", put the saves under ``checkpoint``, not ``data``.
Writes the JSON, a bar chart of the shares, and the ledger's own stacked bar (``goodput_ledger.png``).

    python -m benchmarks.goodput_attribution [--steps 200] [--rounds 3] [--gpu]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

from lightning.pytorch import seed_everything
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import Logger

from benchmarks.harness import RESULTS, quiet_trainer, write
from lightning_accel import GoodputMonitor, PreemptionCheckpoint
from lightning_accel.monitor.batches import default_batch_size
from lightning_accel.monitor.ledger import BUCKETS


class LastValues(Logger):
    """Keeps the last value logged for each metric."""

    name, version = "last", 0

    def __init__(self) -> None:
        super().__init__()
        self.values: dict[str, float] = {}

    @property
    def experiment(self) -> None:
        return None

    def log_metrics(self, metrics, step=None):
        self.values.update({k: float(v) for k, v in metrics.items()})

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def one_run(steps: int, folder: Path, gpu: bool = False) -> dict[str, float]:
    seed_everything(0)
    ours = GoodputMonitor(every_n_steps=10, summary=False, run_dir=folder)
    logger = LastValues()
    trainer = quiet_trainer(
        accelerator="gpu" if gpu else "cpu",
        devices=1,
        max_steps=steps,
        logger=logger,
        log_every_n_steps=10,
        callbacks=[
            ours,
            # its window covers the whole fit, as our end-of-fit numbers do (a 50-batch window follows noise)
            ThroughputMonitor(batch_size_fn=default_batch_size, window_size=steps),
            PreemptionCheckpoint(dirpath=folder / "ckpt", every_n_steps=5, keep_last=2),
        ],
    )
    trainer.fit(BoringModel())
    r = dict(ours.results)
    r["lightning/samples_per_sec"] = logger.values["train/device/samples_per_sec"]
    return r


def run(steps: int = 200, rounds: int = 3, png: Path | None = None, gpu: bool = False) -> dict:
    runs = []
    for i in range(rounds):
        folder = Path(tempfile.mkdtemp(prefix="goodput_"))
        try:
            runs.append(one_run(steps, folder, gpu))
            if png is not None and i == rounds - 1:
                png.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(folder / "goodput.png", png)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    ratios = [r["throughput/samples_per_sec"] / r["lightning/samples_per_sec"] for r in runs]
    shares = {b: statistics.median(r[f"goodput/{b}_share"] for r in runs) for b in BUCKETS}
    return {
        "samples_per_sec_ratio_vs_lightning": statistics.median(ratios),
        "ratios": ratios,
        "median_shares": shares,
        "data_wait_share": statistics.median(r["throughput/data_wait_share"] for r in runs),
        "runs": runs,
        "steps": steps,
        "target_ratio": [0.85, 1.15],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--gpu", action="store_true", help="train on the GPU (CUDA-synchronized buckets)")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON and PNGs")
    args = p.parse_args()
    result = run(args.steps, args.rounds, png=args.out / "goodput_ledger.png", gpu=args.gpu)
    write("goodput_attribution", result, result["median_shares"], "share of wall time (median run)", out=args.out)
    print(
        f"samples/s ours / Lightning ThroughputMonitor = {result['samples_per_sec_ratio_vs_lightning']:.3f} "
        f"(target 0.85-1.15); checkpoint share {result['median_shares']['checkpoint']:.1%}, "
        f"data share {result['median_shares']['data']:.1%}, data_wait_share {result['data_wait_share']:.1%}"
    )


if __name__ == "__main__":
    main()
