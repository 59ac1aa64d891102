"""tune: the budgeted search on models the tests define, its numerics guard, and the tuned recipe it writes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from lightning.pytorch import LightningDataModule, LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.tuning import Candidate, TrialSettings, TuneConfig, tune
from lightning_accel.tuning.config import parse_budget
from lightning_accel.tuning.report import trial_table, tuned_config
from lightning_accel.tuning.search import Search, Trial, TuneResult, data_knobs
from lightning_accel.tuning.space import DataKnobs, batch_candidates, loader_candidates, precision_compile_candidates
from lightning_accel.tuning.trial import TrialResult
from tests.helpers.zygote import fresh_env

ROOT = Path(__file__).resolve().parents[2]
FAST = TrialSettings(warmup=3, measure_s=0.5, min_batches=5, max_batches=200, loss_batches=4)


class ConvNet(LightningModule):
    """Not ours: BatchNorm, Dropout, a repeated block list, a step LR scheduler."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.1))
            for _ in range(2)
        )
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x.mean(dim=(2, 3)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.5)]


def images_dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    images, labels = torch.randn(512, 3, 16, 16, generator=g), torch.randint(0, 4, (512,), generator=g)
    return TensorDataset(images, labels)


class ImagesDataModule(LightningDataModule):
    """The usual shape of a user's DataModule: loader settings as attributes its train_dataloader reads."""

    def __init__(self, batch_size: int = 8, num_workers: int = 0) -> None:
        super().__init__()
        self.batch_size, self.num_workers = batch_size, num_workers

    def setup(self, stage: str | None = None) -> None:
        self.train_set = images_dataset()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)


class HparamsDataModule(LightningDataModule):
    """The other usual shape: ``save_hyperparameters()``, and train_dataloader() reads ``self.hparams``."""

    def __init__(self, batch_size: int = 8, num_workers: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()

    setup = ImagesDataModule.setup

    def train_dataloader(self) -> DataLoader:
        hp = self.hparams
        return DataLoader(self.train_set, batch_size=hp.batch_size, shuffle=True, num_workers=hp.num_workers)


class ConvNetWithLoader(ConvNet):
    """A module that brings its own data: train_dataloader(), the batch size in its hparams."""

    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(images_dataset(), batch_size=self.hparams.batch_size, shuffle=True)


def result(stage: str, candidate: Candidate, sps: float, losses=(1.0, 1.0), batch=8, **kw) -> Trial:
    trial = Trial(stage, candidate, TrialResult(samples_per_sec=sps, losses=list(losses), batch_size=batch, **kw))
    trial.amortized_sps = sps
    return trial


def test_budget_parsing_and_errors():
    assert [parse_budget(b) for b in (300, "300", "90s", "5m", "1h", "1m30s", "0.5m")] == [
        300,
        300,
        90,
        300,
        3600,
        90,
        30,
    ]
    for bad in ("five minutes", "", "-3", 0):
        with pytest.raises(ValueError, match="budget"):
            parse_budget(bad)


def test_search_space_stages():
    data = DataKnobs({"num_workers": 0, "batch_size": 16, "pin_memory": False})
    base = Candidate(precision="32-true")
    loader = list(loader_candidates(base, data, "cpu"))
    assert {c.num_workers for c in loader} >= {2} and 0 not in {c.num_workers for c in loader}
    assert all(c.pin_memory is None for c in loader)  # pinned memory only helps copies to a GPU
    assert list(loader_candidates(base, DataKnobs({}), "cpu")) == []  # no num_workers knob: nothing to try
    options = list(precision_compile_candidates(base, "cpu", has_blocks=True))
    assert options[:2] == [base.with_(precision="32-true"), base.with_(precision="bf16-mixed")]
    assert {c.compile for c in options} == {"off", "module", "blocks"}
    assert [c.batch_size for c in batch_candidates(base, 16, False, 128)] == [32, 64, 128]
    kept = list(batch_candidates(base.with_(batch_size=16, accumulate_grad_batches=4), 16, True, 1024))
    assert [(c.batch_size, c.accumulate_grad_batches) for c in kept] == [(32, 2), (64, 1)]


def test_numerics_guard_rejects_drift_and_non_finite_losses():
    search = Search({}, DataKnobs({}), "cpu", False, 60, planned=lambda r: None, config=TuneConfig(loss_tolerance=0.05))
    search.reference = result("baseline", Candidate(precision="32-true"), 100, losses=[2.0, 2.0, 2.0])
    close = result("p", Candidate(precision="bf16-mixed"), 120, losses=[2.05, 2.05, 2.05])
    far = result("p", Candidate(precision="16-mixed"), 150, losses=[2.4, 2.4, 2.4])
    nan = result("p", Candidate(precision="16-mixed"), 150, losses=[2.0, float("nan")])
    other_batch = result("b", Candidate(precision="bf16-mixed", batch_size=64), 200, losses=[3.0, 3.0])
    assert search.numerics_rejection(close) is None
    assert search.numerics_rejection(far) == (
        "rejected: mean loss of the first 3 batches 2.4 vs fp32 eager 2 (drift 20.0% > 5%)"
    )
    assert search.numerics_rejection(nan).startswith("rejected: non-finite loss")
    assert (
        search.numerics_rejection(other_batch) is None
    )  # other batches: not comparable, checked at the reference batch


def test_compile_time_is_amortized_over_the_planned_samples():
    search = Search({}, DataKnobs({}), "cpu", False, 60, planned=lambda r: 10_000.0)
    search.planned_samples = 10_000.0
    # 1000 samples/s but 20 s of compilation over a 10 s run: 10000 / 30 s
    assert search.amortize(1000.0, 20.0) == pytest.approx(333.33, rel=1e-4)
    assert search.amortize(1000.0, 0.0) == pytest.approx(1000.0)


def test_one_lucky_run_does_not_displace_a_confirmed_choice(monkeypatch, tmp_path):
    """A challenger measured once is run again until it rests on as many runs as the confirmed pick."""
    runs = iter([])
    monkeypatch.setattr(
        "lightning_accel.tuning.search.run_trial",
        lambda spec, timeout_s, workdir: TrialResult(samples_per_sec=next(runs)),
    )

    def searched(challenger_reruns):
        nonlocal runs
        runs = iter(challenger_reruns)
        search = Search({}, DataKnobs({}), "cpu", False, 60, planned=lambda r: None, workdir=tmp_path)
        pick = result("batch", Candidate(batch_size=64), 100)
        pick.repeats = [100.0, 100.0, 100.0, 100.0]  # confirmed: a mean of four runs
        lucky = result("batch", Candidate(batch_size=128), 110)
        lucky.repeats = [110.0]
        search.trials = [pick, lucky]
        return search, pick, lucky, search.settle(pick)

    search, pick, lucky, chosen = searched([90.0, 90.0, 90.0])
    assert chosen is pick and lucky.repeats == [110.0, 90.0]  # no longer faster after one more run: stop
    assert lucky.amortized_sps == pytest.approx(100.0) and pick.verdict == ""
    search, pick, lucky, chosen = searched([108.0, 112.0, 110.0])
    assert chosen is lucky and lucky.amortized_sps == pytest.approx(110.0)
    assert pick.verdict == "not chosen: 100.0 samples/s over 4 runs, 0.91x the chosen"
    assert "(4 vs 4): chosen instead" in search.notes[-1]


def test_a_trial_that_would_not_finish_in_the_budget_is_not_started(monkeypatch, tmp_path):
    """4.2 s left, eager trials took 3.4, 3.5 and 4.0 s (the batch grew): the next batch's trial is skipped, not
    started and then stopped at the budget; a rerun is estimated from its own run."""

    def must_not_run(spec, timeout_s, workdir):
        raise AssertionError(f"a trial was started with {timeout_s:.1f}s left")

    monkeypatch.setattr("lightning_accel.tuning.search.run_trial", must_not_run)
    search = Search({}, DataKnobs({}), "cpu", False, 100, planned=lambda r: None, workdir=tmp_path)
    walls = {16: 3.4, 32: 3.5, 64: 4.0}
    search.trials = [result("batch", Candidate(batch_size=b), 100, batch=b, wall_s=w) for b, w in walls.items()]
    assert search.estimate(Candidate(batch_size=128)) == pytest.approx(4.4)  # the latest, 10% to spare
    assert search.estimate(Candidate(batch_size=16)) == pytest.approx(3.74)  # its own run
    assert search.estimate(Candidate(compile="module")) == pytest.approx((3.5 + 15) * 1.1)  # none compiled yet
    longer = Search({}, DataKnobs({}), "cpu", False, 100, planned=lambda r: None, workdir=tmp_path)
    longer.trials = [result("baseline", Candidate(), 100, wall_s=5.0)]
    assert longer.estimate(Candidate(compile="module")) == pytest.approx(5.0 * 5 * 1.1)  # five longer eager trials
    search.start = time.perf_counter() - (100 - 3.0 - 4.2)  # 4.2 s left after the report's reserve
    trial = search.measure("batch", Candidate(batch_size=128))
    assert trial.result is None and trial.verdict.startswith("skipped: 4s of budget to spend"), trial.verdict


def test_keep_global_batch_trades_the_recipes_accumulation_for_batch(monkeypatch, tmp_path):
    """A recipe accumulating 4 batches of 8, --keep-global-batch: the batch stage tries 16 x 2 and 32 x 1 (it
    tried nothing: the search took the recipe's accumulation for 1, so no larger batch kept 8 x 1)."""
    tried = []

    def fake_trial(spec, timeout_s, workdir):
        cand = spec["candidate"]
        tried.append((cand["batch_size"], cand["accumulate_grad_batches"]))
        batch = cand["batch_size"] or 8
        return TrialResult(samples_per_sec=100.0 * batch, losses=[1.0], batch_size=batch, wall_s=0.01)

    monkeypatch.setattr("lightning_accel.tuning.search.run_trial", fake_trial)
    spec = {"recipe_accumulate": 4}
    search = Search(
        spec, DataKnobs({"batch_size": 8}), "cpu", False, 60, lambda r: None, TuneConfig(keep_global_batch=True)
    )
    res = search.run(Candidate(precision="32-true"), baseline_is_reference=True)
    assert (16, 2) in tried and (32, 1) in tried and not any(b and b * (a or 4) != 32 for b, a in tried), tried
    assert (res.best.candidate.batch_size, res.best.candidate.accumulate_grad_batches) == (32, 1)


def test_one_slow_reading_does_not_end_the_batch_stage(monkeypatch, tmp_path):
    """Two runs of the baseline agreed (noise 0.4%), then one run of batch 64 read 0.92x batch 32: the stage goes
    on to 128 (it stopped there), and a drop of more than 10% still ends it."""
    speed = {None: 100.0, 32: 150.0, 64: 138.0, 128: 180.0, 256: 150.0, 512: 400.0}

    def fake_trial(spec, timeout_s, workdir):
        batch = spec["candidate"]["batch_size"]
        sps = speed[batch] * (1.004 if batch is None and fake_trial.runs else 1.0)
        fake_trial.runs += 1
        return TrialResult(samples_per_sec=sps, losses=[1.0], batch_size=batch or 16, wall_s=0.01)

    fake_trial.runs = 0
    monkeypatch.setattr("lightning_accel.tuning.search.run_trial", fake_trial)
    search = Search({}, DataKnobs({"batch_size": 16}), "cpu", False, 60, lambda r: None, TuneConfig(max_batch=512))
    res = search.run(Candidate(precision="32-true"), baseline_is_reference=True)
    batches = [t.candidate.batch_size for t in res.trials if t.stage == "batch"]
    assert search.noise < 0.01 and batches == [32, 64, 128, 256], batches  # 256 at 0.83x of 128: stop
    assert res.best.candidate.batch_size == 128


def test_tuned_recipe_applies_the_choice_and_keeps_the_samples(tmp_path):
    recipe = yaml.safe_load((ROOT / "recipes/tiny_gpt_cpu.yaml").read_text())
    base = result("baseline", Candidate(precision="32-true"), 1000, batch=16)
    best = result("batch", Candidate(precision="32-true", num_workers=2, batch_size=64), 1300, batch=64)
    tuned = TuneResult([base, best], base, best, budget_s=300, elapsed_s=200, planned_samples=1920)
    config, lines = tuned_config(recipe, tuned, block_names=["blocks.0", "blocks.1"])
    assert config["data"]["init_args"]["batch_size"] == 64 and config["data"]["init_args"]["num_workers"] == 2
    assert config["trainer"]["max_steps"] == 30 and config["trainer"]["val_check_interval"] == 15  # 120 / 4, 60 / 4
    by_name = {c["class_path"].rsplit(".", 1)[-1]: c["init_args"] for c in config["trainer"]["callbacks"]}
    assert by_name["GoodputMonitor"] == {"every_n_steps": 3, "warmup_steps": 2}  # 10 / 4 and 5 / 4, rounded up
    assert by_name["PreemptionCheckpoint"]["every_n_steps"] == 15
    assert config["trainer"]["precision"] == "auto-mixed"  # unchanged: it already resolves to the chosen 32-true
    assert recipe["data"]["init_args"]["batch_size"] == 16  # the input is not modified
    assert lines[0] == "measured: 1.30x the untuned recipe, 1300.0 vs 1000.0 samples/s"
    assert any("global batch changed 16 -> 64" in line for line in lines)
    # a 2-rank recipe: trials report per-device batches; the global batch spans both ranks
    base2 = result("baseline", Candidate(precision="32-true"), 500, batch=16, world_size=2)
    best2 = result("batch", Candidate(precision="32-true", batch_size=128), 700, batch=128, world_size=2)
    ddp = TuneResult([base2, best2], base2, best2, budget_s=120, elapsed_s=100, planned_samples=640)
    _, lines = tuned_config(yaml.safe_load((ROOT / "recipes/tiny_gpt_ddp_cpu.yaml").read_text()), ddp, [])
    assert any("global batch changed 32 -> 256" in line for line in lines), lines
    assert "per device, 2 devices" in trial_table(ddp).title
    assert "amortized: the mean of all its runs" in str(trial_table(ddp).caption)  # the two columns explained
    # --keep-global-batch: batch 16 x 4 accumulated -> 64 x 1; steps and callback intervals keep their meaning
    accumulating = {**recipe, "trainer": {**recipe["trainer"], "accumulate_grad_batches": 4}}
    kept = result("batch", Candidate(precision="32-true", batch_size=64, accumulate_grad_batches=1), 1300, batch=64)
    config, lines = tuned_config(accumulating, TuneResult([base, kept], base, kept, 300, 200, 7680), [])
    assert config["trainer"]["accumulate_grad_batches"] == 1 and config["trainer"]["max_steps"] == 120
    assert config["data"]["init_args"]["batch_size"] == 64
    assert "trainer.accumulate_grad_batches -> 1 (global batch kept)" in lines
    assert not any("global batch changed" in line for line in lines), lines
    compiled = result("p", Candidate(precision="bf16-mixed", compile="blocks"), 1500)
    config, _ = tuned_config(recipe, TuneResult([base, compiled], base, compiled, 300, 200, 1920), ["blocks.0"])
    assert config["trainer"]["precision"] == "bf16-mixed"
    assert config["trainer"]["callbacks"][-1] == {
        "class_path": "lightning_accel.TorchCompile",
        "init_args": {"modules": ["blocks.0"]},
    }


def test_tune_is_a_plain_function_imported_on_first_use():
    """``lightning_accel.tune`` is the function (no callable-module trick type checkers cannot follow), and
    ``import lightning_accel`` alone imports neither it nor LightningCLI: a fresh interpreter says so."""
    import inspect

    import lightning_accel
    from lightning_accel.tuning import tune as the_function

    assert lightning_accel.tune is the_function and inspect.isfunction(the_function)
    with pytest.raises(ValueError, match="either config="):
        lightning_accel.tune()
    heavy = "('lightning_accel.tuning', 'lightning.pytorch.cli')"
    probe = f"import sys, lightning_accel; print(sorted(m for m in {heavy} if m in sys.modules))"
    cmd = [sys.executable, "-c", probe]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=fresh_env()).stdout
    assert out.strip() == "[]", out


def test_data_knobs_come_from_attributes_and_init_parameters():
    dm = ImagesDataModule()
    assert data_knobs(dm).values == {"batch_size": 8, "num_workers": 0}
    assert data_knobs(dm, init_params=["batch_size"]).values == {"batch_size": 8}


def test_knobs_kept_in_hparams_are_found_and_set_in_the_trial(tmp_path):
    """Loader settings kept in hparams (no attributes), of a DataModule or of a module with its own
    train_dataloader() (tuned with datamodule=None), are tuned like attributes: found, and a trial's batch size
    reaches the loader."""
    from lightning_accel.tuning.search import pickle_objects
    from lightning_accel.tuning.server import run_trial

    kwargs = {"accelerator": "cpu", "devices": 1, "max_steps": 50, "enable_progress_bar": False}
    dm = HparamsDataModule(batch_size=8)
    assert not hasattr(dm, "batch_size") and data_knobs(dm).values == {"batch_size": 8, "num_workers": 0}
    assert data_knobs(ConvNetWithLoader()).values == {"batch_size": 8}
    for name, model, datamodule in [("dm", ConvNet(), dm), ("module", ConvNetWithLoader(), None)]:
        pickle_objects(model, datamodule, kwargs, tmp_path / name / "objects.pkl")
        spec = {"objects": str(tmp_path / name / "objects.pkl"), "settings": vars(FAST)}
        spec["candidate"] = Candidate(batch_size=32).as_dict()
        trial = run_trial(spec, timeout_s=120, workdir=tmp_path / name / "trial")
        assert trial.error is None and trial.batch_size == 32, (name, trial.error)
    with pytest.raises(ValueError, match=r"needs datamodule= too .* unless the model defines its own"):
        tune(model=ConvNet(), trainer_kwargs=kwargs, budget=30)


def test_objects_that_cannot_be_pickled_get_a_clear_error(tmp_path):
    class Local(ConvNet):  # defined inside a function: a fresh process cannot import it
        pass

    with pytest.raises(TypeError, match="Define them at module level"):
        tune(model=Local(), datamodule=ImagesDataModule(), trainer_kwargs={"accelerator": "cpu"}, budget=30)
    with pytest.raises(ValueError, match=r"either config= .* or model="):
        tune()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_tune_a_model_the_test_defines_within_its_budget(tmp_path):
    """ConvNet (BatchNorm, Dropout, scheduler) on its own DataModule, 25 s: every trial in a fresh process, the
    search ends inside the budget, the chosen option is within 3% of the fastest measured and never below the
    untuned baseline, and the JSON and PNG are written."""
    kwargs = {"accelerator": "cpu", "devices": 1, "max_steps": 200, "enable_progress_bar": False}
    res = tune(
        model=ConvNet(),
        datamodule=ImagesDataModule(batch_size=8),
        trainer_kwargs=kwargs,
        budget=25,
        out=tmp_path / "tune" / "tuned.yaml",
        settings=FAST,
        max_batch=64,
    )
    assert res.elapsed_s <= 25 + 1, res.elapsed_s
    measured = [t for t in res.trials if t.ok]
    assert len(measured) >= 3 and res.trials[0].stage == "baseline"
    assert {t.stage for t in measured} >= {"baseline", "batch"}
    fastest = max(t.amortized_sps for t in measured if not t.verdict.startswith("rejected"))
    assert res.best.amortized_sps >= 0.97 * fastest
    assert res.best.amortized_sps >= res.baseline.amortized_sps
    assert all(t.result.losses and len(t.result.losses) == 4 for t in measured)
    assert res.baseline.mfu is not None and 0 < res.baseline.mfu < 1
    saved = json.loads((tmp_path / "tune" / "tuned.json").read_text())
    assert saved["best"]["verdict"].startswith("chosen") and len(saved["trials"]) == len(res.trials)
    assert (tmp_path / "tune" / "tuned.png").stat().st_size > 5000
    assert not (tmp_path / "tune" / "tuned.yaml").exists()  # objects, not a recipe: no YAML to write


@pytest.mark.slow
@pytest.mark.multiprocess
def test_cli_tunes_a_recipe_and_the_tuned_recipe_runs(tmp_path, monkeypatch):
    """`lightning-accel tune` on the tiny GPT recipe (the issue's) with a 20 s budget: exit 0 inside the budget,
    a table, a choice within 3% of the fastest accepted trial and not below the untuned recipe, and a
    tuned.yaml whose header says what was measured and which `lightning-accel fit` trains."""
    out = tmp_path / "tuned.yaml"
    cmd = [sys.executable, "-m", "lightning_accel.cli", "tune", "--config", "recipes/tiny_gpt_cpu.yaml"]
    cmd += ["--budget", "20s", "--out", str(out), "--measure-s", "1", "--max-batch", "64"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "lightning-accel tune:" in done.stderr and "chosen:" in done.stderr
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["elapsed_s"] <= 21 and report["speedup_vs_untuned"] >= 1.0
    accepted = [
        t["amortized_samples_per_sec"]
        for t in report["trials"]
        if t["amortized_samples_per_sec"] and not t["verdict"].startswith("rejected")
    ]
    assert report["best"]["amortized_samples_per_sec"] >= 0.97 * max(accepted)
    text = out.read_text()
    assert text.startswith("# Tuned by `lightning-accel tune --config recipes/tiny_gpt_cpu.yaml`")
    assert "# Run it: lightning-accel fit --config" in text
    # the tuned recipe trains: `lightning-accel fit` through the CLI's main() in this process
    from lightning_accel.cli import main

    monkeypatch.chdir(tmp_path)
    fit = ["fit", "--config", str(out), "--trainer.max_steps", "3", "--trainer.logger", "false"]
    main([*fit, "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.enable_progress_bar", "false"])


def test_cli_usage_errors_are_clear():
    from lightning_accel.cli import tune_command

    with pytest.raises(SystemExit) as exit_info:
        tune_command(["--config", "no/such/recipe.yaml"])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit) as exit_info:
        tune_command(["--config", "recipes/mlp_cpu.yaml", "--budget", "soon"])
    assert exit_info.value.code == 2


def test_trial_failures_and_timeouts_come_back_as_verdicts(tmp_path):
    """A trial that fails at once, one stopped at its time limit, then a good one on the same trial server: each
    returns a result (no exception, no wait for the whole limit), and the server keeps serving."""
    from lightning_accel.tuning.server import run_trial

    def spec(config: str, settings: TrialSettings) -> dict:
        return {"config": config, "candidate": Candidate().as_dict(), "settings": vars(settings)}

    started = time.perf_counter()
    bad = run_trial(spec("recipes/no_such.yaml", FAST), timeout_s=120, workdir=tmp_path / "bad")
    assert bad.error and "no_such.yaml" in bad.error and time.perf_counter() - started < 60
    slow = TrialSettings(warmup=3, measure_s=60, min_batches=5, max_batches=10**6)
    started = time.perf_counter()
    stopped = run_trial(spec(str(ROOT / "recipes/mlp_cpu.yaml"), slow), timeout_s=3, workdir=tmp_path / "slow")
    assert stopped.error.startswith("timeout: stopped after 3s") and time.perf_counter() - started < 10
    good = run_trial(spec(str(ROOT / "recipes/mlp_cpu.yaml"), FAST), timeout_s=120, workdir=tmp_path / "good")
    assert good.error is None and good.samples_per_sec > 0 and good.batch_size == 64
    assert (tmp_path / "good" / "trial.log").exists()


def test_starting_the_trial_server_is_not_the_first_trials_time(monkeypatch, tmp_path):
    """The server imports torch and Lightning once; a trial's wall time (the budget's estimate of the next trials)
    starts when it is ready, so the first trial does not look seconds longer than the rest."""
    from lightning_accel.tuning import server as trial_module

    monkeypatch.setattr(trial_module, "_SERVER", None)  # a new server for this search
    spec = {"config": str(ROOT / "recipes/mlp_cpu.yaml"), "candidate": Candidate().as_dict(), "settings": vars(FAST)}
    started = time.perf_counter()
    first = trial_module.run_trial(spec, timeout_s=120, workdir=tmp_path / "first")
    elapsed = time.perf_counter() - started
    assert first.error is None and elapsed - first.wall_s >= 1.0, (elapsed, first.wall_s)
    second = trial_module.run_trial(spec, timeout_s=120, workdir=tmp_path / "second")
    assert second.error is None and first.wall_s < 2 * second.wall_s, (first.wall_s, second.wall_s)
    trial_module._SERVER.close()


def test_activation_checkpointing_is_tried_only_when_memory_stopped_the_batch(monkeypatch, tmp_path):
    """Batch 32 runs out of memory, so the batch stage stops at 16; with activation checkpointing (selective first)
    batch 32 fits and is faster: chosen, and the tuned recipe gets the callback. fp8 is not tried on a CPU run, and
    the notes say why."""
    tried = []

    def fake_trial(spec, timeout_s, workdir):
        cand = spec["candidate"]
        batch, policy = cand["batch_size"] or 8, cand["activation_checkpointing"]
        tried.append((batch, policy))
        if (batch >= 32 and policy is None) or batch > 32:
            return TrialResult(error="CUDA out of memory", oom=True, batch_size=batch)
        speed = {"selective": 0.9, "full": 0.75, None: 1.0}[policy]
        return TrialResult(samples_per_sec=speed * 100.0 * batch, losses=[1.0], batch_size=batch, wall_s=0.01)

    monkeypatch.setattr("lightning_accel.tuning.search.run_trial", fake_trial)
    search = Search({}, DataKnobs({"batch_size": 8}), "cpu", True, 60, lambda r: None, TuneConfig(max_batch=256))
    res = search.run(Candidate(precision="32-true"), baseline_is_reference=True)
    assert search.memory_bound and (32, None) in tried
    assert [
        (t.candidate.batch_size, t.candidate.activation_checkpointing)
        for t in res.trials
        if t.stage == "activation checkpointing"
    ] == [(32, "selective"), (32, "full")]
    assert (res.best.candidate.batch_size, res.best.candidate.activation_checkpointing) == (32, "selective")
    assert "fp8 not tried: not a GPU run" in res.notes
    config, lines = tuned_config({"trainer": {}, "data": {"init_args": {}}}, res, block_names=[])
    assert "callback ActivationCheckpointing(policy='selective')" in lines
    assert {"class_path": "lightning_accel.ActivationCheckpointing", "init_args": {"policy": "selective"}} in config[
        "trainer"
    ]["callbacks"]
    # without the memory limit, no such stage
    tried.clear()
    monkeypatch.setattr(
        "lightning_accel.tuning.search.run_trial",
        lambda spec, timeout_s, workdir: TrialResult(
            samples_per_sec=100.0, losses=[1.0], batch_size=spec["candidate"]["batch_size"] or 8, wall_s=0.01
        ),
    )
    free = Search({}, DataKnobs({"batch_size": 8}), "cpu", True, 60, lambda r: None, TuneConfig(max_batch=64))
    assert not any(t.stage == "activation checkpointing" for t in free.run(Candidate(), True).trials)


def test_fp8_is_tried_over_bf16_on_an_fp8_gpu_and_kept_only_inside_the_numerics_guard(monkeypatch, tmp_path):
    """On a GPU with fp8 (stubbed here): tensorwise is faster but its loss drifts past the guard, rowwise is faster
    and close: rowwise is chosen, over bf16-mixed, and the tuned recipe gets Float8Training(recipe='rowwise')."""
    monkeypatch.setattr("lightning_accel.tuning.space.fp8_hardware", lambda: None)
    monkeypatch.setattr("lightning_accel.tuning.search.fp8_hardware", lambda: None)
    monkeypatch.setattr("lightning_accel.tuning.space.precisions_for", lambda accelerator: ["32-true", "bf16-mixed"])

    def fake_trial(spec, timeout_s, workdir):
        cand = spec["candidate"]
        speed = {None: 100.0, "tensorwise": 180.0, "rowwise": 150.0}[cand["float8"]]
        loss = 3.0 if cand["float8"] == "tensorwise" else 1.0
        return TrialResult(samples_per_sec=speed, losses=[loss, loss], batch_size=8, wall_s=0.01)

    monkeypatch.setattr("lightning_accel.tuning.search.run_trial", fake_trial)
    search = Search({}, DataKnobs({}), "gpu", False, 60, lambda r: None, TuneConfig(loss_tolerance=0.05))
    res = search.run(Candidate(precision="32-true"), baseline_is_reference=True)
    fp8 = {t.candidate.float8: t.verdict for t in res.trials if t.stage == "fp8"}
    assert set(fp8) == {"tensorwise", "rowwise"} and "faster" not in fp8["tensorwise"], fp8
    assert (res.best.candidate.float8, res.best.candidate.precision) == ("rowwise", "bf16-mixed")
    config, _ = tuned_config({"trainer": {}, "data": {"init_args": {}}}, res, block_names=[])
    assert {"class_path": "lightning_accel.Float8Training", "init_args": {"recipe": "rowwise"}} in config["trainer"][
        "callbacks"
    ]


def test_the_recipes_own_activation_checkpointing_is_measured_and_dropped_where_it_only_costs(monkeypatch, tmp_path):
    """A recipe with ActivationCheckpointing(policy="full") on a machine with memory to spare: the search measures
    the recipe without it (and with the other policy) like any candidate, keeps the fastest, and the tuned recipe
    drops the callback saying why. Every stage not tried says why: the loader (no num_workers), fp8 (not a GPU
    run), activation checkpointing at a larger batch (memory did not limit the batch)."""
    speed = {"full": 60.0, "selective": 80.0, None: 100.0}  # what recomputing costs per policy

    def fake_trial(spec, timeout_s, workdir):
        cand = spec["candidate"]
        batch = cand.get("batch_size") or 16
        sps = speed[cand.get("activation_checkpointing")] * (1.0 if batch == 16 else 0.9)  # no gain from batch
        return TrialResult(
            samples_per_sec=sps, losses=[1.0] * 8, batch_size=batch, wall_s=0.5, peak_memory_mb=100, memory_total_mb=1e6
        )

    monkeypatch.setattr("lightning_accel.tuning.search.run_trial", fake_trial)
    search = Search({}, DataKnobs({"batch_size": 16}), "cpu", True, 600, planned=lambda r: None, workdir=tmp_path)
    search.on_trial = lambda trial: None
    baseline = Candidate(precision="32-true", activation_checkpointing="full")
    result = search.run(baseline, baseline_is_reference=True)
    assert result.best.candidate.activation_checkpointing is None and result.best.stage == "the recipe's own"
    tried = {t.candidate.activation_checkpointing for t in result.trials if t.stage == "the recipe's own"}
    assert tried == {None, "selective"}
    notes = " | ".join(result.notes)
    assert "loader not tuned: the loader's owner has no num_workers" in notes
    assert "fp8 not tried: not a GPU run" in notes
    assert "activation checkpointing not tried: memory did not limit the batch size" in notes
    recipe = {
        "trainer": {
            "callbacks": [
                {"class_path": "lightning_accel.ActivationCheckpointing", "init_args": {"policy": "full"}},
                {"class_path": "lightning_accel.GoodputMonitor"},
            ]
        },
        "data": {"init_args": {"batch_size": 16}},
    }
    config, lines = tuned_config(recipe, result, block_names=["blocks.0"])
    assert config["trainer"]["callbacks"] == [{"class_path": "lightning_accel.GoodputMonitor"}]
    assert "callback ActivationCheckpointing(policy='full') removed: it cost more than it bought" in lines
    # where it buys the memory the batch needs (without it, the trial runs out of memory), it stays
    speed[None] = None
    real = fake_trial

    def without_it_runs_out(spec, timeout_s, workdir):
        if spec["candidate"].get("activation_checkpointing") is None:
            return TrialResult(error="CUDA out of memory", oom=True, wall_s=0.5)
        return real(spec, timeout_s, workdir)

    monkeypatch.setattr("lightning_accel.tuning.search.run_trial", without_it_runs_out)
    search = Search({}, DataKnobs({"batch_size": 16}), "cpu", True, 600, planned=lambda r: None, workdir=tmp_path)
    search.on_trial = lambda trial: None
    kept = search.run(baseline, baseline_is_reference=True)
    assert kept.best.candidate.activation_checkpointing == "selective"  # the cheaper policy that still fits


def test_a_trial_keeps_the_recipes_own_callback_as_it_is_or_trains_without_it():
    from types import SimpleNamespace

    from lightning_accel import ActivationCheckpointing
    from lightning_accel.tuning.trial import _apply_own_features

    own = ActivationCheckpointing(policy="full", blocks=["layers.0"])  # the user's own blocks
    trainer = SimpleNamespace(callbacks=[own])
    _apply_own_features(trainer, {"activation_checkpointing": "full"})
    assert trainer.callbacks == [own]  # the baseline: the recipe's callback itself, its blocks too
    _apply_own_features(trainer, {"activation_checkpointing": "selective"})
    assert [(type(c).__name__, c.policy) for c in trainer.callbacks] == [("ActivationCheckpointing", "selective")]
    trainer.callbacks = [own]
    _apply_own_features(trainer, {"activation_checkpointing": None})
    assert trainer.callbacks == []
