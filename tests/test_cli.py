"""The lightning-accel CLI: recipes run, bad configs fail with clear messages."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from lightning_accel.monitor import GoodputMonitor
from lightning_accel.recipe import build_cli

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """The command as a user runs it, in its own process (the exit status and stderr the shell sees)."""
    return subprocess.run(
        [sys.executable, "-m", "lightning_accel.cli", *args], capture_output=True, text=True, cwd=ROOT, timeout=300
    )


@pytest.fixture
def cli_in_process(capsys, monkeypatch):
    """``lightning-accel ARGS`` through the CLI's own ``main`` in this process, from the repository root: its exit
    code and stderr. Any exception but the SystemExit a clear error ends with fails the test (so no traceback)."""
    from lightning_accel.cli import main

    monkeypatch.chdir(ROOT)

    def run(*args: str) -> tuple[int | str | None, str]:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            main(list(args))
        return exit_info.value.code, capsys.readouterr().err

    return run


def test_every_recipe_parses(capsys):
    """Each recipe is valid against the current classes (parsing only, nothing trains; in this process, since
    --print_config exits before anything is built)."""
    assert RECIPES, "no recipes found"
    for recipe in RECIPES:
        with pytest.raises(SystemExit) as exit_info:
            build_cli(["fit", "--config", str(recipe), "--print_config"])
        out = capsys.readouterr()
        assert exit_info.value.code in (0, None), f"{recipe.name}: {out.err[-2000:]}"
        assert "class_path" in out.out and yaml.safe_load(out.out)["trainer"], recipe.name


def test_recipe_trains_and_reports_throughput(tmp_path):
    cli = build_cli(
        [
            "fit",
            "--config",
            str(ROOT / "recipes/mlp_cpu.yaml"),
            "--trainer.max_epochs",
            "1",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.default_root_dir",
            str(tmp_path),
        ]
    )
    assert cli.trainer.global_step == 32  # 2048 samples / 64 per batch
    monitor = next(c for c in cli.trainer.callbacks if isinstance(c, GoodputMonitor))
    assert monitor.results["throughput/samples_per_sec"] > 0
    assert monitor.results["throughput/steps_measured"] == 32 - monitor.warmup_steps


def test_auto_precision_in_recipe_resolves_to_fp32_on_cpu(tmp_path):
    cli = build_cli(
        [
            "fit",
            "--config",
            str(ROOT / "recipes/tiny_gpt_cpu.yaml"),
            "--trainer.max_steps",
            "2",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.val_check_interval",
            "null",
            "--trainer.logger",
            "false",
            "--trainer.callbacks",
            "[]",
            "--trainer.limit_val_batches",
            "0",
            "--trainer.default_root_dir",
            str(tmp_path),
        ]
    )
    assert cli.trainer.precision == "32-true"  # what our benchmark measures fastest on CPUs


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--config", "recipes/does_not_exist.yaml"], "File does not exist"),
        (
            ["--config", "recipes/mlp_cpu.yaml", "--trainer.bogus_flag", "1"],
            "unrecognized arguments: --trainer.bogus_flag",
        ),
        (["--config", "recipes/mlp_cpu.yaml", "--trainer.strategy", "accel_zero22"], "Did you mean 'accel_zero2'"),
        (["--config", "recipes/mlp_cpu.yaml", "--trainer.precision", "fp7"], "--trainer.precision 'fp7' is not one of"),
        (["--config", "recipes/mlp_cpu.yaml", "--trainer.precision", "bf16-mix"], "Did you mean 'bf16-mixed'?"),
        (["--config", "recipes/mlp_cpu.yaml", "--trainer.accelerator", "gpux"], "Did you mean 'gpu'?"),
        (["--config", "recipes/mlp_cpu.yml"], "recipes/mlp_cpu.yml. Did you mean 'mlp_cpu.yaml'?"),
    ],
)
def test_bad_config_gives_clear_error(extra, message, cli_in_process):
    """One line naming the value, the choices and the closest one: no usage dump, no traceback."""
    code, err = cli_in_process("fit", *extra)
    assert code not in (0, None)
    assert message in err
    assert "Traceback" not in err and "usage:" not in err
    assert sum("error:" in line for line in err.splitlines()) == 1, err


def test_a_bad_config_ends_the_command_with_a_clear_error_and_a_failing_status():
    """The same in the user's shell: the installed command's process exits non-zero with the message, no traceback."""
    result = run_cli("fit", "--config", "recipes/does_not_exist.yaml")
    assert result.returncode == 2
    assert "File does not exist" in result.stderr and "Traceback" not in result.stderr


def test_unknown_key_in_config_file(tmp_path, cli_in_process):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"trainer": {"max_stepz": 3}}))
    code, err = cli_in_process("fit", "--config", "recipes/mlp_cpu.yaml", "--config", str(bad))
    assert code not in (0, None)
    assert "max_stepz" in err
    assert "Traceback" not in err


def test_ckpt_path_auto_starts_fresh_then_resumes(tmp_path, caplog):
    ckpts = tmp_path / "ck"
    common = [
        "fit",
        "--config",
        str(ROOT / "recipes/mlp_cpu.yaml"),
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.callbacks+=lightning_accel.PreemptionCheckpoint",
        f"--trainer.callbacks.dirpath={ckpts}",
        "--trainer.callbacks.every_n_steps=5",
        "--ckpt_path",
        "auto",
        "--trainer.default_root_dir",
        str(tmp_path),
    ]
    with caplog.at_level("INFO", logger="lightning_accel.recipe"):
        first = build_cli([*common, "--trainer.max_steps", "10"])
    assert "no valid checkpoint, starting fresh" in caplog.text
    assert first.trainer.global_step == 10
    assert (ckpts / "step=00000010.ckpt").is_file()
    caplog.clear()
    with caplog.at_level("INFO", logger="lightning_accel.recipe"):
        second = build_cli([*common, "--trainer.max_steps", "15"])
    assert f"resuming from {ckpts / 'step=00000010.ckpt'}" in caplog.text
    assert second.trainer.global_step == 15
    first_w = torch.load(ckpts / "step=00000010.ckpt", weights_only=False)["state_dict"]
    assert any(not torch.equal(v, second.model.state_dict()[k]) for k, v in first_w.items())  # it trained on


def test_ckpt_path_auto_without_a_seed_warns_naming_the_fix(tmp_path):
    args = ["fit", "--config", str(ROOT / "recipes/mlp_cpu.yaml"), "--trainer.enable_progress_bar", "false"]
    args += ["--trainer.callbacks+=lightning_accel.PreemptionCheckpoint", f"--trainer.callbacks.dirpath={tmp_path}"]
    args += ["--ckpt_path", "auto", "--trainer.max_steps", "1", "--trainer.default_root_dir", str(tmp_path)]
    with pytest.warns(UserWarning, match=r"seed_everything=False: nothing is seeded, so every attempt starts"):
        build_cli([*args, "--seed_everything", "false"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the recipe's integer seed: nothing to say
        warnings.filterwarnings("ignore", message="(?!--ckpt_path auto)")
        build_cli(args)


def test_ckpt_path_auto_without_preemption_callback_is_an_error(tmp_path, cli_in_process):
    code, err = cli_in_process(
        "fit",
        "--config",
        "recipes/mlp_cpu.yaml",
        "--ckpt_path",
        "auto",
        "--trainer.max_steps",
        "1",
        "--trainer.default_root_dir",
        str(tmp_path),
    )
    assert code not in (0, None)
    assert "--ckpt_path auto needs a PreemptionCheckpoint callback" in err


def test_a_step_bounded_recipe_shows_steps_not_epoch_minus_two(tmp_path):
    from lightning_accel._compat import StepsProgressBar
    from lightning_accel.recipe import AccelTrainer

    trainer = AccelTrainer(accelerator="cpu", max_steps=5, logger=False, default_root_dir=str(tmp_path))
    (bar,) = [c for c in trainer.callbacks if isinstance(c, StepsProgressBar)]
    assert trainer.progress_bar_callback is bar
    bar.setup(trainer, trainer.lightning_module, "fit")
    trainer.fit_loop.max_epochs = -1  # what a fit bounded by max_steps runs with
    assert bar._get_train_description(0).strip() == "Epoch 0"
    assert bar.get_metrics(trainer, None)["step"] == "0/5"
    assert AccelTrainer(accelerator="cpu", enable_progress_bar=False).progress_bar_callback is None


def test_a_corrupt_explicit_ckpt_path_is_one_line_before_anything_unpickles_it(tmp_path, capsys):
    """A garbage file and a truncated checkpoint as ``--ckpt_path``: one clear error from our verifier, before
    LightningCLI's own torch.load (which said to retry with weights_only=False, or gave a bare OSError)."""
    from lightning_accel.checkpoint import atomic_save

    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"\x00not a checkpoint" * 64)
    truncated = tmp_path / "step=00000004.ckpt"
    atomic_save({"global_step": 4, "w": torch.zeros(1000)}, truncated, {"global_step": 4})
    truncated.write_bytes(truncated.read_bytes()[:-300])
    for path, reason in ((garbage, "not a readable torch checkpoint"), (truncated, "truncated")):
        with pytest.raises(SystemExit) as exit_info:
            build_cli(["fit", "--config", str(ROOT / "recipes/mlp_cpu.yaml"), "--ckpt_path", str(path)])
        err = capsys.readouterr().err
        assert exit_info.value.code != 0
        assert f"--ckpt_path {path} is not a usable checkpoint" in err and reason in err, err[-800:]
        assert "weights_only" not in err and "Traceback" not in err


def test_help_and_a_mistyped_command_show_every_command(capsys):
    from lightning_accel.cli import COMMANDS, main

    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    for name in ("fit", "validate", "test", "predict", "profile", "doctor", "tune", "torchrun"):
        assert f"\n  {name} " in out and name in COMMANDS, name
    with pytest.raises(SystemExit) as exit_info:
        main(["fti", "--config", "x.yaml"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.startswith("lightning-accel: unknown command 'fti'. Did you mean 'fit'?") and "doctor" in err
    assert "Traceback" not in err


def test_fit_help_documents_ckpt_path_auto(capsys):
    from lightning_accel.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # the help's line breaks fall anywhere
    assert exit_info.value.code == 0
    assert "``auto`` (lightning-accel's CLI): the newest valid checkpoint in the PreemptionCheckpoint folder" in out


def test_the_model_summary_leaves_out_flops_it_did_not_count(tmp_path, capsys):
    """AccelTrainer's model summary: without example_input_array Lightning counts no FLOPs, and the table has no
    column of zeros nor a "Total FLOPs: 0" (a line says where the measured FLOPs are); with one, Lightning's own
    table and total are shown."""
    import torch

    from lightning_accel.demos import MLPClassifier, SyntheticClassificationDataModule
    from lightning_accel.recipe import AccelTrainer

    def summary_of(model) -> str:
        trainer = AccelTrainer(
            accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            limit_val_batches=0, default_root_dir=tmp_path,
        )  # fmt: skip
        capsys.readouterr()
        trainer.fit(model, datamodule=SyntheticClassificationDataModule(num_samples=32, input_dim=8, batch_size=8))
        return capsys.readouterr().out

    plain = summary_of(MLPClassifier(input_dim=8))
    assert "Trainable params" in plain and "FLOPs: measured per batch by GoodputMonitor" in plain
    assert "Total FLOPs" not in plain and "FLOPs │" not in plain and "FLOPs ┃" not in plain
    with_input = MLPClassifier(input_dim=8)
    with_input.example_input_array = torch.zeros(2, 8)
    counted = summary_of(with_input)
    assert "Total FLOPs" in counted and "Total FLOPs: 0" not in counted
