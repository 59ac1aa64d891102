"""GoodputMonitor throughput and UtilizationMonitor: exact FLOPs, hand-computed rates, data wait, NVML-less path."""

from __future__ import annotations

import csv
import socket
import time
import urllib.request

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import Dataset

from lightning_accel.demos import MLPClassifier, SyntheticClassificationDataModule, SyntheticTokenDataModule, TinyGPT
from lightning_accel.monitor import GoodputMonitor, UtilizationMonitor, cpu_peak_flops
from lightning_accel.monitor.accounting import GoodputAccounting, Mark
from lightning_accel.monitor.ledger import BUCKETS
from tests.conftest import requires_cuda, tiny_trainer_kwargs
from tests.helpers.prometheus import sample


def fit(tmp_path, model, dm, callbacks, **kw):
    trainer = Trainer(**tiny_trainer_kwargs(tmp_path, callbacks=callbacks, **kw))
    trainer.fit(model, datamodule=dm)
    return trainer


def test_flops_are_exact_for_a_linear_stack(tmp_path):
    cb = GoodputMonitor(summary=False, plot=False)
    model = MLPClassifier(input_dim=16, hidden_dim=32, num_layers=2, num_classes=4)
    fit(
        tmp_path,
        model,
        SyntheticClassificationDataModule(num_samples=128, input_dim=16, batch_size=32),
        [cb],
        max_steps=3,
    )
    b = 32
    layer = [2 * b * 16 * 32, 2 * b * 32 * 32, 2 * b * 32 * 4]  # forward matmuls, 2*M*N*K each
    # backward: weight grads for every layer, input grads for all but the first (the data needs none)
    assert cb.flops_per_batch == 3 * sum(layer) - layer[0]


def mark(batches: int, steps: int, samples: int, tokens: int | None, **seconds: float) -> Mark:
    return Mark({b: seconds.get(b, 0.0) for b in BUCKETS}, 0.0, batches, steps, samples, tokens)


def test_rates_and_mfu_match_hand_computation():
    cb = GoodputAccounting(flops_per_batch=1e9, peak_flops=1e11)  # the monitor's arithmetic, without a Trainer
    before = mark(2, 1, 64, 64 * 64, data=1.0, compute=1.0)
    # 4 micro-batches (2 optimizer steps) of 32 samples x 64 tokens: 0.06 s data, 0.12 s compute, 0.02 s other,
    # and 0.5 s of validation, which throughput leaves out.
    after = mark(6, 3, 64 + 128, 64 * 64 + 128 * 64, data=1.06, compute=1.12, other=0.02, validation=0.5)
    m = cb.rates(before, after, world_size=2)
    train_s = 0.2
    assert m["throughput/samples_per_sec"] == pytest.approx(2 * 128 / train_s)
    assert m["throughput/tokens_per_sec"] == pytest.approx(2 * 128 * 64 / train_s)
    assert m["throughput/batch_time_ms"] == pytest.approx(50.0)
    assert m["throughput/step_time_ms"] == pytest.approx(100.0)
    assert m["throughput/data_wait_share"] == pytest.approx(0.3)
    assert m["throughput/tflops_per_sec_per_device"] == pytest.approx(4e9 / train_s / 1e12)
    assert m["throughput/mfu"] == pytest.approx((4e9 / train_s) / 1e11)


def test_tokens_per_sec_logged_for_token_batches(tmp_path):
    cb = GoodputMonitor(every_n_steps=2, summary=False, plot=False)
    logger = CSVLogger(tmp_path, name="run")
    dm = SyntheticTokenDataModule(num_samples=64, seq_len=16, vocab_size=32, batch_size=8)
    fit(
        tmp_path,
        TinyGPT(vocab_size=32, seq_len=16, d_model=16, n_layers=1, n_heads=2),
        dm,
        [cb],
        max_steps=8,
        logger=logger,
    )
    r = cb.results
    assert r["throughput/tokens_per_sec"] == pytest.approx(16 * r["throughput/samples_per_sec"])
    assert r["throughput/steps_measured"] == 8 - cb.warmup_steps
    assert 0 < r["throughput/mfu"] < 1
    logger.save()
    rows = list(csv.DictReader(open(logger.log_dir + "/metrics.csv")))
    logged = [row for row in rows if row.get("throughput/samples_per_sec")]
    assert [int(row["step"]) for row in logged] == [2, 4, 6, 8, 8]  # every 2 optimizer steps, then the results


class SlowDataset(Dataset):
    def __init__(self, n: int = 48, delay_s: float = 0.025) -> None:
        self.n, self.delay_s = n, delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        time.sleep(self.delay_s)
        return torch.randn(16), torch.tensor(i % 4)


class SlowDataModule(SyntheticClassificationDataModule):
    def setup(self, stage=None):
        super().setup(stage)
        self.train_set = SlowDataset()


def test_slow_input_pipeline_is_detected_once_and_the_doctor_agrees(tmp_path):
    """The warning judges what the doctor's input rule judges (the whole run's data share, one threshold): a slow
    loader gets both, once; a fast one neither."""
    import warnings

    from lightning_accel.profile.rules import RunFacts, input_rule

    cb = GoodputMonitor(every_n_steps=2, summary=False, warmup_steps=1, plot=False)
    with pytest.warns(UserWarning, match=r"Input pipeline bound: \d+% of the run waited") as said:
        fit(tmp_path, MLPClassifier(input_dim=16), SlowDataModule(batch_size=4, input_dim=16), [cb], max_steps=10)
    assert len([w for w in said if "Input pipeline bound" in str(w.message)]) == 1
    # each batch sleeps 4 x 25 ms; the step itself takes a few ms, so even a loaded machine stays above half
    assert cb.results["throughput/data_wait_share"] > 0.5
    assert input_rule(RunFacts(cb.results, {})) is not None
    fast = GoodputMonitor(every_n_steps=2, summary=False, warmup_steps=1, plot=False)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        fit(
            tmp_path / "fast",
            MLPClassifier(input_dim=16),
            SyntheticClassificationDataModule(batch_size=4, input_dim=16),
            [fast],
            max_steps=10,
        )
    quiet = not any("Input pipeline bound" in str(w.message) for w in said)
    assert quiet == (input_rule(RunFacts(fast.results, {})) is None)  # whatever this machine measured, they agree


def test_dense_gpu_peaks_by_reported_name():
    from lightning_accel.monitor.peaks import gpu_peak_flops

    # what torch.cuda.get_device_name() returns on each
    assert gpu_peak_flops("NVIDIA H200", torch.bfloat16) == 989.4e12  # Lightning's table has no match for it
    assert gpu_peak_flops("NVIDIA H200", torch.float32) == 66.9e12
    assert gpu_peak_flops("NVIDIA H200", torch.float32, tf32=True) == 494.7e12
    assert gpu_peak_flops("NVIDIA H200 NVL", torch.float16) == 835.5e12
    assert gpu_peak_flops("NVIDIA H100 NVL", torch.bfloat16) == 835.5e12  # Lightning: 1978.8e12, with sparsity
    assert gpu_peak_flops("AMD Instinct MI300X", torch.bfloat16) == 1307.4e12
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) is None  # left to Lightning (dense 989.4e12)
    assert gpu_peak_flops("NVIDIA H200", torch.float64) is None


def test_cpu_peak_estimate():
    from lightning_accel.monitor.peaks import cpu_flops_per_cycle

    per_cycle = cpu_flops_per_cycle()
    assert per_cycle in (8.0, 32.0, 64.0)
    assert cpu_peak_flops(num_cores=2, freq_mhz=3000.0) == 2 * 3e9 * per_cycle


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_utilization_without_nvml_logs_host_metrics_and_serves_prometheus(tmp_path):
    port = free_port()
    scraped: list[str] = []

    class Scrape(UtilizationMonitor):
        def on_train_end(self, trainer, pl_module):
            scraped.append(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode())

    cb = Scrape(every_n_seconds=0.0, prometheus=port, summary=False)
    logger = CSVLogger(tmp_path, name="util")
    fit(
        tmp_path,
        MLPClassifier(input_dim=16),
        SyntheticClassificationDataModule(num_samples=64, input_dim=16, batch_size=16),
        [cb],
        max_steps=3,
        logger=logger,
    )
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the NVML-absent path cannot be exercised here")
    assert cb.nvml is None  # closed at teardown
    assert set(cb.last) == {"host/cpu_pct", "host/ram_used_gib", "host/ram_total_gib", "host/process_rss_gib"}
    assert 0 < cb.last["host/process_rss_gib"] < cb.last["host/ram_total_gib"]
    assert sample(scraped[0], "lightning_accel_host_process_rss_gib", rank="0") > 0
    logger.save()
    rows = list(csv.DictReader(open(logger.log_dir + "/metrics.csv")))
    assert len([r for r in rows if r.get("host/cpu_pct")]) == 3
    with pytest.raises(OSError):  # the exporter was shut down with the run
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_nvml_reason_recorded_when_absent(tmp_path, caplog):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: NVML is expected to work")
    from lightning_accel.monitor.utilization import _NVML

    nvml = _NVML(None)
    assert not nvml.available and nvml.reason == "no CUDA device visible"


class FakeNVML:
    """Two physical GPUs; only the second one is visible to CUDA (CUDA_VISIBLE_DEVICES=1)."""

    def __init__(self, known_uuids: tuple[str, ...]) -> None:
        self.known = known_uuids

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        if uuid not in self.known:
            raise RuntimeError("NVML_ERROR_NOT_FOUND")
        return f"handle of {uuid}"

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return f"handle of physical GPU {index}"


def test_nvml_handle_follows_cuda_visible_devices_by_uuid(caplog):
    from lightning_accel.monitor.utilization import nvml_handle

    nv = FakeNVML(("GPU-aaaa", "GPU-bbbb"))
    # CUDA's device 0 is physical GPU 1 (uuid bbbb): the index alone would read the wrong GPU
    assert nvml_handle(nv, "bbbb", 0) == "handle of GPU-bbbb"
    assert nvml_handle(nv, "GPU-bbbb", 0) == "handle of GPU-bbbb"
    assert not caplog.records
    with caplog.at_level("WARNING"):
        assert nvml_handle(nv, "MIG-cccc", 0) == "handle of physical GPU 0"
    assert "NVML does not know CUDA device 0 by UUID MIG-cccc" in caplog.text


@requires_cuda
def test_nvml_reads_the_training_gpu(tmp_path):
    cb = UtilizationMonitor(every_n_seconds=0.0, summary=False)
    trainer = Trainer(**tiny_trainer_kwargs(tmp_path, callbacks=[cb], max_steps=3, accelerator="gpu"))
    trainer.fit(
        MLPClassifier(input_dim=16),
        datamodule=SyntheticClassificationDataModule(num_samples=64, input_dim=16, batch_size=16),
    )
    total_gib = torch.cuda.get_device_properties(trainer.strategy.root_device).total_memory / 2**30
    assert cb.last["gpu/memory_total_gib"] == pytest.approx(total_gib, rel=0.02)
    assert 0 < cb.last["gpu/memory_used_gib"] <= cb.last["gpu/memory_total_gib"]
    assert cb.last["gpu/power_w"] > 0 and 0 <= cb.last["gpu/utilization_pct"] <= 100
