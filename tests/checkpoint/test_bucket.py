"""Checkpoints in a bucket: against moto's real S3 API server on 127.0.0.1 (tests.helpers.object_stores.py).

What a spot fleet relies on: SIGTERM gives exit 75 only with the checkpoint in the store; an empty machine resumes
from the bucket bitwise; kill -9 during an upload resumes from the newest complete checkpoint; an outage loses
nothing; retention deletes in the bucket; bad URLs and unreachable stores are refused before any training.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import fsspec
import pytest
import s3fs
import torch
from lightning.pytorch import Callback, Trainer

from lightning_accel import GoodputMonitor, PreemptionCheckpoint, find_resume_checkpoint
from lightning_accel.checkpoint import bucket as bucket_module
from lightning_accel.checkpoint.durable import MANIFEST_SUFFIX
from lightning_accel.profile import load_run
from lightning_accel.storage import StoreError, UnsupportedStorageError
from tests.checkpoint.train_bucket import BucketNet, loaders
from tests.conftest import tiny_trainer_kwargs

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests/checkpoint/train_bucket.py"


def direct(proxy) -> fsspec.AbstractFileSystem:
    """The test's own client of the server, past the proxy: it sees the bucket while the run's connections are cut."""
    return fsspec.filesystem("s3", endpoint_url=proxy.target_url)


def objects(bucket: str, prefix: str = "run", proxy=None) -> list[str]:
    # (a client of its own: the test may have cut the shared one's pooled connections through the proxy)
    fs = direct(proxy) if proxy is not None else fsspec.filesystem("s3", skip_instance_cache=True)
    fs.invalidate_cache()
    try:
        return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{bucket}/{prefix}", detail=False))
    except FileNotFoundError:
        return []


def start(url: str, out: Path, cwd: Path, cache: Path, *extra: str) -> subprocess.Popen:
    """The training script in its own working folder and node cache: a machine of its own."""
    env = {**os.environ, "LIGHTNING_ACCEL_CACHE_DIR": str(cache)}
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), "--url", url, "--out", str(out), *extra],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def wait_until(check, proc: subprocess.Popen, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended ({proc.returncode}) before {what}:\n{proc.stdout.read()[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"not reached in {timeout} s: {what}")


def step_of(progress: Path) -> int:
    text = progress.read_text().strip() if progress.exists() else ""
    return int(text) if text else -1


def assert_bitwise(a: Path, b: Path) -> None:
    wa, wb = torch.load(a), torch.load(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), f"{key} differs"


@pytest.mark.multiprocess
def test_sigterm_exits_75_with_the_checkpoint_in_the_bucket_and_empty_machines_resume_bitwise(
    bucket, s3_server, tmp_path
):
    """One run through a spot fleet's life, each attempt on an empty machine (its own working folder and cache):
    SIGTERM -> exit 75 with the checkpoint in the bucket; a resume killed with -9 while its upload hangs -> the next
    resumes from the newest complete checkpoint; the run ends bitwise equal to an uninterrupted one."""
    url = f"s3://{bucket}/run"
    reference = start(f"s3://{bucket}/reference", tmp_path / "ref.pt", tmp_path / "m0", tmp_path / "c0")
    code, out = finish(reference)
    assert code == 0, out[-3000:]

    progress = tmp_path / "progress"
    slow = ("--progress", str(progress), "--step-delay", "0.1")
    first = start(url, tmp_path / "a.pt", tmp_path / "m1", tmp_path / "c1", *slow)
    wait_until(lambda: step_of(progress) >= 6, first, "step 6")
    first.send_signal(signal.SIGTERM)
    code, out = finish(first)
    first_out = out
    assert code == 75, out[-3000:]
    names = objects(bucket)
    saved = [n for n in names if n.endswith(".ckpt")]
    assert saved and all(n + MANIFEST_SUFFIX in names for n in saved), names  # every checkpoint with its manifest
    newest = max(saved)
    assert f"preempted: saved {url}/{newest}" in out, out[-2000:]  # exit 75 names the checkpoint in the store
    assert not (tmp_path / "m1" / "s3:").exists()  # nothing written to a local folder named after the URL

    # an empty machine resumes; its periodic upload hangs (the proxy takes the connection, answers nothing), and
    # the machine is killed with -9 while that upload is in flight
    progress.unlink()
    second = start(url, tmp_path / "b.pt", tmp_path / "m2", tmp_path / "c2", "--resume", *slow)
    second_start = int(newest.split("=")[1].split(".")[0])
    wait_until(lambda: step_of(progress) > second_start, second, "the first resumed step")
    s3_server.stall()
    wait_until(lambda: step_of(progress) >= second_start + 9, second, "two periodic saves past the stall")
    staged = sorted((tmp_path / "c2").rglob("step=*.ckpt"))
    assert staged and staged[-1].name not in objects(bucket, proxy=s3_server)  # written locally, not in the store
    second.kill()
    second.wait()
    s3_server.restore()
    complete = max(n for n in objects(bucket) if n.endswith(".ckpt") and n + MANIFEST_SUFFIX in objects(bucket))

    third = start(url, tmp_path / "c.pt", tmp_path / "m3", tmp_path / "c3", "--resume")
    code, out = finish(third)
    assert code == 0, out[-3000:]
    assert f"resuming from {tmp_path / 'c3'}" in out and complete in out.split("resuming from")[1].splitlines()[0]
    assert_bitwise(tmp_path / "c.pt", tmp_path / "ref.pt")
    # keep_last=2 in the bucket: the run's last two (the periodic one at 28, and the fit's end at 30), with manifests
    final = [n for n in objects(bucket) if n.endswith(".ckpt")]
    assert final == ["step=00000028.ckpt", "step=00000030.ckpt"], f"{final}\n{first_out[-3000:]}\n{out[-4000:]}"


class OutageAt(Callback):
    """Refuses connections to the store from the start of step ``cut`` until step ``back``, and at ``back`` until an
    upload has met the outage (a fast fit could otherwise pass the window before the upload thread tries)."""

    def __init__(self, proxy, cut: int, back: int) -> None:
        self.proxy, self.cut, self.back = proxy, cut, back

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.cut and self.proxy.mode == "forward":
            self.proxy.refuse()
        if trainer.global_step == self.back and self.proxy.mode != "forward":
            checkpoint = next(c for c in trainer.callbacks if isinstance(c, PreemptionCheckpoint))
            outage = checkpoint.destination.publisher.outage
            deadline = time.monotonic() + 60
            while outage.since is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert outage.since is not None, "no upload met the outage within 60 s"
            self.proxy.restore()


def fit(
    url: str, tmp_path: Path, *callbacks: Callback, max_steps: int = 12, ckpt_path: str | None = None, **ckpt_kwargs
) -> PreemptionCheckpoint:
    torch.manual_seed(0)
    ckpt = PreemptionCheckpoint(url, **{"every_n_steps": 2, "keep_last": 2, **ckpt_kwargs})
    trainer = Trainer(**tiny_trainer_kwargs(tmp_path, max_steps=max_steps, callbacks=[ckpt, *callbacks]))
    train, _ = loaders()
    model = BucketNet()
    trainer.fit(model, train_dataloaders=train, ckpt_path=ckpt_path)
    ckpt.weights = {k: v.clone() for k, v in model.state_dict().items()}  # type: ignore[attr-defined]
    return ckpt


def test_an_outage_mid_run_loses_nothing_and_is_logged_once(bucket, s3_server, tmp_path, caplog, monkeypatch):
    """The proxy refuses connections for steps 3-8: training goes on, the store is named once when it stops
    answering and once when it answers again, every checkpoint reported is in the store, and the fit's last
    checkpoint reaches the bucket before fit() returns."""
    monkeypatch.setattr(bucket_module, "RETRY_BACKOFF_S", (0.05, 0.4))
    url = f"s3://{bucket}/run"
    with caplog.at_level(logging.WARNING, logger="lightning_accel"):
        ckpt = fit(url, tmp_path, OutageAt(s3_server, 3, 8), keep_last=None)
    warnings = [r.getMessage() for r in caplog.records if "object store" in r.getMessage()]
    assert len([w for w in warnings if "did not answer" in w]) == 1, warnings
    assert len([w for w in warnings if "answers again" in w]) == 1, warnings
    names = objects(bucket)
    assert all(u.rsplit("/", 1)[-1] in names for u in ckpt.durable)  # nothing reported that is not in the store
    assert ckpt.durable[-1] == f"{url}/step=00000012.ckpt"  # the last checkpoint made it
    assert "step=00000012.ckpt" + MANIFEST_SUFFIX in names
    assert find_resume_checkpoint(url).endswith("step=00000012.ckpt")


def test_retention_deletes_in_the_bucket_and_never_another_runs_checkpoints(
    bucket, s3_server, tmp_path, monkeypatch, caplog
):
    url = f"s3://{bucket}/run"
    fs = fsspec.filesystem("s3")
    foreign = f"{bucket}/run/step=00000003.ckpt"  # another run's checkpoint in the same folder
    fs.pipe_file(foreign, b"x" * 10)
    fs.pipe_file(foreign + MANIFEST_SUFFIX, json.dumps({"run_id": "someone-else", "global_step": 3}).encode())
    # the parts of a multipart upload a killed process left behind: aborted at the next fit start
    fs.call_s3("create_multipart_upload", Bucket=bucket, Key="run/step=00000099.ckpt")
    assert fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix="run").get("Uploads")
    with caplog.at_level(logging.INFO, logger="lightning_accel"):
        ckpt = fit(url, tmp_path, GoodputMonitor(summary=False, plot=False), max_steps=10)
    assert not fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix="run").get("Uploads")
    # moto does not check the CRC32 it is sent: found at fit start, said once, and its ETags confirm the uploads
    said = [r.getMessage() for r in caplog.records if "does not check the CRC32" in r.getMessage()]
    assert len(said) == 1 and "confirmed by the MD5 in the store's ETag" in said[0], said
    names = objects(bucket)
    assert not [n for n in names if "probe" in n]  # the fit start's probes leave nothing behind
    ours = [n for n in names if n.endswith(".ckpt") and n != "step=00000003.ckpt"]
    assert ours == ["step=00000008.ckpt", "step=00000010.ckpt"], names
    assert "step=00000003.ckpt" in names and "step=00000003.ckpt" + MANIFEST_SUFFIX in names
    # in order, ending with the last two; an earlier one may be skipped when uploads fall two behind (a busy
    # machine): retention would delete it at once (test_uploads_that_fall_behind_skip_what_retention_would_delete)
    durable = [u.rsplit("/", 1)[-1] for u in ckpt.durable]
    steps = [f"step={s:08d}.ckpt" for s in (2, 4, 6, 8, 10)]
    assert durable[-2:] == steps[-2:] and durable == [n for n in steps if n in durable], durable
    # the local staging folder keeps only the newest
    assert [p.name for p in ckpt.local_dir.glob("step=*.ckpt")] == ["step=00000010.ckpt"]
    # the run's files go beside its checkpoints, and the doctor reads them from the bucket on an empty machine
    assert {"goodput.json", "goodput_progress.json"} <= set(names)
    monkeypatch.setenv("LIGHTNING_ACCEL_CACHE_DIR", str(tmp_path / "doctor-machine"))
    goodput, _ = load_run(url)
    assert goodput["goodput/restarts"] == 0 and goodput["goodput/total_s"] > 0 and goodput["precision"] == "32-true"


def test_bad_urls_and_unreachable_stores_are_refused_before_any_training(
    bucket, s3_server, tmp_path, monkeypatch, caplog
):
    with pytest.raises(UnsupportedStorageError, match=r"foo://.*no storage backend.*s3://, gs:// or az://"):
        PreemptionCheckpoint("foo://bucket/run")
    with pytest.raises(UnsupportedStorageError, match=r"oci:// backend is not installed. Fix: install"):
        PreemptionCheckpoint("oci://bucket@namespace/run")
    steps = []

    class Count(Callback):
        def on_train_batch_start(self, *args):
            steps.append(1)

    with pytest.raises(StoreError, match=r"cannot write to s3://no-such-bucket-here/run.*bucket exists"):
        fit("s3://no-such-bucket-here/run", tmp_path, Count())
    monkeypatch.setattr(bucket_module, "PROBE_TIMEOUT_S", 2.0)
    with s3_server.refused(), pytest.raises(StoreError, match=rf"cannot write to s3://{bucket}/run.*AWS_ENDPOINT_URL"):
        with caplog.at_level(logging.WARNING, logger="lightning_accel"):
            fit(f"s3://{bucket}/run", tmp_path, Count())
    assert not [r for r in caplog.records if "could not fetch" in r.getMessage()]  # one outage, said once
    # a malformed endpoint: botocore refuses it when a client is built, and that is said as the store's error too
    monkeypatch.setenv("AWS_ENDPOINT_URL", "not a url")
    s3fs.S3FileSystem.clear_instance_cache()
    with pytest.raises(StoreError, match=rf"cannot write to s3://{bucket}/run: .*Invalid endpoint: not a url"):
        fit(f"s3://{bucket}/run", tmp_path, Count())
    assert steps == []  # refused at fit start: no step trained, nothing to lose
    assert not list(Path.cwd().glob("s3:*")) and not list(tmp_path.glob("s3:*"))


def test_a_recipe_with_a_bucket_dirpath_resumes_through_ckpt_path_auto(bucket, s3_server, tmp_path, caplog):
    """``lightning-accel fit --config recipe.yaml --ckpt_path auto`` where the recipe's PreemptionCheckpoint names
    an s3:// dirpath: the second command resumes from the bucket's newest checkpoint (in this process: the CLI's
    own code path, without a subprocess's start-up)."""
    from lightning_accel.recipe import build_cli

    url = f"s3://{bucket}/cli"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"""
seed_everything: 3
trainer:
  accelerator: cpu
  devices: 1
  logger: false
  enable_progress_bar: false
  enable_model_summary: false
  limit_val_batches: 0
  default_root_dir: {tmp_path}
  callbacks:
    - class_path: lightning_accel.PreemptionCheckpoint
      init_args: {{dirpath: "{url}", every_n_steps: 3}}
model: {{class_path: tests.checkpoint.train_bucket.BucketNet}}
data: {{class_path: tests.checkpoint.train_bucket.BucketData}}
"""
    )
    first = build_cli(["fit", "--config", str(recipe), "--trainer.max_steps", "6", "--ckpt_path", "auto"])
    assert first.trainer.global_step == 6
    assert [n for n in objects(bucket, "cli") if n.endswith(".ckpt")] == ["step=00000003.ckpt", "step=00000006.ckpt"]
    with caplog.at_level(logging.INFO, logger="lightning_accel"):
        second = build_cli(["fit", "--config", str(recipe), "--trainer.max_steps", "9", "--ckpt_path", "auto"])
    resumed = [r.getMessage() for r in caplog.records if "ckpt_path=auto" in r.getMessage()]
    assert len(resumed) == 1 and resumed[0].endswith("step=00000006.ckpt"), resumed
    assert second.trainer.global_step == 9
    assert "step=00000009.ckpt" + MANIFEST_SUFFIX in objects(bucket, "cli")


def test_a_folder_that_cannot_be_written_is_refused_at_fit_start(tmp_path):
    """A checkpoint folder that cannot be created (here under a file; a read-only mount fails the same way) is one
    line at fit start naming it and the fix, not a traceback at the first save after training for a while."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    steps = []

    class Count(Callback):
        def on_train_batch_start(self, *args):
            steps.append(1)

    with pytest.raises(OSError, match=r"cannot write checkpoints to .*a-file/ckpt.*Fix: give dirpath a folder"):
        fit(str(blocker / "ckpt"), tmp_path, Count())
    assert steps == []


def test_checkpoints_in_azure_blob_storage_resume_bitwise_on_an_empty_machine(azure_container, tmp_path, monkeypatch):
    """``az://`` through adlfs against Azurite (Microsoft's emulator) on 127.0.0.1: checkpoints every 2 steps with
    keep_last=2 land in the container (each confirmed by Azure's Content-MD5 before its manifest), and a fit resumed
    from the container on an empty machine ends bitwise equal to an uninterrupted one."""
    url = f"az://{azure_container}/run-{os.getpid()}"
    monkeypatch.setenv("LIGHTNING_ACCEL_CACHE_DIR", str(tmp_path / "machine-1"))
    first = fit(url, tmp_path, max_steps=6)
    durable = [u.rsplit("/", 1)[-1] for u in first.durable]  # (step 2 left out if uploads fell two behind)
    assert durable in ([f"step={s:08d}.ckpt" for s in steps] for steps in ((2, 4, 6), (4, 6))), durable
    fs = fsspec.filesystem("az")
    fs.invalidate_cache()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(url.removeprefix("az://"), detail=False))
    assert names == [f"step={s:08d}.ckpt{m}" for s in (4, 6) for m in ("", MANIFEST_SUFFIX)]
    monkeypatch.setenv("LIGHTNING_ACCEL_CACHE_DIR", str(tmp_path / "machine-2"))
    found = find_resume_checkpoint(url)
    assert found.startswith(str(tmp_path / "machine-2" / "downloads")) and found.endswith("step=00000006.ckpt")
    resumed = fit(url, tmp_path, max_steps=10, ckpt_path=found)
    whole = fit(str(tmp_path / "local"), tmp_path, max_steps=10)
    assert all(torch.equal(resumed.weights[k], v) for k, v in whole.weights.items())


def test_a_final_upload_that_misses_the_deadline_keeps_the_previous_checkpoint_and_says_so(
    bucket, s3_server, tmp_path, caplog
):
    """The store stops answering (the proxy holds connections) just before SIGTERM: the final upload cannot finish
    inside the 4 s grace period, so after 2 s (the grace period less the exit's margin) the run stops with exit 75
    naming the previous checkpoint, which is the bucket's newest complete one; the error line gives the numbers."""
    url = f"s3://{bucket}/run"

    class CutThenSignal(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 5:
                ckpt = next(c for c in trainer.callbacks if isinstance(c, PreemptionCheckpoint))
                deadline = time.monotonic() + 30
                while not ckpt.durable and time.monotonic() < deadline:  # step 4 in the store first
                    time.sleep(0.01)
                s3_server.stall()
                os.kill(os.getpid(), signal.SIGTERM)

    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="lightning_accel"), pytest.raises(SystemExit) as exit_info:
        fit(url, tmp_path, CutThenSignal(), every_n_steps=4, grace_period_s=4.0)
    waited = time.monotonic() - started
    s3_server.restore()
    assert exit_info.value.code == 75 and exit_info.value.checkpoint == f"{url}/step=00000004.ckpt"
    missed = [r.getMessage() for r in caplog.records if "did not reach" in r.getMessage()]
    assert len(missed) == 1 and "step=6" in missed[0] and "the bucket keeps step=4" in missed[0], missed
    assert waited < 4.0 + 3  # stopped inside the grace period (plus the fit's own start-up)
    complete = [n for n in objects(bucket, proxy=s3_server) if n.endswith(MANIFEST_SUFFIX)]
    assert complete == ["step=00000004.ckpt" + MANIFEST_SUFFIX]
    assert find_resume_checkpoint(url).endswith("step=00000004.ckpt")


def test_the_first_save_that_would_not_fit_the_grace_period_warns_with_the_bandwidth(bucket, s3_server, tmp_path):
    from lightning_accel.checkpoint.bucket import BucketPublisher, Publication

    publisher = BucketPublisher(f"s3://{bucket}/run", keep_last=2, grace_period_s=30)
    slow = Publication(tmp_path / "step=00000004.ckpt", 4, staged_s=12.0, upload_s=20.0, bytes=400_000_000)
    with pytest.warns(UserWarning, match=r"12\.0 s to local disk and 20\.0 s to upload 400\.0 MB .*20\.0 MB/s.*30 s"):
        publisher._warn_if_slow(slow)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        publisher._warn_if_slow(slow)  # once per fit
        BucketPublisher(f"s3://{bucket}/run", keep_last=2, grace_period_s=60)._warn_if_slow(slow)  # it fits


def _find_in_a_rank(url: str, cache: str, ready, results) -> None:
    """One rank of a node on an empty machine: every rank of the node asks at the same moment."""
    os.environ["LIGHTNING_ACCEL_CACHE_DIR"] = cache
    ready.wait(timeout=60)
    results.put((cache, find_resume_checkpoint(url)))


def test_ranks_of_a_node_download_and_verify_the_checkpoint_once_per_node(bucket, s3_server, tmp_path, monkeypatch):
    """Four ranks of node A and two of node B (each node its own cache) look for the bucket's newest checkpoint at
    the same moment, as the ranks of a resumed job do: each node downloads it once (one GET of the checkpoint per
    node, the others wait on the node's lock and take its verdict), and every rank gets the node's verified copy."""
    import multiprocessing

    from lightning_accel.checkpoint import bucket_resume
    from lightning_accel.checkpoint.atomic import atomic_save

    url = f"s3://{bucket}/run"
    staged = tmp_path / "staged"
    for step in (4, 8):
        path = staged / f"step={step:08d}.ckpt"
        atomic_save({"global_step": step, "w": torch.full((64,), float(step))}, path, {"global_step": step})
        fs = fsspec.filesystem("s3")
        fs.put_file(str(path), f"{bucket}/run/{path.name}")
        fs.put_file(str(path) + MANIFEST_SUFFIX, f"{bucket}/run/{path.name}{MANIFEST_SUFFIX}")  # manifest last
    log = tmp_path / "downloads.log"
    real = bucket_resume.download

    def counted(fs, remote, local, size=None):
        with open(log, "a") as f:  # O_APPEND: one whole line per write, whichever process writes it
            f.write(f"{local.parents[2].name} {remote.rsplit('/', 1)[-1]}\n")
        return real(fs, remote, local, size)

    monkeypatch.setattr(bucket_resume, "download", counted)  # inherited by the forked ranks
    context = multiprocessing.get_context("fork")
    nodes = {"node-a": 4, "node-b": 2}
    ready, results = context.Barrier(sum(nodes.values())), context.Queue()
    ranks = [
        context.Process(target=_find_in_a_rank, args=(url, str(tmp_path / node), ready, results))
        for node, count in nodes.items()
        for _ in range(count)
    ]
    for rank in ranks:
        rank.start()
    found = [results.get(timeout=120) for _ in ranks]
    for rank in ranks:
        rank.join(timeout=30)
        assert rank.exitcode == 0
    for node in nodes:
        (copy,) = {path for cache, path in found if cache == str(tmp_path / node)}  # one copy a node
        assert copy.startswith(str(tmp_path / node / "downloads")) and copy.endswith("step=00000008.ckpt")
    got = sorted(log.read_text().splitlines())
    newest = "step=00000008.ckpt"
    assert got == sorted(f"{node} {name}" for node in nodes for name in (newest, newest + MANIFEST_SUFFIX)), got
    for _, path in found:
        assert torch.equal(torch.load(path, weights_only=True)["w"], torch.full((64,), 8.0))


def _staged(folder: Path, step: int, run_id: str = "run-a") -> Path:
    from lightning_accel.checkpoint.atomic import atomic_save

    path = folder / f"step={step:08d}.ckpt"
    atomic_save({"w": torch.full((64,), float(step))}, path, {"global_step": step, "run_id": run_id}, fsync=False)
    return path


@pytest.mark.parametrize(
    ("keep_last", "newest_first", "uploaded"),
    [
        (2, False, [1, 4, 5]),  # 2 and 3 have two newer ones behind them: retention would delete them at once
        (3, False, [1, 3, 4, 5]),
        (None, False, [1, 2, 3, 4, 5]),  # keep every checkpoint: every one goes up
        (None, True, [1, 5]),  # a preemption: the newest goes next
    ],
)
def test_uploads_that_fall_behind_skip_what_retention_would_delete_and_the_bucket_ends_the_same(
    bucket, s3_server, tmp_path, monkeypatch, caplog, keep_last, newest_first, uploaded
):
    """Five checkpoints are queued while the first is still uploading (the store holds its answer): the ones with
    keep_last newer ones behind them are not uploaded, the bucket ends with what uploading all of them and pruning
    would leave, the staging folder with the newest only, and each skip is said with the reason."""
    import threading

    from lightning_accel.checkpoint.bucket import BucketPublisher

    holding, release, sent = threading.Event(), threading.Event(), []
    real_upload = bucket_module.upload

    def held_upload(fs, local, remote, *args):
        if local.name == "step=00000001.ckpt":
            holding.set()
            assert release.wait(30)
        if remote.endswith(".ckpt"):
            sent.append(int(local.name[5:13]))
        return real_upload(fs, local, remote, *args)

    monkeypatch.setattr(bucket_module, "upload", held_upload)
    publisher = BucketPublisher(f"s3://{bucket}/run", keep_last=keep_last, grace_period_s=30)
    publisher.check_writable("run-a")
    staging = tmp_path / "staging"
    with caplog.at_level(logging.INFO, logger="lightning_accel"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        publisher.submit(_staged(staging, 1), 1, None, 0.0)
        assert holding.wait(30)  # step 1 is uploading
        for step in range(2, 6):
            publisher.submit(_staged(staging, step), step, None, 0.0)
        if newest_first:
            publisher.prefer_newest()
        release.set()
        assert publisher.wait(time.monotonic() + 60)
        publisher.close()
    # a backlog retention thins is said once, with what a machine lost without warning would lose; a preemption's
    # own choice is not a backlog
    behind = [str(w.message) for w in caught if "fall behind the saves" in str(w.message)]
    thinned = len(uploaded) < 5 and not newest_first
    assert len(behind) == thinned, behind
    assert not thinned or "newer checkpoints were saved while step=2 waited" in behind[0]
    assert not thinned or "loses the work since the newest checkpoint in the store" in behind[0]
    assert sent == uploaded
    assert [p.step for p in publisher.durable] == uploaded
    kept = sorted(n for n in objects(bucket) if n.endswith(".ckpt"))
    expected = [5, 4, 3, 2, 1][:keep_last] if keep_last else uploaded
    assert kept == sorted(f"step={s:08d}.ckpt" for s in expected)
    assert find_resume_checkpoint(f"s3://{bucket}/run").endswith("step=00000005.ckpt")
    assert [p.name for p in staging.glob("step=*.ckpt")] == ["step=00000005.ckpt"]
    skipped = [r.getMessage() for r in caplog.records if "is not uploaded" in r.getMessage()]
    assert len(skipped) == 5 - len(uploaded), skipped
    reason = "a preemption: the newest goes first" if newest_first else f"keep_last={keep_last} would delete it"
    assert all(reason in line for line in skipped), skipped


def test_fit_start_fetches_run_files_and_aborts_stale_uploads_beside_the_probe_and_again_if_that_failed(
    bucket, s3_server, tmp_path, monkeypatch, caplog
):
    """Fit start waits on the store once: the run's files come down, and the multipart uploads a killed process
    left are aborted, while the probe runs. Either one that failed while the probe got through (after retries) is
    done again once the store answers, so an empty machine still gets its files and no stale parts stay behind."""
    import threading

    from lightning_accel.checkpoint import destination as destination_module
    from lightning_accel.checkpoint.bucket import BucketPublisher
    from lightning_accel.checkpoint.destination import Destination

    fs = fsspec.filesystem("s3")
    fs.pipe_file(f"{bucket}/run/goodput_progress.json", b'{"step": 7}')
    fs.call_s3("create_multipart_upload", Bucket=bucket, Key="run/step=00000099.ckpt")
    tried: dict[str, list[str]] = {"fetch": [], "abort": []}

    def first_fails(kind, real):
        def call(*args, **kwargs):
            tried[kind].append(threading.current_thread().name)
            if len(tried[kind]) == 1:
                raise ConnectionError("the store did not answer yet")
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(destination_module, "download_tree", first_fails("fetch", destination_module.download_tree))
    monkeypatch.setattr(bucket_module, "abort_stale_uploads", first_fails("abort", bucket_module.abort_stale_uploads))
    destination = Destination(f"s3://{bucket}/run")
    destination.publisher = BucketPublisher(destination.url, keep_last=2, grace_period_s=30)
    with caplog.at_level(logging.WARNING, logger="lightning_accel"):
        assert destination._probe_and_fetch("run-a") is None
    assert tried["fetch"][0].startswith("accel-fetch") and tried["fetch"][1] == "MainThread", tried
    assert tried["abort"][0].startswith("accel-stale") and tried["abort"][1] == "MainThread", tried
    assert (destination.local_dir / "goodput_progress.json").read_bytes() == b'{"step": 7}'
    assert not fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix="run").get("Uploads")
    assert not [r for r in caplog.records if "could not fetch" in r.getMessage()]


def test_retention_runs_beside_the_next_upload_and_waiting_for_the_uploads_waits_for_it(
    bucket, s3_server, tmp_path, monkeypatch
):
    """The delete of a checkpoint a newer one replaced does not hold the next upload back (it goes after the newer
    one is confirmed, as before), and :meth:`wait`, which the end of a fit calls, returns only once it is done."""
    import threading

    from lightning_accel.checkpoint.bucket import BucketPublisher

    deleting, release = threading.Event(), threading.Event()
    real_remove = bucket_module.remove_objects

    def held_remove(fs, paths):
        deleting.set()
        assert release.wait(30)
        return real_remove(fs, paths)

    monkeypatch.setattr(bucket_module, "remove_objects", held_remove)
    publisher = BucketPublisher(f"s3://{bucket}/run", keep_last=1, grace_period_s=30)
    publisher.check_writable("run-a")
    staging = tmp_path / "staging"
    publisher.submit(_staged(staging, 1), 1, None, 0.0).future.result(30)
    publisher.submit(_staged(staging, 2), 2, None, 0.0).future.result(30)
    assert deleting.wait(30)  # step 1's delete has begun, and is held
    publisher.submit(_staged(staging, 3), 3, None, 0.0).future.result(30)  # step 3 goes up meanwhile
    assert [p.step for p in publisher.durable] == [1, 2, 3]
    assert "step=00000001.ckpt" in objects(bucket)  # not deleted yet
    waited = threading.Thread(target=publisher.wait)
    waited.start()
    waited.join(0.5)
    assert waited.is_alive()  # the wait includes retention
    release.set()
    waited.join(30)
    assert not waited.is_alive()
    assert sorted(n for n in objects(bucket) if n.endswith(".ckpt")) == ["step=00000003.ckpt"]
    publisher.close()


def test_a_fit_whose_uploads_fall_behind_ends_with_its_newest_checkpoints_and_resumes_bitwise(
    bucket, s3_server, tmp_path, monkeypatch, caplog
):
    """The store holds its answer to the first upload until training has ended (a slow link) while a checkpoint is
    saved every 2 steps with keep_last=2: steps 4-8 are left out (logged), 10 and 12 go up, the bucket ends with
    them, and a resume from the bucket on an empty machine ends bitwise equal to an uninterrupted fit."""
    import threading

    holding, trained, real_upload = threading.Event(), threading.Event(), bucket_module.upload

    def held_upload(fs, local, remote, *args):
        if local.name == "step=00000002.ckpt":
            holding.set()
            assert trained.wait(60)
        return real_upload(fs, local, remote, *args)

    class TrainingEnds(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 2:  # step 2's upload is under way before step 4's save can queue behind it
                assert holding.wait(30)

        def on_train_end(self, trainer, pl_module):
            trained.set()

    monkeypatch.setattr(bucket_module, "upload", held_upload)
    url = f"s3://{bucket}/run"
    with caplog.at_level(logging.INFO, logger="lightning_accel"), pytest.warns(UserWarning, match="fall behind"):
        first = fit(url, tmp_path, TrainingEnds(), max_steps=12)
    assert [u.rsplit("/", 1)[-1] for u in first.durable] == [f"step={s:08d}.ckpt" for s in (2, 10, 12)]
    skipped = [r.getMessage() for r in caplog.records if "is not uploaded" in r.getMessage()]
    assert [line.split()[1] for line in skipped] == ["step=4", "step=6", "step=8"], skipped
    assert sorted(n for n in objects(bucket) if n.endswith(".ckpt")) == ["step=00000010.ckpt", "step=00000012.ckpt"]
    monkeypatch.setenv("LIGHTNING_ACCEL_CACHE_DIR", str(tmp_path / "empty-machine"))
    found = find_resume_checkpoint(url)
    assert found.endswith("step=00000012.ckpt")
    resumed = fit(url, tmp_path, max_steps=16, ckpt_path=found)
    whole = fit(str(tmp_path / "local"), tmp_path, max_steps=16)
    assert all(torch.equal(resumed.weights[k], v) for k, v in whole.weights.items())
