"""Cloud preemption notices, against a metadata server on 127.0.0.1 that answers as each cloud documents: a notice
mid-run ends the run with a durable checkpoint before the deadline and exit 75, and the resume is bitwise exact."""

from __future__ import annotations

import logging
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import TensorDataset

import lightning_accel as la
from lightning_accel.checkpoint import Preempted
from lightning_accel.checkpoint.notices import (
    AwsSpot,
    AzureScheduledEvents,
    GcePreemption,
    NoticeWatcher,
    detect_cloud,
)
from tests.checkpoint.metadata_server import MetadataServer
from tests.conftest import tiny_trainer_kwargs


@pytest.fixture
def server():
    s = MetadataServer()
    yield s
    s.close()


def dmi(tmp_path: Path, **files: str) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (tmp_path / name).write_text(text + "\n")
    return tmp_path


def test_the_cloud_is_read_from_the_machines_dmi_data_only(tmp_path):
    assert detect_cloud(dmi(tmp_path / "aws", sys_vendor="Amazon EC2", product_name="m7i.large")) == "aws"
    assert detect_cloud(dmi(tmp_path / "aws-xen", sys_vendor="Xen", bios_vendor="Amazon EC2")) == "aws"
    assert detect_cloud(dmi(tmp_path / "gce", sys_vendor="Google", product_name="Google Compute Engine")) == "gce"
    azure = dmi(
        tmp_path / "az", sys_vendor="Microsoft Corporation", chassis_asset_tag="7783-7084-3265-9085-8269-3286-77"
    )
    assert detect_cloud(azure) == "azure"
    hyperv = dmi(tmp_path / "hv", sys_vendor="Microsoft Corporation", chassis_asset_tag="0000-0000")
    assert detect_cloud(hyperv) is None  # Hyper-V on premises: no Azure metadata server to ask
    assert detect_cloud(dmi(tmp_path / "laptop", sys_vendor="LENOVO")) is None
    assert detect_cloud(tmp_path / "missing") is None


def test_each_source_speaks_its_clouds_protocol(server):
    aws = AwsSpot(server.url)
    assert aws.check() is None and ("PUT", "/latest/api/token") in server.requests  # IMDSv2: token first
    aws._token = "expired"
    assert aws.check() is None  # a refused token is fetched again
    gce = GcePreemption(server.url, wait_s=5)
    assert gce.check() is None  # a plain read first, then long polls
    threading.Timer(0.3, server.post_notice, args=(60,)).start()
    started = time.monotonic()
    notice = gce.check()  # blocks until the flag flips
    assert notice is not None and notice.cloud == "gce" and 0.25 < time.monotonic() - started < 4
    assert any("wait_for_change=true" in path for _, path in server.requests)
    notice = aws.check()
    assert notice.cloud == "aws" and abs(notice.deadline - server.deadline) < 1.0 and "terminate" in notice.detail
    azure = AzureScheduledEvents(server.url)
    notice = azure.check()
    assert notice.event_id == "602d9444-d2cd-49c7-8624-8643e7171297" and abs(notice.deadline - server.deadline) < 1.0
    azure.acknowledge(notice)
    assert server.acks[0]["body"] == {"StartRequests": [{"EventId": "602d9444-d2cd-49c7-8624-8643e7171297"}]}


@pytest.mark.parametrize("source", [AwsSpot, GcePreemption, AzureScheduledEvents])
def test_5xx_and_unreadable_answers_are_logged_and_retried_never_raised(server, source, caplog):
    server.fail_next, server.garbage_next = 2, 1
    server.post_notice(60)
    with caplog.at_level(logging.WARNING, logger="lightning_accel.checkpoint.notices"):
        watcher = NoticeWatcher(source(server.url), interval_s=0.02).start()
        watcher._thread.join(timeout=10)
    assert watcher.notice is not None and watcher.errors == 3
    assert "answered 503; retrying" in caplog.text and (
        "not the documented JSON" in caplog.text or "MAYBE" in caplog.text
    )


def test_an_unreachable_endpoint_is_logged_once_and_costs_training_nothing(server, caplog):
    url = server.url
    server.close()  # nothing listens there any more
    with caplog.at_level(logging.WARNING, logger="lightning_accel.checkpoint.notices"):
        watcher = NoticeWatcher(AwsSpot(url, timeout_s=0.2), interval_s=0.02).start()
        time.sleep(0.5)
        watcher.stop()
    assert watcher.errors >= 3 and watcher.notice is None
    assert caplog.text.count("the metadata endpoint does not answer") == 1


class Net(LightningModule):
    """BatchNorm, Dropout, a scheduler; each step takes 20 ms so a notice lands mid-run."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.2), nn.Linear(16, 2))

    def training_step(self, batch, batch_idx):
        time.sleep(0.02)
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)]


class PostNoticeAt(Callback):
    def __init__(self, server: MetadataServer, step: int, seconds: float) -> None:
        self.server, self.step, self.seconds = server, step, seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and self.server.deadline is None:
            self.server.post_notice(self.seconds)


def fit(root: Path, extra: list[Callback], ckpt_path: str | None = None) -> Net:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(240, 8, generator=g), torch.randint(0, 2, (240,), generator=g))
    callbacks = [la.PreemptionCheckpoint(root / "ck"), *extra]
    trainer = Trainer(**tiny_trainer_kwargs(root, max_steps=30, callbacks=callbacks))
    model = Net()
    trainer.fit(model, la.ResumableDataLoader(data, batch_size=8, seed=0), ckpt_path=ckpt_path)
    return model


@pytest.mark.parametrize("cloud", ["aws", "gce", "azure"])
def test_a_notice_mid_run_saves_before_the_deadline_exits_75_and_resumes_bitwise(tmp_path, server, cloud):
    whole = fit(tmp_path / "whole", [])
    notices = la.PreemptionNotices(cloud, metadata_url=server.url, poll_s=0.02)
    with pytest.raises(Preempted) as stopped:
        fit(tmp_path / "cut", [notices, PostNoticeAt(server, step=5, seconds=60)])
    assert stopped.value.code == 75
    checkpoint = stopped.value.checkpoint
    assert checkpoint.exists() and Path(f"{checkpoint}.manifest.json").exists()  # durable, sealed
    assert 0 < notices.margin_s <= 60 and time.time() < server.deadline
    if cloud == "azure":
        (ack,) = server.acks
        assert ack["body"]["StartRequests"][0]["EventId"] == notices.watcher.notice.event_id
        assert ack["at"] >= checkpoint.stat().st_mtime  # acknowledged once the save was durable
    else:
        assert server.acks == []
    resumed = fit(tmp_path / "cut", [], ckpt_path=str(la.find_resume_checkpoint(tmp_path / "cut" / "ck")))
    for a, b in zip(whole.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_no_notice_no_save_and_off_cloud_no_thread(tmp_path, server):
    notices = la.PreemptionNotices("aws", metadata_url=server.url, poll_s=0.02)
    fit(tmp_path / "quiet", [notices])
    assert notices.watcher.notice is None  # no save on a notice: only the one that ends the fit
    assert [p.name for p in (tmp_path / "quiet" / "ck").glob("*.ckpt")] == ["step=00000030.ckpt"]
    off = la.PreemptionNotices("auto", dmi_dir=str(dmi(tmp_path / "dmi", sys_vendor="LENOVO")))
    before = threading.active_count()
    fit(tmp_path / "off", [off])
    assert off.watcher is None and threading.active_count() <= before
    assert not any(path for _, path in server.requests if "gce" in path)


def test_bad_settings_are_named(tmp_path):
    with pytest.raises(ValueError, match="cloud must be 'auto', None or one of \\['aws', 'azure', 'gce'\\], got 'ibm'"):
        la.PreemptionNotices("ibm")
    with pytest.raises(ValueError, match="poll_s must be > 0, got 0"):
        la.PreemptionNotices("aws", poll_s=0)
    trainer = Trainer(**tiny_trainer_kwargs(tmp_path, max_steps=1, callbacks=[la.PreemptionNotices("aws")]))
    with pytest.raises(ValueError, match="needs a PreemptionCheckpoint among the Trainer's callbacks"):
        trainer.fit(Net(), torch.utils.data.DataLoader(TensorDataset(torch.randn(8, 8), torch.zeros(8).long())))


def test_the_environment_overrides_dmi_and_our_tests_turn_clouds_off(tmp_path, monkeypatch):
    from lightning_accel.checkpoint.cloud_notices import cloud_from_env_or_dmi

    gce = str(dmi(tmp_path / "gce", sys_vendor="Google"))
    assert cloud_from_env_or_dmi(gce) is None  # conftest sets LIGHTNING_ACCEL_CLOUD=none for the whole suite
    monkeypatch.setenv("LIGHTNING_ACCEL_CLOUD", "")
    assert cloud_from_env_or_dmi(gce) == "gce"
    monkeypatch.setenv("LIGHTNING_ACCEL_CLOUD", "Azure")
    assert cloud_from_env_or_dmi(gce) == "azure"
    monkeypatch.setenv("LIGHTNING_ACCEL_CLOUD", "oracle")
    with pytest.raises(ValueError, match="LIGHTNING_ACCEL_CLOUD='oracle': use one of"):
        cloud_from_env_or_dmi(gce)


class PostNotice(Callback):
    """For the CLI: posts a notice to the metadata server at ``url`` once global step ``step`` is done."""

    def __init__(self, url: str, step: int, seconds: float = 60.0) -> None:
        self.url, self.step, self.seconds = url, step, seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            request = urllib.request.Request(f"{self.url}/test/notice?seconds={self.seconds}", method="POST")
            urllib.request.urlopen(request, timeout=5).close()


def test_the_cli_stops_on_a_notice_and_ckpt_path_auto_resumes_bitwise(tmp_path, server):
    from lightning_accel.recipe import build_cli

    root = Path(__file__).resolve().parents[2]

    def cli(folder: Path, *extra: str):
        args = ["fit", "--config", str(root / "recipes/mlp_cpu.yaml"), "--trainer.enable_progress_bar", "false"]
        args += ["--trainer.max_epochs", "1", "--trainer.default_root_dir", str(folder)]
        args += [
            "--trainer.callbacks+=lightning_accel.PreemptionCheckpoint",
            f"--trainer.callbacks.dirpath={folder}/ck",
        ]
        return build_cli([*args, *extra, "--ckpt_path", "auto"])

    whole = cli(tmp_path / "whole")
    notices = ["--trainer.callbacks+=lightning_accel.PreemptionNotices", "--trainer.callbacks.cloud=aws"]
    notices += [f"--trainer.callbacks.metadata_url={server.url}", "--trainer.callbacks.poll_s=0.01"]
    post = ["--trainer.callbacks+=tests.checkpoint.test_notices.PostNotice", f"--trainer.callbacks.url={server.url}"]
    with pytest.raises(Preempted) as stopped:
        cli(tmp_path / "cut", *notices, *post, "--trainer.callbacks.step=3")
    assert stopped.value.code == 75 and stopped.value.checkpoint.exists()
    resumed = cli(tmp_path / "cut")
    assert resumed.trainer.global_step == whole.trainer.global_step == 32
    for a, b in zip(whole.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)
