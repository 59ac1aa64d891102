"""Preemption-safe checkpointing: SIGTERM mid-epoch then resume equals an uninterrupted run, bit for bit."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer

from lightning_accel.checkpoint import (
    PREEMPTED_EXIT_CODE,
    AtomicCheckpointIO,
    CorruptCheckpointError,
    PreemptionCheckpoint,
    atomic_save,
    find_resume_checkpoint,
    preemption,
    verify,
)
from lightning_accel.demos import MLPClassifier, SyntheticClassificationDataModule
from tests.conftest import tiny_trainer_kwargs

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests/checkpoint/train_resumable.py"


def run_script(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout
    )


def start_script(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def start_training(ckpts: Path, out: Path, progress: Path, step_delay: float, *extra: str) -> subprocess.Popen:
    """A training run that reports its step in ``progress`` and sleeps ``step_delay`` per step (to be signalled)."""
    return start_script(
        "--ckpt-dir",
        str(ckpts),
        "--out",
        str(out),
        "--progress",
        str(progress),
        "--step-delay",
        str(step_delay),
        *extra,
    )


def wait_for_step(progress: Path, step: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"run ended early ({proc.returncode}):\n{proc.stdout.read()[-3000:]}")
        text = progress.read_text().strip() if progress.exists() else ""
        if text and int(text) >= step:
            return
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached in {timeout}s")


@pytest.fixture(scope="module")
def reference_weights(tmp_path_factory):
    """The uninterrupted run's final weights on 1 or 2 ranks, trained once for the module: how often and how it saves
    (async or not, every N steps) does not change what it trains."""
    made: dict[int, Path] = {}

    def weights(devices: int) -> Path:
        if devices not in made:
            folder = tmp_path_factory.mktemp(f"reference{devices}")
            ref = run_script(
                "--ckpt-dir", str(folder / "ck"), "--out", str(folder / "ref.pt"), "--devices", str(devices)
            )
            assert ref.returncode == 0, ref.stderr[-3000:]
            made[devices] = folder / "ref.pt"
        return made[devices]

    return weights


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = torch.load(a), torch.load(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), f"{key} differs"


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("devices", "async_save"), [(1, False), (1, True), (2, False)], ids=["1proc", "1proc-async", "ddp2"]
)
def test_sigterm_mid_epoch_then_resume_is_bitwise_equal(tmp_path, devices, async_save, reference_weights):
    common = ["--devices", str(devices)] + (["--async-save"] if async_save else [])

    progress = tmp_path / "progress"
    ckpts = tmp_path / "ckpts"
    # 20 batches per epoch: step 27 is mid-way through the second epoch
    proc = start_training(ckpts, tmp_path / "run.pt", progress, 0.15, *common)
    wait_for_step(progress, 27, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == PREEMPTED_EXIT_CODE, out[-3000:]
    assert not (tmp_path / "run.pt").exists()  # it stopped before the end
    saved = find_resume_checkpoint(ckpts)
    assert saved is not None
    step = int(Path(saved).stem.split("=")[1])
    assert 27 <= step < 46 and step % 20 != 0, f"expected a mid-epoch save, got step {step}"

    resumed = run_script("--ckpt-dir", str(ckpts), "--out", str(tmp_path / "run.pt"), "--resume", *common)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "not resumable" not in resumed.stderr  # Lightning's mid-epoch warning must not fire
    assert_same_weights(reference_weights(devices), tmp_path / "run.pt")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_kill_9_at_random_moments_then_resume_is_bitwise_equal(tmp_path, reference_weights):
    """Three SIGKILLs at random moments (saves every 2 steps, so some land mid-save), then a resume."""
    rng = random.Random(7)  # seeded: a failure is reproducible
    ckpts, progress = tmp_path / "ckpts", tmp_path / "progress"
    reached = 0
    for _ in range(3):
        proc = start_training(
            ckpts, tmp_path / "run.pt", progress, 0.05, "--every-n-steps", "2", "--async-save", "--resume"
        )
        wait_for_step(progress, reached + 3, proc)
        time.sleep(rng.uniform(0.0, 0.4))
        proc.kill()
        proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL
        newest = find_resume_checkpoint(ckpts)
        assert newest is not None and verify(newest)  # a valid checkpoint always remains
        reached = int(Path(newest).stem.split("=")[1])
    resumed = run_script(
        "--ckpt-dir", str(ckpts), "--out", str(tmp_path / "run.pt"), "--every-n-steps", "2", "--async-save", "--resume"
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_weights(reference_weights(1), tmp_path / "run.pt")


SLOW_SAVE = """
import sys, time, torch
from lightning_accel.checkpoint import atomic_save
class Slow:
    def __reduce__(self):
        print("writing", flush=True); time.sleep(60); return (int, (0,))
atomic_save({"w": torch.ones(1000), "slow": Slow()}, sys.argv[1])
"""


@pytest.mark.multiprocess
def test_kill_9_during_save_leaves_previous_checkpoint_intact(tmp_path):
    path = tmp_path / "last.ckpt"
    atomic_save({"w": torch.zeros(1000), "global_step": 1}, path, {"global_step": 1})
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SAVE, str(path)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout.readline().strip() == "writing"  # the new file is half written now
    assert any(p.name.startswith(".last.ckpt.tmp-") for p in tmp_path.iterdir())
    proc.kill()
    proc.wait(timeout=30)
    assert verify(path)
    assert torch.equal(AtomicCheckpointIO().load_checkpoint(path)["w"], torch.zeros(1000))
    assert find_resume_checkpoint(tmp_path) == str(path)


def test_truncated_and_corrupt_checkpoints_are_skipped(tmp_path):
    for step in (10, 20, 30):
        atomic_save(
            {"global_step": step, "w": torch.full((256,), float(step))},
            tmp_path / f"step={step}.ckpt",
            {"global_step": step},
        )
    newest = tmp_path / "step=30.ckpt"
    newest.write_bytes(newest.read_bytes()[:-100])  # truncated
    middle = tmp_path / "step=20.ckpt"
    data = bytearray(middle.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size
    middle.write_bytes(bytes(data))
    with pytest.warns(UserWarning) as record:
        assert find_resume_checkpoint(tmp_path) == str(tmp_path / "step=10.ckpt")
    messages = [str(w.message) for w in record]
    assert any("step=30.ckpt" in m and "truncated" in m for m in messages)
    assert any("step=20.ckpt" in m and "xxh3-64 checksum does not match" in m for m in messages)
    assert verify(middle, checksum=False)  # the cheap check (used when pruning) sees size only
    assert "truncated" in verify(newest, checksum=False).reason
    with pytest.raises(CorruptCheckpointError, match=r"step=20\.ckpt is not usable: xxh3-64 checksum"):
        AtomicCheckpointIO().load_checkpoint(middle)


def test_foreign_checkpoint_without_manifest_is_checked_by_zip_integrity(tmp_path):
    good, bad = tmp_path / "a.ckpt", tmp_path / "b.ckpt"
    torch.save({"x": torch.ones(10)}, good)
    torch.save({"x": torch.ones(10)}, bad)
    bad.write_bytes(bad.read_bytes()[:200])
    assert verify(good).checked_by == "zip" and verify(good)
    assert "not a readable torch checkpoint" in verify(bad).reason
    assert find_resume_checkpoint(tmp_path / "missing_dir") is None


def test_trainer_refuses_corrupt_checkpoint_with_clear_error(tmp_path):
    dm = SyntheticClassificationDataModule(num_samples=64, input_dim=8, batch_size=16)
    cb = PreemptionCheckpoint(tmp_path / "ck", every_n_steps=2)
    Trainer(**tiny_trainer_kwargs(tmp_path, max_steps=2, callbacks=[cb])).fit(MLPClassifier(input_dim=8), datamodule=dm)
    ckpt = cb.saved[-1]
    ckpt.write_bytes(ckpt.read_bytes()[:-10])
    trainer = Trainer(**tiny_trainer_kwargs(tmp_path, max_steps=4, callbacks=[PreemptionCheckpoint(tmp_path / "ck")]))
    with pytest.raises(CorruptCheckpointError, match=r"step=00000002\.ckpt is not usable"):
        trainer.fit(MLPClassifier(input_dim=8), datamodule=dm, ckpt_path=str(ckpt))


def test_periodic_saves_keep_last_n_and_async_snapshots_are_point_in_time(tmp_path):
    snapshots: dict[int, torch.Tensor] = {}

    class Snapshot(Callback):  # runs after PreemptionCheckpoint in the same hook
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            snapshots[trainer.global_step] = pl_module.net[0].weight.detach().clone()

    cb = PreemptionCheckpoint(tmp_path / "ck", every_n_steps=3, keep_last=2, async_save=True)
    dm = SyntheticClassificationDataModule(num_samples=512, input_dim=8, batch_size=16)
    Trainer(**tiny_trainer_kwargs(tmp_path, max_steps=12, callbacks=[cb, Snapshot()])).fit(
        MLPClassifier(input_dim=8), datamodule=dm
    )
    assert [p.name for p in cb.saved] == [f"step={s:08d}.ckpt" for s in (3, 6, 9, 12)]
    remaining = sorted(p.name for p in (tmp_path / "ck").glob("*.ckpt"))
    # keep_last=2 counts finished files only; writes still in flight are pruned at teardown
    assert remaining == ["step=00000009.ckpt", "step=00000012.ckpt"]
    for name in remaining:
        step = int(name[5:13])
        assert verify(tmp_path / "ck" / name)
        state = torch.load(tmp_path / "ck" / name, weights_only=False)
        assert state["global_step"] == step
        assert torch.equal(state["state_dict"]["net.0.weight"], snapshots[step])  # not a later weight


def test_time_based_save(tmp_path, monkeypatch):
    # A fake clock the callback reads: each step "takes" 0.06 s whatever the machine's load is.
    class Clock:
        now = 0.0

        @classmethod
        def monotonic(cls) -> float:
            return cls.now

    class Tick(Callback):
        def on_train_batch_end(self, *args):
            Clock.now += 0.06

    monkeypatch.setattr(preemption, "time", Clock)
    cb = PreemptionCheckpoint(tmp_path / "ck", every_n_seconds=0.1, keep_last=None)
    dm = SyntheticClassificationDataModule(num_samples=128, input_dim=8, batch_size=16)
    Trainer(**tiny_trainer_kwargs(tmp_path, max_steps=8, callbacks=[Tick(), cb])).fit(
        MLPClassifier(input_dim=8), datamodule=dm
    )
    # 0.12 s since the last save at steps 2, 4, 6 and 8; 0.06 s is too soon at the odd steps
    assert [p.name for p in cb.saved] == [f"step={s:08d}.ckpt" for s in (2, 4, 6, 8)]


def test_bad_arguments_are_clear():
    with pytest.raises(ValueError, match="Unknown signal 'SIGFOO'"):
        PreemptionCheckpoint(signals=("SIGFOO",))
    with pytest.raises(ValueError, match="every_n_steps must be positive"):
        PreemptionCheckpoint(every_n_steps=0)


def test_signal_in_process_stops_after_the_step_and_exits_with_code(tmp_path):
    class SendSignal(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 3:
                os.kill(os.getpid(), signal.SIGTERM)

    cb = PreemptionCheckpoint(tmp_path / "ck")
    dm = SyntheticClassificationDataModule(num_samples=256, input_dim=8, batch_size=16)
    trainer = Trainer(**tiny_trainer_kwargs(tmp_path, max_steps=50, callbacks=[SendSignal(), cb]))
    with pytest.raises(SystemExit) as exc:
        trainer.fit(MLPClassifier(input_dim=8), datamodule=dm)
    assert exc.value.code == PREEMPTED_EXIT_CODE
    assert trainer.global_step == 4  # the signalled step finished, nothing after it ran
    assert [p.name for p in cb.saved] == ["step=00000004.ckpt"]
    assert signal.getsignal(signal.SIGTERM) is not cb.stop_signals.handle  # handler removed at teardown


def test_prune_never_deletes_a_file_whose_manifest_is_not_written_yet(tmp_path):
    """An async write renames the checkpoint into place before writing its manifest."""
    cb = PreemptionCheckpoint(tmp_path, keep_last=2)
    for step in (3, 6):
        atomic_save({"global_step": step}, tmp_path / f"step={step:08d}.ckpt", {"global_step": step})
    torch.save({"global_step": 9}, tmp_path / "step=00000009.ckpt")  # renamed, manifest still pending
    cb._prune()
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == [
        "step=00000003.ckpt",
        "step=00000006.ckpt",
        "step=00000009.ckpt",
    ]
