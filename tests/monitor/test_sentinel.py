"""HangSentinel: a stuck rank is found within its allowance, named, its stacks dumped, and the job exits with
HANG_EXIT_CODE so torchrun restarts it; a balanced run raises nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel import PreemptionCheckpoint
from lightning_accel.checkpoint import Preempted
from lightning_accel.monitor import HANG_EXIT_CODE, HangSentinel
from tests.conftest import SigtermAt, requires_cuda, tiny_trainer_kwargs

SCRIPT = Path(__file__).parent / "hang_run.py"
ROOT = Path(__file__).parents[2]


@pytest.fixture
def job_tmp():
    """The job's temporary folder (the sentinel's node folders meet there). A short path of its own: loader workers
    hand batches over through a Unix socket under it, whose path may have 107 bytes. Under tmp_path the path reached
    108 once pytest's folders were numbered from pytest-100 on, and every first batch waited forever (ci44, and two
    runs of five in a row here): lightning_accel/data/worker_handoff.py now refuses such a folder before training."""
    folder = Path(tempfile.mkdtemp(prefix="sentinel-job-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def torchrun(out: Path, tmp: Path, mode: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *extra, str(SCRIPT), str(out), mode]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**os.environ, "TMPDIR": str(tmp)})
    except subprocess.TimeoutExpired as timeout:  # show what the job printed before it stopped answering
        output = (timeout.stdout or b"").decode(errors="replace") + (timeout.stderr or b"").decode(errors="replace")
        raise AssertionError(f"{mode}: the job did not end in 180 s; its output:\n{output[-6000:]}") from None


def dumps(folder: Path) -> str:
    """The stack dumps in ``folder``, for a failure's message: a restarted attempt that hangs again overwrites the
    first attempt's, and its loader workers' show where they are (ci44: rank 0's worker gave no batch for 60 s)."""
    return "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in sorted(folder.glob("*.txt")))


@pytest.mark.multiprocess
def test_a_rank_stuck_in_its_loader_worker_is_named_dumped_and_the_job_exits_in_seconds(tmp_path, job_tmp):
    """Rank 1's loader worker blocks in __getitem__; the case of a rank stuck in its own training_step is the
    first attempt of the restart test below."""
    mode, phase = "loader", "data"
    result = torchrun(tmp_path, job_tmp, mode)
    ended = time.time()
    output = result.stdout + result.stderr
    assert result.returncode != 0
    # torchrun's root cause is our code; the agent ends its other worker at the first failure, so whether the
    # second rank's own 76 is listed too depends on which exits first
    root_cause = output[output.index("Root Cause") :]
    assert f"exitcode  : {HANG_EXIT_CODE}" in root_cause, output[-3000:]
    for rank in (0, 1):
        assert f"HangSentinel (rank {rank}): hang found: rank 1 (host" in output
    hang_started = float((tmp_path / f"hang-started-{mode}").read_text())
    assert ended - hang_started < 3 + 12  # floor_s=3 plus polling, the dumps and torchrun's teardown
    report = json.loads((tmp_path / "ck" / "hang" / "report.json").read_text())
    assert report["stuck_ranks"] == [1]
    stuck = next(b for b in report["beats"] if b["rank"] == 1)
    assert stuck["phase"] == phase and stuck["batches"] == 12 and stuck["allowance_s"] == 3.0
    stacks = (tmp_path / "ck" / "hang" / "rank1.stacks.txt").read_text()
    assert stacks.startswith("rank 1, host ") and "Thread" in stacks
    assert (tmp_path / "ck" / "hang" / "rank0.stacks.txt").exists()
    assert "in _next_data" in stacks  # the main thread waits for its worker ...
    workers = (tmp_path / "ck" / "hang" / "rank1.children.stacks.txt").read_text()
    assert "in sleep_forever" in workers and "in __getitem__" in workers  # ... which shows where it is stuck
    assert not list(tmp_path.glob("done-rank*.json"))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_torchrun_restarts_a_hung_job_from_its_last_checkpoint_and_it_finishes(tmp_path, job_tmp):
    """Rank 1 sleeps inside training_step at step 12 in the first attempt: named in forward, its stack shows the
    line; both ranks exit 76, torchrun restarts the job, which resumes from step 10 and finishes."""
    result = torchrun(tmp_path, job_tmp, "step", "--max-restarts", "1")
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:] + dumps(tmp_path / "ck" / "hang")
    report = json.loads((tmp_path / "ck" / "hang" / "report.json").read_text())
    assert report["stuck_ranks"] == [1]
    stuck = next(b for b in report["beats"] if b["rank"] == 1)
    assert stuck["phase"] == "forward" and stuck["batches"] == 12
    stacks = (tmp_path / "ck" / "hang" / "rank1.stacks.txt").read_text()
    assert "in sleep_forever" in stacks and "in training_step" in stacks  # the line the rank is stuck on
    assert f"exitcode: {HANG_EXIT_CODE}" in result.stderr or f"exitcode  : {HANG_EXIT_CODE}" in result.stderr
    for rank in range(2):
        done = json.loads((tmp_path / f"done-rank{rank}.json").read_text())
        assert done == {"global_step": 30, "resumed_from": str(tmp_path / "ck" / "step=00000010.ckpt"), "report": False}
    # the finished attempt's ranks removed their node's folder (the hung attempt's may stay: a rank ended on a hang
    # never leaves it); a folder that stayed holds the beats of the ranks as they were, none finished
    beats = [json.loads(p.read_text()) for p in job_tmp.glob("lightning_accel-sentinel-*/node0/beat-*.json")]
    assert len(beats) <= 2 and all(b["phase"] != "finished" for b in beats), beats


class Sleepy(LightningModule):
    """BatchNorm and validation; training_step sleeps at step 6 until the sentinel has reported (exit_on_hang
    is off, so the test's own process is not ended)."""

    def __init__(self, sentinel: HangSentinel) -> None:
        super().__init__()
        self.sentinel = sentinel
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        while self.global_step == 6 and self.sentinel.report is None:
            time.sleep(0.05)
        return self.net(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.log("v", self.net(batch[0]).mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_one_process_hang_is_reported_with_its_stack_and_allowances_follow_measured_times(tmp_path):
    sentinel = HangSentinel(factor=4, floor_s=0.5, startup_s=30, poll_s=0.05, exit_on_hang=False, dirpath=tmp_path)
    data = DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=4)
    callbacks = [sentinel, PreemptionCheckpoint(tmp_path / "ck", every_n_steps=2)]
    trainer = Trainer(
        **tiny_trainer_kwargs(tmp_path, max_steps=8, val_check_interval=4, limit_val_batches=2, callbacks=callbacks)
    )
    # a process of the user's own (a server started with subprocess): the dump signal is for loader workers only
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    started = time.monotonic()
    try:
        trainer.fit(Sleepy(sentinel), data, data)
        assert bystander.poll() is None, "the hang dump ended a child process that is no loader worker"
    finally:
        bystander.kill()
    assert time.monotonic() - started < 10
    report = sentinel.report
    assert report is not None and report.stuck_ranks == [0] and report.missing_ranks == []
    (beat,) = report.beats
    assert beat["phase"] == "forward" and beat["batches"] == 6 and beat["allowance_s"] == 0.5  # tiny steps: floor
    stacks = (tmp_path / "hang" / "rank0.stacks.txt").read_text()
    assert "in training_step" in stacks
    assert len(sentinel._allowance.times["save"]) == 4  # steps 2, 4, 6 and 8, each timed apart from its batch
    assert len(sentinel._allowance.times["validation"]) == 2 * 2  # two validations of two batches
    assert len(sentinel._allowance.times["train"]) == 8


def test_allowances_start_generous_then_follow_the_median_and_bad_settings_are_named():
    sentinel = HangSentinel(factor=10, floor_s=1, startup_s=600)
    sentinel._reset(Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False))
    assert sentinel.allowance_s() == 600.0  # no batch measured yet: the first compile and collectives
    sentinel._allowance.times["train"].extend([0.2, 0.3, 5.0])  # one slow outlier leaves the median alone
    assert sentinel.allowance_s() == pytest.approx(3.0)
    sentinel._phase = "checkpoint"
    assert sentinel.allowance_s() == 600.0  # no save measured yet
    sentinel._allowance.times["save"].extend([0.05, 2.0])
    assert sentinel.allowance_s() == pytest.approx(20.0)  # the longest save, times the factor
    for kwargs, message in (
        ({"factor": 0}, "factor must be > 0, got 0"),
        ({"floor_s": -1}, "floor_s must be > 0, got -1"),
        ({"startup_s": 0}, "startup_s must be > 0, got 0"),
        ({"poll_s": 0}, "poll_s must be > 0, got 0"),
    ):
        with pytest.raises(ValueError, match=message):
            HangSentinel(**kwargs)


class SlowSave(Callback):
    """Each checkpoint save takes 0.6 s, longer than a training step's allowance (floor_s=0.3)."""

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        time.sleep(0.6)


class Quick(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.1), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.01)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=3)]


def test_slow_checkpoint_saves_get_their_own_allowance_and_raise_no_alarm(tmp_path):
    """Saves every 3 steps that take 0.6 s, 6x a step's 0.3 s allowance: the first is covered by startup_s, the
    later ones by factor x the longest save measured; the step allowance never includes a save."""
    sentinel = HangSentinel(factor=4, floor_s=0.3, startup_s=30, poll_s=0.05, exit_on_hang=False, dirpath=tmp_path)
    callbacks = [sentinel, SlowSave(), PreemptionCheckpoint(tmp_path / "ck", every_n_steps=3)]
    trainer = Trainer(**tiny_trainer_kwargs(tmp_path, max_steps=12, accumulate_grad_batches=2, callbacks=callbacks))
    trainer.fit(Quick(), DataLoader(TensorDataset(torch.randn(96, 4)), batch_size=4))
    assert sentinel.report is None and not (tmp_path / "hang").exists()
    # steps 3, 6, 9 and 12 (the last one timed by on_train_end, where the rank enters "finished")
    assert len(sentinel._allowance.times["save"]) == 4 and min(sentinel._allowance.times["save"]) >= 0.6
    assert max(sentinel._allowance.times["train"]) < 0.6  # no batch was charged a save


@requires_cuda
def test_on_a_gpu_the_nccl_flight_recorder_is_dumped_beside_the_stacks(tmp_path):
    """One GPU, NCCL: rank 0 of 1 sleeps in training_step; the hang folder gets NCCL's flight recorder too."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", str(SCRIPT), str(tmp_path), "step"]
    env = {**os.environ, "HANG_RANK": "0", "DEVICES": "1", "ACCELERATOR": "gpu"}
    env["TORCH_NCCL_TRACE_BUFFER_SIZE"] = "2000"  # the recorder keeps nothing unless given a buffer
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    output = result.stdout + result.stderr
    assert f"exitcode  : {HANG_EXIT_CODE}" in output, output[-3000:]
    assert "in sleep_forever" in (tmp_path / "hang" / "rank0.stacks.txt").read_text()
    assert (tmp_path / "hang" / "rank0.nccl_flight_recorder.pkl").stat().st_size > 0


def test_a_preemption_caught_in_a_notebook_leaves_no_watchdog_behind(tmp_path):
    """Lightning runs no teardown hook after an exception: the sentinel stops its watchdog in on_exception, so
    the idle kernel afterwards is not taken for a hang (which would end it with exit 76)."""
    sentinel = HangSentinel(floor_s=0.2, startup_s=30, poll_s=0.02, dirpath=tmp_path)
    callbacks = [sentinel, PreemptionCheckpoint(tmp_path / "ck"), SigtermAt(3)]
    trainer = Trainer(**tiny_trainer_kwargs(tmp_path, max_steps=20, callbacks=callbacks))
    with pytest.raises(Preempted):
        trainer.fit(Quick(), DataLoader(TensorDataset(torch.randn(96, 4)), batch_size=4))
    assert sentinel._thread is None
    time.sleep(0.5)  # well past the allowance: a live watchdog would have reported (and exited the process)
    assert sentinel.report is None and not (tmp_path / "hang").exists()


def test_work_after_the_last_step_is_never_taken_for_a_hang(tmp_path):
    """An export in on_train_end 10x longer than the step allowance (a final upload to a bucket does the same): the
    rank is finished, so no hang is found; its last beat, published as the watchdog stops, says so."""

    class SlowExport(Callback):
        def on_train_end(self, trainer, pl_module):
            time.sleep(1.5)

    sentinel = HangSentinel(factor=2, floor_s=0.15, startup_s=30, poll_s=0.05, exit_on_hang=False, dirpath=tmp_path)
    trainer = Trainer(**tiny_trainer_kwargs(tmp_path, max_steps=6, callbacks=[SlowExport(), sentinel]))
    trainer.fit(Quick(), DataLoader(TensorDataset(torch.randn(96, 4)), batch_size=4))
    assert sentinel.report is None and not (tmp_path / "hang").exists()
    assert sentinel.beat().phase == "finished" and sentinel.beat().allowance_s == float("inf")


def test_a_childs_dump_is_read_once_it_has_stopped_growing_not_after_a_fixed_wait():
    """Loader workers write their stacks from their own signal handlers, whenever a busy machine schedules them: the
    sentinel reads the shared file once it has stopped growing (a fixed 0.5 s once cut a dump after its first
    line), and gives up on an empty one at the limit."""
    import tempfile
    import threading

    from lightning_accel.monitor.sentinel import _wait_until_quiet

    with tempfile.TemporaryFile() as dump:

        def slow_child() -> None:
            for line in range(8):
                time.sleep(0.1)
                os.write(dump.fileno(), f"frame {line}\n".encode())

        writer = threading.Thread(target=slow_child)
        started = time.monotonic()
        writer.start()
        _wait_until_quiet(dump, quiet_s=0.5, limit_s=10)
        dump.seek(0)
        read = dump.read().decode().splitlines()  # what the sentinel reads when the wait returns
        assert read == [f"frame {line}" for line in range(8)]
        assert time.monotonic() - started >= 0.8 + 0.5  # every line, then the quiet time
        writer.join()
    with tempfile.TemporaryFile() as empty:
        started = time.monotonic()
        _wait_until_quiet(empty, quiet_s=0.1, limit_s=0.4)
        assert 0.4 <= time.monotonic() - started < 2  # nobody wrote: the limit, not forever
