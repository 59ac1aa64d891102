"""GoodputMonitor: every second charged where it happens, against Lightning's ThroughputMonitor, restarts, ranks."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from importlib import import_module
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.loggers import Logger
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.profilers import SimpleProfiler
from torch.utils.data import DataLoader, Dataset

import lightning_accel as la
from lightning_accel.monitor.ledger import BUCKETS, Ledger, LedgerProfiler, bucket_of
from lightning_accel.monitor.progress import PROGRESS_FILE
from tests.conftest import requires_cuda, tiny_trainer_kwargs
from tests.helpers.prometheus import sample

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests/monitor/goodput_run.py"


class RecordingLogger(Logger):
    """Keeps every logged metric (name -> list of (step, value))."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: dict[str, list[tuple[int | None, float]]] = {}

    name, version = "recording", 0

    @property
    def experiment(self):
        return None

    def log_metrics(self, metrics, step=None):
        for key, value in metrics.items():
            self.metrics.setdefault(key, []).append((step, float(value)))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_ledger_charges_the_innermost_region_and_adds_up():
    clock = FakeClock()
    ledger = Ledger(clock)
    ledger.start()
    clock.now = 1.0  # 1 s other
    ledger.enter("data")
    clock.now = 3.0  # 2 s data
    ledger.exit("data")
    ledger.enter("compute")
    clock.now = 4.0
    ledger.enter("compile")  # nested: compile, not compute
    clock.now = 9.0
    ledger.exit("compile")
    clock.now = 10.0
    ledger.exit("compute")  # 2 s compute, 5 s compile
    ledger.enter("validation")
    ledger.enter("transfer")  # a validation batch's transfer stays validation
    clock.now = 11.0
    ledger.exit("transfer")
    ledger.enter("checkpoint")  # a save inside validation (ModelCheckpoint) is a checkpoint
    clock.now = 14.0
    ledger.exit("checkpoint")
    ledger.exit("validation")
    clock.now = 14.5
    ledger.stop()
    assert ledger.seconds == {
        "data": 2.0,
        "transfer": 0.0,
        "compute": 2.0,
        "checkpoint": 3.0,
        "validation": 1.0,
        "compile": 5.0,
        "other": 1.5,
    }
    assert sum(ledger.seconds.values()) == 14.5


def test_lightning_profiler_actions_map_to_buckets():
    assert bucket_of("[_TrainingEpochLoop].train_dataloader_next") == "data"
    assert bucket_of("[Strategy]DDPStrategy.batch_to_device") == "transfer"
    assert bucket_of("run_training_batch") == "compute"
    assert bucket_of("save_checkpoint") == "checkpoint"
    assert bucket_of("torch_compile") == "compile" and la.compile.COMPILE_ACTION == "torch_compile"
    assert bucket_of("[Strategy]SingleDeviceStrategy.training_step") == "forward"
    assert bucket_of("[_EvaluationLoop].val_next") is None  # validation is the whole loop, wrapped
    assert bucket_of("[Callback]ModelCheckpoint.on_train_batch_end") is None


class SlowData(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.01)
        return torch.randn(32)


class Timed(BoringModel):
    """20 ms per training step, 20 ms per validation step, 20 ms per batch fetched (two 10 ms samples)."""

    def training_step(self, batch, batch_idx):
        time.sleep(0.02)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        time.sleep(0.02)
        return super().validation_step(batch, batch_idx)

    def train_dataloader(self):
        return DataLoader(SlowData(), batch_size=2)

    def val_dataloader(self):
        return DataLoader(RandomDataset(32, 8), batch_size=2)


class SlowIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint, path, storage_options=None):
        time.sleep(0.05)
        super().save_checkpoint(checkpoint, path, storage_options)


class SaveEvery(Callback):
    def __init__(self, every: int, dirpath: Path) -> None:
        self.every, self.dirpath = every, dirpath

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step % self.every == 0:
            trainer.save_checkpoint(self.dirpath / f"user-{trainer.global_step}.ckpt")


def test_each_bucket_holds_the_time_spent_in_it(tmp_path):
    # Lightning's first save imports the installed fsspec cloud backends (its object-storage check: 1.7 s here, once
    # per process); imported now, so the checkpoint bucket holds only the saves this test times
    import_module("s3fs"), import_module("gcsfs"), import_module("adlfs")
    monitor = la.GoodputMonitor(every_n_steps=5, warmup_steps=0, summary=False, run_dir=tmp_path)
    profiler = SimpleProfiler(dirpath=tmp_path, filename="profile")
    trainer = Trainer(
        **tiny_trainer_kwargs(
            tmp_path,
            max_steps=10,
            limit_val_batches=2,
            val_check_interval=5,
            num_sanity_val_steps=1,
            plugins=[SlowIO()],
            profiler=profiler,
            callbacks=[monitor, SaveEvery(3, tmp_path)],
        )
    )
    start = time.perf_counter()
    trainer.fit(Timed())
    wall = time.perf_counter() - start
    r = monitor.results
    # Lower bounds are the sleeps; upper bounds leave room for the real work on a loaded 2-core machine.
    assert 0.20 <= r["goodput/data_s"] < 0.20 + 0.3  # 10 batches of two 10 ms samples
    assert 0.20 <= r["goodput/compute_s"] < 0.20 + 0.5  # 10 steps of 20 ms
    assert 0.15 <= r["goodput/checkpoint_s"] < 0.15 + 0.5  # saves at steps 3, 6, 9, 50 ms each
    assert 0.10 <= r["goodput/validation_s"] < 0.10 + 0.5  # 1 sanity + 2 x 2 validation batches of 20 ms
    assert r["goodput/compile_s"] == 0.0
    assert sum(r[f"goodput/{b}_share"] for b in BUCKETS) == pytest.approx(1.0, abs=1e-12)
    assert sum(r[f"goodput/{b}_s"] for b in BUCKETS) == pytest.approx(r["goodput/total_s"])
    assert r["goodput/total_s"] <= wall
    # Throughput is over training from on_train_start; the ledger also holds the few ms of setup before it.
    assert r["throughput/data_wait_share"] == pytest.approx(
        r["goodput/data_s"] / (r["goodput/total_s"] - r["goodput/validation_s"]), rel=0.05
    )
    assert r["throughput/steps_measured"] == 10 and r["throughput/batches_measured"] == 10
    # The user's profiler still saw every action, and is theirs again after fit.
    assert trainer.profiler is profiler and "run_training_batch" in profiler.recorded_durations
    assert "run" not in trainer.fit_loop.epoch_loop.val_loop.__dict__
    progress = json.loads((tmp_path / PROGRESS_FILE).read_text())
    assert progress["highest_step"] == 10 and time.time() - 60 < progress["at"] <= time.time()
    assert (tmp_path / "goodput.png").stat().st_size > 10_000


def test_checkpoint_time_is_not_data_wait_and_samples_per_sec_agrees_with_lightning(tmp_path):
    """The case from issue #12: BoringModel with PreemptionCheckpoint(every_n_steps=5)."""
    monitor = la.GoodputMonitor(every_n_steps=10, summary=False, plot=False)
    logger = RecordingLogger()
    trainer = Trainer(
        **tiny_trainer_kwargs(
            tmp_path,
            max_steps=60,
            logger=logger,
            log_every_n_steps=10,
            callbacks=[
                monitor,
                ThroughputMonitor(batch_size_fn=lambda batch: batch.shape[0], window_size=60),  # the whole fit
                la.PreemptionCheckpoint(dirpath=tmp_path / "ckpt", every_n_steps=5, keep_last=2),
            ],
        )
    )
    trainer.fit(BoringModel())
    r = monitor.results
    assert r["goodput/checkpoint_share"] > 0.2  # 12 saves dominate a model this small
    assert r["goodput/checkpoint_share"] > 3 * r["goodput/data_share"]
    assert r["throughput/data_wait_share"] < 0.15
    lightning = logger.metrics["train/device/samples_per_sec"][-1][1]  # one device: global = device
    assert r["throughput/samples_per_sec"] == pytest.approx(lightning, rel=0.15)
    logged = {step for step, _ in logger.metrics["goodput/checkpoint_share"]}
    assert {10, 20, 30, 40, 50, 60} <= logged  # every 10 optimizer steps, plus the final results


class Accumulating(BoringModel):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_accumulation_counts_batches_and_optimizer_steps_apart(tmp_path):
    monitor = la.GoodputMonitor(every_n_steps=2, warmup_steps=0, summary=False, plot=False)
    logger = RecordingLogger()
    trainer = Trainer(
        **tiny_trainer_kwargs(tmp_path, max_steps=6, accumulate_grad_batches=3, logger=logger, callbacks=[monitor])
    )
    trainer.fit(Accumulating())
    r = monitor.results
    assert r["throughput/batches_measured"] == 18 and r["throughput/steps_measured"] == 6
    assert r["throughput/step_time_ms"] == pytest.approx(3 * r["throughput/batch_time_ms"])
    assert [step for step, _ in logger.metrics["throughput/step_time_ms"]] == [2, 4, 6, 6]  # 3 intervals + results


def test_fit_twice_gives_two_independent_results(tmp_path):
    monitor = la.GoodputMonitor(every_n_steps=5, summary=False, plot=False)
    results, sizes = [], []
    for steps in (10, 40):
        Trainer(**tiny_trainer_kwargs(tmp_path, max_steps=steps, callbacks=[monitor])).fit(BoringModel())
        results.append(dict(monitor.results))
        sizes.append({k: len(v) for k, v in vars(monitor).items() if hasattr(v, "__len__") and not isinstance(v, str)})
    assert results[0]["throughput/batches_measured"] == 10 - 2  # warm-up steps left out
    assert results[1]["throughput/batches_measured"] == 40 - 2
    assert results[1]["goodput/restarts"] == 0 and results[1]["goodput/lost_steps"] == 0
    assert results[1]["goodput/total_s"] < 10 * results[0]["goodput/total_s"]  # not the sum of both fits
    assert sizes[0] == sizes[1]  # nothing grows with the run: counters and two marks, no per-step history


def test_compile_time_is_charged_to_compile(tmp_path):
    compile_cb = la.TorchCompile(backend="aot_eager")
    monitor = la.GoodputMonitor(every_n_steps=5, summary=False, plot=False)
    Trainer(**tiny_trainer_kwargs(tmp_path, max_steps=5, callbacks=[monitor, compile_cb])).fit(BoringModel())
    compiled = sum(compile_cb.compile_time_s.values())
    assert set(compile_cb.compile_time_s) == {"BoringModel", "backward"}
    assert compiled > 0
    # The ledger's region is the one TorchCompile times, opened and closed around it.
    assert compiled <= monitor.results["goodput/compile_s"] < compiled + 0.05


def test_ledger_profiler_passes_everything_to_the_users_profiler():
    inner = SimpleProfiler()
    ledger = Ledger()
    ledger.start()
    wrapped = LedgerProfiler(inner, ledger)
    with wrapped.profile("run_training_batch"):
        time.sleep(0.01)
    with wrapped.profile("[Callback]Mine.on_train_batch_end"):
        pass
    assert set(inner.recorded_durations) == {"run_training_batch", "[Callback]Mine.on_train_batch_end"}
    assert ledger.snapshot()["compute"] >= 0.01
    assert wrapped.dirpath is None and wrapped.recorded_durations is inner.recorded_durations


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="every_n_steps must be >= 1, got 0"):
        la.GoodputMonitor(every_n_steps=0)
    with pytest.raises(TypeError, match="PrometheusExporter, a port number or None, got '9100'"):
        la.GoodputMonitor(prometheus="9100")


def run_script(*args: str, expect: int = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.multiprocess
def test_work_lost_to_a_hard_kill_is_counted_on_resume(tmp_path):
    run_script("--out", str(tmp_path), "--kill-at-step", "13", expect=-9)  # SIGKILL: no hook ran
    assert json.loads((tmp_path / "ckpt" / PROGRESS_FILE).read_text())["highest_step"] == 13
    run_script("--out", str(tmp_path), "--resume")  # from step 10
    r = json.loads((tmp_path / "results_rank0.json").read_text())
    assert r["goodput/restarts"] == 1 and r["goodput/lost_steps"] == 3
    assert r["goodput/lost_s"] >= 3 * 0.01  # three 10 ms steps redone, at least
    # Totals carry over: the first attempt's 10 steps (100 ms of sleeps) are in compute.
    assert r["goodput/compute_s"] >= 20 * 0.01
    assert r["throughput/steps_measured"] == 10 - 2


@pytest.mark.multiprocess
def test_straggler_named_across_two_ranks(tmp_path):
    """Rank 1's step 30% slower (40 ms + 12 ms of sleep before the gradient sync) over 40 steps (8 logging
    intervals, the window): named, with its host, in the log and goodput.json; the same run balanced, with a
    HangSentinel, names no straggler and raises no hang alarm (false positives: zero)."""
    common = ("--devices", "2", "--steps", "40", "--step-s", "0.04")
    slow = run_script(
        "--out", str(tmp_path / "slow"), *common, "--slow-rank", "1", "--slow-extra-s", "0.012", "--prometheus"
    )
    for rank in (0, 1):
        r = json.loads((tmp_path / "slow" / f"results_rank{rank}.json").read_text())
        assert r["goodput/slowest_rank"] == 1 and r["goodput/straggler_rank"] == 1
        assert 1.2 < r["goodput/straggler_ratio"] < 1.45  # 52 ms over 40 ms, plus each step's own overhead
    assert "Straggler: rank 1 (host " in slow.stderr
    # Prometheus: each rank's own pre-sync step time under its rank label, the straggler's number from rank 0
    scraped = {r: (tmp_path / "slow" / f"metrics_rank{r}.txt").read_text() for r in (0, 1)}
    presync = {r: sample(scraped[r], "lightning_accel_goodput_presync_step_s", rank=str(r)) for r in (0, 1)}
    assert 1.2 < presync[1] / presync[0] < 1.45
    assert sample(scraped[0], "lightning_accel_goodput_straggler_rank", rank="0") == 1.0
    assert (
        json.loads((tmp_path / "slow" / "ckpt" / "goodput.json").read_text())["straggler_host"] == socket.gethostname()
    )
    balanced = run_script("--out", str(tmp_path / "balanced"), *common, "--sentinel")
    for rank in (0, 1):
        r = json.loads((tmp_path / "balanced" / f"results_rank{rank}.json").read_text())
        assert r["goodput/straggler_rank"] == -1 and r["goodput/straggler_ratio"] < 1.2
    assert "Straggler" not in balanced.stderr + balanced.stdout
    assert "hang found" not in balanced.stderr and not (tmp_path / "balanced" / "hang").exists()  # no false hang
    assert "straggler_host" not in json.loads((tmp_path / "balanced" / "ckpt" / "goodput.json").read_text())


class MatmulHeavy(BoringModel):
    """A training step that queues ~50 ms of GPU matmuls and returns at once (CUDA is asynchronous)."""

    def training_step(self, batch, batch_idx):
        x = torch.randn(4096, 4096, device=self.device)
        for _ in range(20):
            x = torch.tanh(x @ x)
        return self.layer(batch).sum() + 0 * x.mean()


@requires_cuda
def test_gpu_kernels_are_charged_to_compute(tmp_path):
    monitor = la.GoodputMonitor(every_n_steps=5, summary=False, plot=False)
    Trainer(**tiny_trainer_kwargs(tmp_path, accelerator="gpu", max_steps=10, callbacks=[monitor])).fit(MatmulHeavy())
    r = monitor.results
    # Without the sync at the end of each compute region the queued kernels would be waited for elsewhere.
    assert r["goodput/compute_share"] > 0.8, r


def test_a_preempted_attempt_writes_its_report_for_the_doctor(tmp_path, capsys):
    """A stop request at step 3 (what SIGTERM or a cloud notice makes): the fit ends with exit 75, and the attempt
    still writes goodput.json (the doctor reads it), prints its summary once and draws its PNG."""
    checkpoint = la.PreemptionCheckpoint(tmp_path / "ckpt", every_n_steps=100)
    monitor = la.GoodputMonitor(every_n_steps=2, warmup_steps=0)

    class StopAtThree(Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 3:
                checkpoint.request_stop("a test's stop request")

    trainer = Trainer(**tiny_trainer_kwargs(tmp_path, max_steps=20, callbacks=[StopAtThree(), checkpoint, monitor]))
    with pytest.raises(SystemExit) as stopped:
        trainer.fit(BoringModel())
    assert stopped.value.code == 75
    report = json.loads((tmp_path / "ckpt" / "goodput.json").read_text())
    assert (
        report["goodput/total_s"] > 0 and 3 <= report["throughput/steps"] <= 4 if "throughput/steps" in report else True
    )
    assert (tmp_path / "ckpt" / "goodput.png").is_file()
    assert capsys.readouterr().out.count("lightning-accel goodput") == 1
