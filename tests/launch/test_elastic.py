"""Surviving restarts under torchrun: a killed worker is restarted and the run resumes bitwise; SIGTERM to our
launcher saves and exits 75; the preemption grace period is checked against measured saves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from lightning.pytorch import Callback, Trainer

from lightning_accel.checkpoint import PREEMPTED_EXIT_CODE, PreemptionCheckpoint
from lightning_accel.demos import MLPClassifier, SyntheticClassificationDataModule
from lightning_accel.launch import torchrun
from lightning_accel.strategies.elastic import attempt_prefix, under_torchrun
from tests.conftest import tiny_trainer_kwargs

ROOT = Path(__file__).resolve().parents[2]
STEPS = 60
RECIPE = """\
seed_everything: 0
trainer:
  default_root_dir: {root}/run
  accelerator: cpu
  devices: 2
  strategy: {strategy}
  max_steps: {steps}
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  logger: false
  callbacks:
    - class_path: lightning_accel.PreemptionCheckpoint
      init_args: {{dirpath: {root}/ckpt, every_n_steps: 10, keep_last: 2}}
model:
  class_path: lightning_accel.demos.TinyGPT
  init_args: {{vocab_size: 64, seq_len: 32, d_model: 32, n_layers: 2, n_heads: 2}}
data:
  class_path: lightning_accel.demos.SyntheticTokenDataModule
  init_args: {{num_samples: 4096, seq_len: 32, vocab_size: 64, batch_size: 8}}
"""
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "5"]
OURS = [sys.executable, "-m", "lightning_accel.cli", "torchrun", "--nproc-per-node", "2", "--max-restarts", "3"]
TIMEOUT = 150  # every wait is bounded: a hang fails the test instead of the suite


def recipe(root: Path, strategy: str = "accel_ddp") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    path = root / "recipe.yaml"
    path.write_text(RECIPE.format(root=root, strategy=strategy, steps=STEPS))
    return path


def start(launcher: list[str], root: Path, strategy: str = "accel_ddp") -> subprocess.Popen:
    cmd = [*launcher, "fit", "--config", str(recipe(root, strategy)), "--ckpt_path", "auto"]
    if launcher is TORCHRUN:
        cmd = [*launcher, "-m", "lightning_accel.cli", *cmd[len(launcher) :]]
    log = open(root / "log.txt", "a")
    return subprocess.Popen(cmd, cwd=root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait(proc: subprocess.Popen, root: Path) -> int:
    try:
        return proc.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the launcher hung; its log:\n{(root / 'log.txt').read_text()[-4000:]}")


def wait_for(path: Path, proc: subprocess.Popen, root: Path) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not path.exists():
        assert proc.poll() is None, f"ended before {path.name}:\n{(root / 'log.txt').read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {path.name} after {TIMEOUT} s"
        time.sleep(0.1)


def final_weights(root: Path) -> dict[str, torch.Tensor]:
    return torch.load(root / "ckpt" / f"step={STEPS:08d}.ckpt", weights_only=False)["state_dict"]


def assert_bitwise(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], v) for k, v in expected.items()), "weights differ from the uninterrupted run"


@pytest.fixture(scope="module")
def expected(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The uninterrupted 2-rank run's final weights (torchrun, accel_ddp), shared by the restart tests."""
    root = tmp_path_factory.mktemp("reference")
    assert wait(start(TORCHRUN, root), root) == 0
    return final_weights(root)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_torchrun_restarts_a_killed_worker_five_times_and_resumes_bitwise(tmp_path, expected):
    """The issue's command, plain torchrun (Lightning's own ddp: the CLI's fix): kill -9 a worker after each of
    five checkpoints, each rank in turn; torchrun restarts the group every time, and the run finishes equal to
    an uninterrupted one."""
    proc = start(TORCHRUN, tmp_path, "ddp")
    for kill in range(1, 6):
        wait_for(tmp_path / "ckpt" / f"step={10 * kill:08d}.ckpt.manifest.json", proc, tmp_path)
        workers = sorted(psutil.Process(proc.pid).children(), key=lambda p: p.pid)
        assert len(workers) == 2
        workers[kill % 2].send_signal(signal.SIGKILL)
        deadline = time.monotonic() + TIMEOUT  # the restarted group is up before the next kill
        while f"attempt_{kill}" not in (tmp_path / "log.txt").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "log.txt").read_text()[-3000:]
            time.sleep(0.1)
    assert wait(proc, tmp_path) == 0, (tmp_path / "log.txt").read_text()[-3000:]
    log = (tmp_path / "log.txt").read_text()
    assert "connectFullMesh" not in log  # every attempt on a clean namespace
    assert_bitwise(final_weights(tmp_path), expected)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigterm_to_our_launcher_saves_exits_75_and_the_same_command_resumes(tmp_path, expected):
    root = tmp_path / "run"
    proc = start(OURS, root)
    wait_for(root / "ckpt" / "step=00000010.ckpt.manifest.json", proc, root)
    proc.send_signal(signal.SIGTERM)  # the launcher only, as Kubernetes or a spot reclaim does
    assert wait(proc, root) == PREEMPTED_EXIT_CODE
    log = (root / "log.txt").read_text()
    assert "received SIGTERM: saving a checkpoint at step" in log and "attempt_1" not in log  # no restart
    assert "Traceback" not in log
    saved = sorted(p.name for p in (root / "ckpt").glob("*.ckpt"))
    assert saved[-1] > "step=00000010.ckpt"  # the save at the signal
    assert wait(start(OURS, root), root) == 0  # the same command again: resumes and finishes
    assert_bitwise(final_weights(root), expected)


def test_launcher_usage_errors_and_torchrun_detection(monkeypatch, capsys):
    assert torchrun(["--nproc-per-node", "2"]) == 2
    assert "no subcommand" in capsys.readouterr().out
    for name in ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    assert not under_torchrun()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert under_torchrun() and attempt_prefix() == "lightning_accel/job7/attempt_2_world_4"


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_save_longer_than_the_grace_period_warns_once_with_the_numbers(tmp_path, async_save):
    cb = PreemptionCheckpoint(tmp_path / "ck", every_n_steps=2, grace_period_s=0.001, async_save=async_save)
    dm = SyntheticClassificationDataModule(num_samples=256, input_dim=8, batch_size=16)
    with pytest.warns(UserWarning, match=r"a save took \d+\.\d s from start to durable, over the 0.001 s grace") as w:
        Trainer(**tiny_trainer_kwargs(tmp_path, max_steps=8, callbacks=[cb])).fit(
            MLPClassifier(input_dim=8), datamodule=dm
        )
    assert sum("grace period" in str(m.message) for m in w) == 1  # once, at the first timed save
    assert len(cb.save_seconds) >= 3 and all(s > 0 for s in cb.save_seconds)
    assert "faster disk" in next(str(m.message) for m in w if "grace period" in str(m.message))
    with pytest.raises(ValueError, match="grace_period_s must be positive, got 0"):
        PreemptionCheckpoint(grace_period_s=0)


def test_saves_inside_the_grace_period_do_not_warn(tmp_path, recwarn):
    cb = PreemptionCheckpoint(tmp_path / "ck", every_n_steps=2)  # default: 30 s
    dm = SyntheticClassificationDataModule(num_samples=256, input_dim=8, batch_size=16)
    Trainer(**tiny_trainer_kwargs(tmp_path, max_steps=4, callbacks=[cb])).fit(MLPClassifier(input_dim=8), datamodule=dm)
    assert cb.save_seconds and not [w for w in recwarn if "grace period" in str(w.message)]


def test_a_signal_skips_the_validation_that_was_due(tmp_path):
    """On a signal: finish the optimizer step, no validation pass, save, exit."""
    validations: list[int] = []

    class Watch(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 3:
                os.kill(os.getpid(), signal.SIGTERM)

        def on_validation_start(self, trainer, pl_module):
            validations.append(trainer.global_step)

    model = MLPClassifier(input_dim=8)
    dm = SyntheticClassificationDataModule(num_samples=256, val_samples=32, input_dim=8, batch_size=16)
    kwargs = tiny_trainer_kwargs(tmp_path, max_steps=50, val_check_interval=1, limit_val_batches=1)
    trainer = Trainer(**{**kwargs, "callbacks": [Watch(), PreemptionCheckpoint(tmp_path / "ck")]})
    with pytest.raises(SystemExit) as exc:
        trainer.fit(model, datamodule=dm)
    assert exc.value.code == PREEMPTED_EXIT_CODE and trainer.global_step == 4
    assert 4 not in validations and validations[-1] == 3  # due after step 4, skipped


def test_ray_options_are_split_from_the_fit_arguments():
    from lightning_accel.launch.ray import split_ray_args

    assert split_ray_args(["--config", "r.yaml"]) == (None, ["--config", "r.yaml"])
    options, rest = split_ray_args(
        ["--config", "r.yaml", "--ray.num_workers", "4", "--ray.max_failures=2", "--ckpt_path", "auto"]
    )
    assert (options.num_workers, options.max_failures, options.use_gpu) == (4, 2, False)
    assert rest == ["--config", "r.yaml", "--ckpt_path", "auto"]
    elastic, _ = split_ray_args(["--ray.num_workers", "1:4"])
    assert elastic.num_workers == (1, 4)  # Ray Train's elastic ScalingConfig(num_workers=(1, 4))
    for bad in ("0", "3:2", "two", "1:"):
        with pytest.raises(SystemExit):
            split_ray_args(["--ray.num_workers", bad])


def test_num_nodes_follows_the_rendezvous_round_of_an_elastic_job(monkeypatch, caplog):
    """Lightning refuses num_nodes x devices != WORLD_SIZE; an elastic job's round decides the nodes, so a recipe's
    num_nodes (1 by default) is replaced by WORLD_SIZE // LOCAL_WORLD_SIZE under torchrun, with a log line."""
    from lightning_accel.recipe import AccelTrainer
    from lightning_accel.strategies.elastic import nodes_in_this_round

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert nodes_in_this_round() is None
    env = {"TORCHELASTIC_RUN_ID": "job", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "RANK": "1", "LOCAL_RANK": "0"}
    for name, value in {**env, "GROUP_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(name, value)
    assert nodes_in_this_round() == 2
    from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    for function in (rank_zero_only, fabric_rank_zero_only):  # the Trainer sets this process's rank: put it back
        monkeypatch.setattr(function, "rank", getattr(function, "rank", 0))
    with caplog.at_level("INFO"):
        trainer = AccelTrainer(accelerator="cpu", devices=1, num_nodes=1, strategy="ddp", logger=False)
    assert trainer.num_nodes == 2 and trainer.world_size == 2 and trainer.global_rank == 1
    assert "num_nodes=1 in the recipe; torchrun's rendezvous round has 2 node(s)" in caplog.text
