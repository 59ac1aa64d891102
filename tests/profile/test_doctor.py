"""TorchProfiler and the bottleneck doctor: traces on disk, findings that name the real bottleneck and its fix."""

from __future__ import annotations

import gzip
import json
import sys
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch.utils.data import DataLoader, Dataset

import lightning_accel as la
from lightning_accel.phases import phase_of
from lightning_accel.profile import Finding, diagnose, load_run
from lightning_accel.profile.gpu_trace import hta_breakdown
from lightning_accel.profile.rules import HOST_SHARE
from tests.conftest import requires_cuda, tiny_trainer_kwargs

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "lightning_accel.cli"]
KINDS = {
    "input",
    "checkpoint",
    "validation",
    "host_overhead",
    "sync",
    "pageable_copy",
    "low_utilization",
    "precision",
    "memory_headroom",
    "straggler",
    "cost",
    "compute",
}


def goodput(**shares: float) -> dict:
    full = {f"goodput/{b}_share": 0.0 for b in ("data", "transfer", "compute", "checkpoint", "validation", "other")}
    full.update({f"goodput/{k}_share": v for k, v in shares.items()})
    return {**full, "device": "cpu", "precision": "32-true"}


def kinds(findings: list[Finding]) -> list[str]:
    return [f.kind for f in findings]


def test_each_kind_is_raised_by_its_evidence_and_ranked_by_share():
    # a starved input pipeline with slow saves: input first, checkpoint second, each with its fix
    findings = diagnose(goodput(data=0.5, checkpoint=0.2, compute=0.25, other=0.05))
    assert kinds(findings)[:2] == ["input", "checkpoint"]
    assert findings[0].share == 0.5 and "num_workers" in findings[0].fix and "DALIImageDataModule" in findings[0].fix
    assert "async_save=True" in findings[1].fix
    # the same wait on reads from a bucket (GoodputMonitor records the DataModule's URL): the remote-read fixes
    remote = diagnose({**goodput(data=0.5, compute=0.5), "data_source": "s3://bucket/train"})[0]
    assert remote.kind == "input" and "reads from s3://bucket/train" in remote.fix
    assert all(word in remote.fix for word in ("prefetch_queue_depth", "num_threads", "local cache"))
    assert diagnose(goodput(validation=0.3, compute=0.6))[0].kind == "validation"
    # nothing dominates: compute, with its share
    assert kinds(diagnose(goodput(compute=0.9, other=0.05))) == ["compute"]
    # many small ops for a short step: host overhead, with compile as the fix
    host = diagnose(goodput(compute=0.8), {"aten_ops_per_step": 2000, "step_s": 0.02})
    assert host[0].kind == "host_overhead" and host[0].share == pytest.approx(0.5)
    assert "TorchCompile" in host[0].fix
    # a GPU run in fp32 with syncs, pageable copies, an idle GPU and half-empty memory
    gpu = {**goodput(compute=0.7, other=0.1), "device": "cuda:0"}
    profile = {
        "step_s": 0.1,
        "device_busy_s_per_step": 0.06,
        "sync_calls_per_step": {"cudaStreamSynchronize": 3.0},
        "pageable_copies_per_step": 2.0,
        "pageable_copy_s_per_step": 0.005,
        "memory_peak_gib": 20.0,
        "memory_total_gib": 140.0,
    }
    found = {f.kind: f for f in diagnose(gpu, profile)}
    assert {"sync", "pageable_copy", "low_utilization", "precision", "memory_headroom"} <= set(found)
    assert found["low_utilization"].share == pytest.approx(0.4)
    assert found["pageable_copy"].share == pytest.approx(0.05) and "pin_memory=True" in found["pageable_copy"].fix
    assert found["precision"].share == pytest.approx(0.35) and "bf16-mixed" in found["precision"].fix
    assert "5.6x larger" in found["memory_headroom"].fix
    assert ".item()" in found["sync"].fix
    assert set(found) | {"input", "checkpoint", "validation", "host_overhead", "straggler", "cost", "compute"} == KINDS
    # the same on a CPU: no GPU-only findings (CUDA syncs without a read in the model's code cannot happen there)
    assert not {"sync", "low_utilization", "precision"} & set(kinds(diagnose(goodput(compute=0.7), profile)))
    # HolisticTraceAnalysis's idle share, where it read the trace, is the utilization
    hta = diagnose(gpu, {**profile, "hta": {"gpu_idle_share": 0.25, "kernel_type_share": {"COMPUTATION": 0.9}}})
    low = next(f for f in hta if f.kind == "low_utilization")
    assert low.share == pytest.approx(0.25) and low.evidence["kernel_type_share"] == {"COMPUTATION": 0.9}


def test_a_straggling_rank_is_named_with_what_to_check():
    slow = {**goodput(compute=0.8), "goodput/straggler_ratio": 1.5, "goodput/slowest_rank": 3.0}
    (finding,) = [f for f in diagnose(slow) if f.kind == "straggler"]
    assert finding.share == pytest.approx(1 - 1 / 1.5) and finding.evidence["slowest_rank"] == 3
    assert finding.fix.startswith("Rank 3 spends 1.50x the other ranks' median time") and "host's load" in finding.fix
    named = {**slow, "goodput/straggler_rank": 3.0, "straggler_host": "node-7"}
    (finding,) = [f for f in diagnose(named) if f.kind == "straggler"]
    assert finding.fix.startswith("Rank 3 (host node-7) spends 1.50x") and finding.evidence["host"] == "node-7"
    balanced = {**goodput(compute=0.8), "goodput/straggler_ratio": 1.1, "goodput/slowest_rank": 0.0}
    assert "straggler" not in kinds(diagnose(balanced))  # under 1.2x: noise between ranks, not a straggler
    spread = {**slow, "goodput/straggler_rank": -1.0}  # 1.5x, but within the other ranks' own spread (MADs)
    assert "straggler" not in kinds(diagnose(spread))


class SlowData(Dataset):
    def __len__(self) -> int:
        return 400

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.004)
        return torch.randn(32)


class Starved(BoringModel):
    def train_dataloader(self):
        return DataLoader(SlowData(), batch_size=4)


def test_profiled_run_with_a_slow_loader_is_diagnosed_as_input(tmp_path):
    profiler = la.TorchProfiler(wait=2, warmup=1, active=3)
    monitor = la.GoodputMonitor(every_n_steps=5, summary=False, run_dir=tmp_path)
    Trainer(**tiny_trainer_kwargs(tmp_path, max_steps=12, callbacks=[monitor, profiler])).fit(Starved())
    traces = list((tmp_path / "profile").glob("rank0.*.pt.trace.json.gz"))
    assert len(traces) == 1
    events = json.loads(gzip.decompress(traces[0].read_bytes()))["traceEvents"]
    assert any(e.get("name", "").startswith("ProfilerStep") for e in events)  # Perfetto / TensorBoard readable
    summary = json.loads((tmp_path / "profile" / "profile_summary.json").read_text())
    assert summary["steps"] == 3 and summary["aten_ops_per_step"] > 10 and summary["step_s"] > 0.016
    assert summary == profiler.summary
    goodput_results, loaded = load_run(tmp_path)
    assert loaded == summary and goodput_results["goodput/data_share"] > 0.4
    top = diagnose(tmp_path)[0]
    assert top.kind == "input" and top.share == goodput_results["goodput/data_share"]


def profiled_fit(tmp_path: Path, model, steps: int = 14, active: int = 6) -> list[Finding]:
    """Fit ``model`` with the goodput ledger and a profiling window, return the doctor's findings on the run."""
    callbacks = [
        la.GoodputMonitor(every_n_steps=5, summary=False, plot=False, run_dir=tmp_path),
        la.TorchProfiler(wait=steps - active - 2, warmup=1, active=active),
    ]
    trainer = Trainer(**tiny_trainer_kwargs(tmp_path, max_steps=steps, callbacks=callbacks))
    before = trainer.profiler
    trainer.fit(model)
    assert trainer.profiler is before  # both wrappers taken out again, whichever tore down first
    return diagnose(tmp_path)


class ReadsLoss(BoringModel):
    """The classic: ``loss.item()`` in every training step (on a GPU, a full sync each time)."""

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.last_loss = out["loss"].item()
        return out

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)  # Adam reads its own step counters: not the model's


def test_item_in_training_step_is_a_sync_finding_counted_per_step(tmp_path):
    found = {f.kind: f for f in profiled_fit(tmp_path, ReadsLoss())}
    sync = found["sync"]
    assert sync.evidence["host_reads_per_step"] == {"forward": 1.0}
    assert sync.share == 0.0 and "count only" in sync.evidence["measured"]  # on a CPU: a count, not a stall
    assert "1 tensor(s)" in sync.fix and ".item()" in sync.fix
    summary = json.loads((tmp_path / "profile" / "profile_summary.json").read_text())
    assert summary["item_calls_per_step"] > 1  # Adam's own reads are there too, outside the model's phases
    assert "sync" not in kinds(profiled_fit(tmp_path / "clean", BoringModel()))  # SGD, no reads: no finding


class TinyMLP(BoringModel):
    """Batch 1 through a small MLP: microseconds of math per op, so the host's per-op work dominates."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Sequential(*(m for _ in range(4) for m in (torch.nn.Linear(32, 32), torch.nn.ReLU())))
        self.head = torch.nn.Linear(32, 2)

    def forward(self, x):
        return self.head(self.layer(x))

    def train_dataloader(self):
        return DataLoader(RandomDataset(32, 400), batch_size=1)


class Heavy(BoringModel):
    """Wide matmuls at a large batch, fed from memory: the math dominates."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Sequential(torch.nn.Linear(32, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024))
        self.head = torch.nn.Linear(1024, 2)
        self.data = torch.randn(512, 32)

    def forward(self, x):
        return self.head(self.layer(x))

    def train_dataloader(self):
        return DataLoader(torch.utils.data.TensorDataset(self.data.repeat(40, 1)), batch_size=512)

    def training_step(self, batch, batch_idx):
        return super().training_step(batch[0], batch_idx)


def test_tiny_model_at_batch_one_is_host_overhead_and_a_heavy_one_is_compute(tmp_path):
    host = profiled_fit(tmp_path / "tiny", TinyMLP())
    assert host[0].kind == "host_overhead", host
    assert host[0].evidence["step_ops_per_step"] > 50
    # the fix follows the evidence: many ops for a short step name compile; on a loaded machine the step is longer
    # and the same ops a smaller share of it (the rule's arithmetic, tested exactly in test_rules_*)
    assert ("TorchCompile" in host[0].fix) == (host[0].evidence["est_dispatch_share"] > HOST_SHARE), host[0]
    heavy = profiled_fit(tmp_path / "heavy", Heavy(), steps=10, active=4)
    assert heavy[0].kind == "compute", heavy
    assert all(f.share <= 0.10 for f in heavy[1:]), heavy  # nothing else over its threshold
    assert heavy[0].share > 0.7


def test_hta_reads_gpu_kernels_from_a_trace_and_says_when_there_are_none(tmp_path, caplog):
    # A CPU trace of ours: HTA parses it, finds no kernels, and the doctor says so instead of failing.
    Trainer(**tiny_trainer_kwargs(tmp_path, max_steps=6, callbacks=[la.TorchProfiler(wait=1, warmup=1, active=2)])).fit(
        BoringModel()
    )
    with caplog.at_level("WARNING", logger="lightning_accel.profile.gpu_trace"):
        assert hta_breakdown(tmp_path / "profile") is None
    assert "could not read GPU kernels" in caplog.text
    # Kineto's GPU events (as on the H200): two 100 us kernels 50 us apart, one 50 us copy: HTA's numbers
    # come through exactly.
    gpu = tmp_path / "gpu"
    gpu.mkdir()
    events = [
        {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur,
         "args": {"device": 0, "stream": 7, "correlation": i, "External id": i}}
        for i, (name, ts, dur) in enumerate(
            [("ampere_sgemm_128x64_nn", 1000, 100), ("Memcpy HtoD (Pageable -> Device)", 1100, 50),
             ("ampere_sgemm_128x64_nn", 1200, 100)], 1
        )
    ]  # fmt: skip
    trace = {"schemaVersion": 1, "distributedInfo": {"rank": 0}, "traceEvents": events}
    (gpu / "rank0.1.pt.trace.json").write_text(json.dumps(trace))
    got = hta_breakdown(gpu)
    assert got is not None
    assert got["gpu_idle_share"] == pytest.approx(50 / 300, abs=1e-4)
    assert got["gpu_compute_share"] == pytest.approx(200 / 300, abs=1e-4)
    assert got["kernel_time_s"] == pytest.approx(300e-6)


def test_profiler_overhead_is_left_out_of_the_ledger(tmp_path):
    monitor = la.GoodputMonitor(every_n_steps=5, summary=False, plot=False, run_dir=tmp_path)
    start = time.perf_counter()
    Trainer(
        **tiny_trainer_kwargs(tmp_path, max_steps=8, callbacks=[monitor, la.TorchProfiler(wait=1, warmup=1, active=3)])
    ).fit(BoringModel())
    wall = time.perf_counter() - start
    # exporting the trace takes a good part of this tiny run; it is in neither `other` nor any bucket
    assert monitor.results["goodput/total_s"] < wall
    assert monitor.results["goodput/other_share"] < 0.6


def test_short_run_warns_that_the_window_never_closed(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="lightning_accel.profile.torch_profiler"):
        Trainer(**tiny_trainer_kwargs(tmp_path, max_steps=3, callbacks=[la.TorchProfiler(wait=5)])).fit(BoringModel())
    assert "before the window of 12" in caplog.text
    assert not (tmp_path / "profile" / "profile_summary.json").exists()


def test_bad_windows_and_missing_runs_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="active must be >= 1, got 0"):
        la.TorchProfiler(active=0)
    with pytest.raises(FileNotFoundError, match="GoodputMonitor"):
        load_run(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_run(tmp_path / "nope")


def test_ranges_cover_the_step_phases():
    assert phase_of("[_TrainingEpochLoop].train_dataloader_next") == "data"
    assert phase_of("[Strategy]DDPStrategy.batch_to_device") == "transfer"
    assert phase_of("[Strategy]DDPStrategy.training_step") == "forward"
    assert phase_of("[Strategy]DDPStrategy.backward") == "backward"
    assert phase_of("[LightningModule]MyModel.optimizer_step") == "optimizer"
    assert phase_of("save_checkpoint") == "checkpoint"
    assert phase_of("[Callback]X.on_train_batch_end") is None


class PageableReads(ReadsLoss):
    """On a GPU: a small model, batches copied from pageable memory, and the loss read back every step."""

    def __init__(self, pin_memory: bool = False) -> None:
        super().__init__()
        self.pin_memory = pin_memory

    def train_dataloader(self):
        return DataLoader(RandomDataset(32, 4000), batch_size=64, pin_memory=self.pin_memory)


@requires_cuda
def test_gpu_doctor_measures_syncs_pageable_copies_and_idle_time(tmp_path):
    """The GPU-only kinds from a real CUDA trace (run by benchmarks/gpu_check.sh on the H200)."""
    run = tmp_path / "slow"
    callbacks = [
        la.GoodputMonitor(every_n_steps=5, summary=False, plot=False, run_dir=run),
        la.TorchProfiler(wait=10, warmup=1, active=5),
    ]
    Trainer(**tiny_trainer_kwargs(tmp_path, accelerator="gpu", max_steps=18, callbacks=callbacks)).fit(PageableReads())
    goodput_results, summary = load_run(run)
    found = {f.kind: f for f in diagnose(goodput_results, summary)}
    assert {"sync", "pageable_copy", "low_utilization", "precision", "memory_headroom"} <= set(found), found
    assert summary["host_reads_per_step"].get("forward") == 1.0
    assert sum(summary["sync_calls_per_step"].values()) >= 1  # the .item() waits for the stream
    assert found["sync"].share > 0 and "measured" not in found["sync"].evidence  # a stall on a GPU, not a count
    assert summary["pageable_copies_per_step"] >= 1
    assert found["low_utilization"].share > 0.1  # a 32-wide model leaves an H200 idle
    if summary.get("hta") is not None:  # HolisticTraceAnalysis read the CUDA trace
        assert 0 < summary["hta"]["gpu_idle_share"] < 1 and summary["hta"]["kernel_type_share"]
    # pinned batches: the pageable copies are gone
    pinned = tmp_path / "pinned"
    callbacks = [
        la.GoodputMonitor(every_n_steps=5, summary=False, plot=False, run_dir=pinned),
        la.TorchProfiler(wait=10, warmup=1, active=5),
    ]
    Trainer(**tiny_trainer_kwargs(tmp_path, accelerator="gpu", max_steps=18, callbacks=callbacks)).fit(
        PageableReads(pin_memory=True)
    )
    assert "pageable_copy" not in kinds(diagnose(pinned))


class CheckpointHeavy(BoringModel):
    def train_dataloader(self):
        return DataLoader(RandomDataset(32, 400), batch_size=2)


def run_command(argv: list[str], capsys) -> tuple[int | str | None, str, str]:
    """``lightning-accel ARGV`` through the CLI's main() in this process: exit code, stdout, stderr."""
    from lightning_accel.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


@pytest.mark.slow
def test_doctor_command_on_a_run_that_saves_every_step(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    callbacks = [
        la.GoodputMonitor(every_n_steps=5, summary=False, run_dir=run),
        la.PreemptionCheckpoint(dirpath=run / "ckpt", every_n_steps=1, keep_last=1),
    ]
    Trainer(**tiny_trainer_kwargs(tmp_path, max_steps=20, callbacks=callbacks)).fit(CheckpointHeavy())
    monkeypatch.setenv("COLUMNS", "200")
    code, out, err = run_command(["doctor", str(run)], capsys)
    assert code == 0, err[-2000:]
    assert "checkpoint" in out and "async_save=True" in out
    report = (run / "doctor.md").read_text()
    assert report.splitlines()[4].startswith("| 1 | `checkpoint` |")
    assert (run / "doctor.png").stat().st_size > 10_000
    assert json.loads((run / "doctor.json").read_text())[0]["kind"] == "checkpoint"
    code, _, err = run_command(["doctor", str(tmp_path / "nope")], capsys)
    assert code == 2 and "does not exist" in err


@pytest.mark.slow
def test_profile_command_profiles_a_recipe_and_prints_the_doctor(tmp_path, capsys, monkeypatch):
    out = tmp_path / "prof"
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.chdir(tmp_path)
    argv = ["profile", "--config", str(ROOT / "recipes/mlp_cpu.yaml"), "--out", str(out), "--wait", "2"]
    code, stdout, err = run_command([*argv, "--active", "3", "--trainer.enable_progress_bar", "false"], capsys)
    assert code in (0, None), err[-3000:]
    assert "lightning-accel doctor" in stdout
    assert (out / "goodput.json").is_file() and (out / "profile" / "profile_summary.json").is_file()
    findings = json.loads((out / "doctor.json").read_text())
    assert findings and {f["kind"] for f in findings} <= KINDS


def test_checkpoints_and_lost_work_that_cost_too_much_are_named_in_dollars():
    priced = {**goodput(compute=0.8), "cost/total_usd": 40.0, "cost/checkpoint_usd": 3.0, "cost/lost_usd": 2.0}
    (finding,) = [f for f in diagnose(priced) if f.kind == "cost"]
    assert finding.share == pytest.approx(5 / 40) and finding.evidence == {
        "checkpoint_usd": 3.0,
        "lost_usd": 2.0,
        "total_usd": 40.0,
    }
    assert finding.fix.startswith(
        "Checkpoint saves cost $3.00 and work redone after restarts $2.00: 12% of the run's $40.00"
    )
    cheap = {**priced, "cost/checkpoint_usd": 1.0, "cost/lost_usd": 2.0}  # 7.5%: under the 10% threshold
    assert "cost" not in kinds(diagnose(cheap))
    assert "cost" not in kinds(diagnose(goodput(compute=0.8)))  # no price, no finding
