"""Each Lightning private name in lightning_accel/_compat.py, checked against the installed Lightning.

A failure here after a Lightning upgrade names what moved; fix _compat.py (and only it).
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import re
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.profilers import SimpleProfiler
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

from lightning_accel import _compat
from lightning_accel.strategies import AccelFSDPStrategy
from lightning_accel.testing import quiet_trainer_kwargs

PACKAGE = Path(_compat.__file__).parent
# "from lightning.x import _name", "lightning.x._name", getattr(obj, "_name"), and the private
# attributes of Lightning objects we once read (kept here so they cannot come back unnoticed).
PRIVATE = re.compile(
    r"from lightning(\.\w+)* import .*\b_[a-zA-Z]|\blightning(\.\w+)*\._[a-z]|getattr\([^)]*[\"']_[a-z]"
    r"|\._(save_distributed_checkpoint|data_parallel_size|ddp_kwargs|accelerator)\b|\.batch_progress\b"
)
# torch's private modules and names, in code (comments and ``quoted`` docs name them freely; aten operator names such
# as torch.ops.aten._scaled_dot_product_flash_attention are the dispatcher's names, not Python ones)
TORCH_PRIVATE = re.compile(r"from torch(\.\w+)* import .*\b_[a-zA-Z]|\btorch(\.(?!ops\.)\w+)*\._[a-z]")


def test_precision_strings_and_aliases_are_lightnings():
    assert set(_compat.PRECISION_STRINGS) >= {"16-mixed", "bf16-mixed", "bf16-true", "32-true", "64-true"}
    assert _compat.PRECISION_ALIASES == {"64": "64-true", "32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}
    for value in (*_compat.PRECISION_STRINGS, *_compat.PRECISION_ALIASES):
        try:
            Trainer(precision=value, accelerator="cpu", logger=False)
        except ModuleNotFoundError:  # accepted, but needs Transformer Engine installed
            assert value.startswith("transformer-engine")
    with pytest.raises(ValueError, match="Precision 'bogus' is invalid"):
        Trainer(precision="bogus", accelerator="cpu", logger=False)


def test_model_parallel_setup_is_the_one_accel_fsdp_mirrors():
    source = inspect.getsource(ModelParallelStrategy.setup)
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    assert digest == _compat.MODEL_PARALLEL_SETUP_DIGEST, (
        "Lightning changed ModelParallelStrategy.setup: compare it with AccelFSDPStrategy.setup, carry the change "
        f"over, then set MODEL_PARALLEL_SETUP_DIGEST = {digest!r}.\n{source}"
    )
    # Every call the original makes, ours makes too (the digest pins the original, this pins ours).
    ours = inspect.getsource(AccelFSDPStrategy.setup)
    for call in (
        "accelerator.setup",
        "materialize_distributed_module",
        "convert_module",
        "model_to_device",
        "barrier",
        "setup_optimizers",
        "setup_precision_plugin",
        "optimizers_to_device",
    ):
        assert call in source and call in ours, call


def test_materialize_and_optimizers_to_device_still_work():
    with torch.device("meta"):
        module = torch.nn.Linear(3, 2)
    _compat.materialize_distributed_module(module, torch.device("cpu"))
    assert module.weight.device.type == "cpu" and torch.isfinite(module.weight).all()
    optimizer = torch.optim.Adam(module.parameters())
    module(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    _compat.optimizers_to_device([optimizer], torch.device("cpu"))
    assert optimizer.state[module.weight]["exp_avg"].device.type == "cpu"


def test_strategy_attributes_still_exist():
    strategy = ModelParallelStrategy(save_distributed_checkpoint=True)
    assert strategy._data_parallel_size == "auto"  # what set_data_parallel_size replaces
    _compat.set_data_parallel_size(strategy, 4)
    assert strategy._data_parallel_size == 4
    assert _compat.saves_distributed_checkpoint(strategy) is True
    assert _compat.saves_distributed_checkpoint(ModelParallelStrategy(save_distributed_checkpoint=False)) is False
    assert _compat.ddp_kwargs(DDPStrategy(bucket_cap_mb=7)) == {"bucket_cap_mb": 7}
    # the timeout our torchrun process group uses is the one the strategy would have passed
    assert _compat.process_group_timeout(DDPStrategy(timeout=timedelta(seconds=42))) == timedelta(seconds=42)
    assert _compat.process_group_timeout(ModelParallelStrategy(timeout=timedelta(seconds=7))) == timedelta(seconds=7)
    assert _compat.process_group_timeout(DDPStrategy()) == timedelta(minutes=30)


def test_is_last_batch_follows_the_fit_loop(tmp_path):
    seen = []

    class Probe(BoringModel):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            seen.append(_compat.is_last_batch(self.trainer))

    trainer = Trainer(**quiet_trainer_kwargs(max_epochs=1, limit_train_batches=3, default_root_dir=str(tmp_path)))
    trainer.fit(Probe())
    assert seen == [False, False, True]


def test_profiler_actions_the_ledger_charges_are_the_ones_lightning_emits(tmp_path):
    profiler = SimpleProfiler(dirpath=tmp_path, filename="profile")
    trainer = Trainer(
        max_steps=2,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=str(tmp_path),
        profiler=profiler,
    )
    trainer.fit(BoringModel())
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    actions = set(profiler.recorded_durations)
    strategy = f"{_compat.STRATEGY_ACTION_PREFIX}{type(trainer.strategy).__name__}"
    expected = {
        _compat.TRAIN_FETCH_ACTION,
        _compat.TRAINING_BATCH_ACTION,
        _compat.SAVE_CHECKPOINT_ACTION,
        f"{strategy}.batch_to_device",
        f"{strategy}.training_step",
        f"{strategy}.backward",
        f"{_compat.LIGHTNING_MODULE_ACTION_PREFIX}BoringModel.optimizer_step",
    }
    assert expected <= actions, f"Lightning renamed profiler actions; GoodputMonitor misses {expected - actions}"


def test_validation_runs_are_wrapped_whole_and_unwrapped(tmp_path):
    calls: list[str] = []

    class Probe(BoringModel):
        def validation_step(self, batch, batch_idx):
            calls.append("step")
            return super().validation_step(batch, batch_idx)

    kwargs = quiet_trainer_kwargs(default_root_dir=str(tmp_path), max_steps=4, val_check_interval=2)
    trainer = Trainer(**{**kwargs, "limit_val_batches": 1})
    loop = trainer.fit_loop.epoch_loop.val_loop
    undo = _compat.wrap_validation_runs(trainer, lambda: calls.append("enter"), lambda: calls.append("leave"))
    trainer.fit(Probe())
    assert calls == ["enter", "step", "leave"] * 2
    undo()
    assert "run" not in loop.__dict__  # the class's own run again


def test_private_lightning_names_only_in_compat():
    offenders = []
    root = PACKAGE.parent
    for path in [*PACKAGE.rglob("*.py"), *(root / "tests").rglob("*.py"), *(root / "benchmarks").rglob("*.py")]:
        if path.name in ("_compat.py", "test_compat.py"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = "" if "``" in line else line.split("#", 1)[0]
            if PRIVATE.search(line) or TORCH_PRIVATE.search(code):
                offenders.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    assert not offenders, "Lightning and torch private names outside _compat.py:\n" + "\n".join(offenders)


def test_dispatch_mode_check_sees_a_flop_counter():
    from torch.utils.flop_counter import FlopCounterMode

    from lightning_accel._compat import dispatch_mode_active

    assert not dispatch_mode_active()
    with FlopCounterMode(display=False):
        assert dispatch_mode_active()
    assert not dispatch_mode_active()


def test_the_steps_progress_bar_overrides_a_method_lightning_still_has(tmp_path):
    from lightning.pytorch.callbacks import RichProgressBar

    assert list(inspect.signature(RichProgressBar._get_train_description).parameters) == ["self", "current_epoch"]
    trainer = Trainer(max_steps=3, logger=False, enable_checkpointing=False, default_root_dir=str(tmp_path))
    bar = _compat.StepsProgressBar()
    bar.setup(trainer, BoringModel(), "fit")
    trainer.fit_loop.max_epochs = -1  # what a fit bounded by max_steps runs with
    assert bar._get_train_description(0).strip() == "Epoch 0"
    assert RichProgressBar._get_train_description(bar, 0).strip() == "Epoch 0/-2"  # Lightning's own


def test_the_private_names_behind_exact_resume_are_still_there(tmp_path):
    """By name, what _compat's exact-resume helpers reach (each is also exercised end to end by
    tests/checkpoint/test_curves.py, test_due_validation.py and test_edge_cases.py)."""
    seen = {}

    class Probe(BoringModel):
        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            self.log("loss_epoch_mean", out["loss"], on_step=False, on_epoch=True)
            return out

        def on_train_batch_end(self, outputs, batch, batch_idx):
            trainer = self.trainer
            seen["due"] = _compat.validation_due_after_this_batch(trainer)
            seen["results"] = _compat.running_epoch_results(trainer)
            seen["connector"] = all(
                callable(getattr(trainer._logger_connector, n, None))
                for n in ("on_batch_end", "update_train_step_metrics")
            )
            seen["handlers"] = isinstance(trainer._signal_connector._original_handlers, dict)
            loop = trainer.fit_loop.epoch_loop
            seen["loops"] = callable(loop.update_lr_schedulers) and hasattr(loop.val_loop, "restarting")

    trainer = Trainer(**quiet_trainer_kwargs(max_steps=2, default_root_dir=str(tmp_path)))
    trainer.fit(Probe())
    assert seen["due"] is False and seen["connector"] and seen["handlers"] and seen["loops"]
    entry = seen["results"]["training_step.loss_epoch_mean"]
    assert entry["reduction"] == "mean" and entry["cumulated_batch_size"] > 0


def test_torch_private_names_the_hang_sentinel_reaches_are_still_there(tmp_path):
    """The default store (heartbeats go through it) and the NCCL flight recorder's dump (read on a hang)."""
    import torch
    import torch.distributed as dist

    from lightning_accel._compat import default_store, nccl_flight_recorder_dump

    assert callable(torch._C._distributed_c10d._dump_fr_trace)
    assert default_store() is None  # no process group
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        store = default_store()
        store.set("k", "v")
        assert store.get("k") == b"v"
    finally:
        dist.destroy_process_group()
    if not torch.cuda.is_available():
        assert nccl_flight_recorder_dump() is None


def test_the_fit_loop_batch_counters_a_world_change_recounts_are_where_the_checkpoint_keeps_them(tmp_path):
    """A checkpoint saved in on_train_batch_end holds the fit loop's per-rank batch counters at
    FIT_LOOP_BATCH_PROGRESS, current and total, each with ready/started/processed/completed (completed one behind:
    the restart logic reads that offset); rescale_train_batches keeps the offset and scales the count."""
    from lightning.pytorch import Callback

    saved = {}

    class SaveAt4(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 4 and not saved:
                trainer.save_checkpoint(tmp_path / "c.ckpt")
                saved["ck"] = torch.load(tmp_path / "c.ckpt", weights_only=False)

    trainer = Trainer(**quiet_trainer_kwargs(max_steps=5, default_root_dir=str(tmp_path), callbacks=[SaveAt4()]))
    trainer.fit(BoringModel())
    ck = saved["ck"]
    assert _compat.train_batches_in_checkpoint(ck) == 4
    counts = ck
    for key in _compat.FIT_LOOP_BATCH_PROGRESS:
        counts = counts[key]
    assert counts["current"] == {"ready": 4, "started": 4, "processed": 4, "completed": 3}
    assert _compat.rescale_train_batches(ck, 2, 1) == 8
    assert counts["current"] == counts["total"] == {"ready": 8, "started": 8, "processed": 8, "completed": 7}
    # the live counters a changed per-device batch re-counts at on_train_start: the same keys, the offset kept
    _compat.set_train_batches_done(trainer, 2)
    live = trainer.fit_loop.epoch_loop.batch_progress.state_dict()
    assert live["current"] == {"ready": 2, "started": 2, "processed": 2, "completed": 2}
    assert live["total"] == live["current"]  # one epoch so far: no earlier epochs' batches


def deepspeed_source(module: str) -> str:
    """The text of one of DeepSpeed's modules, read without importing DeepSpeed (it picks an accelerator at import)."""
    spec = importlib.util.find_spec("deepspeed")
    assert spec is not None and spec.origin is not None, "DeepSpeed is a dependency: it must be installed"
    return (Path(spec.origin).parent / module).read_text()


def test_deepspeed_still_reads_the_universal_flag_and_accumulation_where_we_set_them():
    """deepspeed_loads_universal sets engine._config.load_universal_checkpoint, which the engine reads at every
    load_checkpoint; AccelDeepSpeedStrategy follows an accumulation change with the public set_train_batch_size
    and the ZeRO-1/2 optimizer's own gradient_accumulation_steps (read when gradients are offloaded)."""
    engine = deepspeed_source("runtime/engine.py")
    assert "return self._config.load_universal_checkpoint" in engine
    assert 'latest_tag = "latest_universal" if self.load_universal_checkpoint() else "latest"' in engine
    assert "def set_train_batch_size(self, train_batch_size):" in engine
    assert "def backward(self, loss, retain_graph=False, scale_wrt_gas=True):" in engine
    zero = deepspeed_source("runtime/zero/stage_1_and_2.py")
    assert "self.gradient_accumulation_steps = gradient_accumulation_steps" in zero
    config = SimpleNamespace(load_universal_checkpoint=False)
    with _compat.deepspeed_loads_universal(SimpleNamespace(_config=config)):
        assert config.load_universal_checkpoint is True
    assert config.load_universal_checkpoint is False
    converter = deepspeed_source("checkpoint/ds_to_universal.py")
    for option in ("input_folder", "output_folder", "num_extract_workers", "num_merge_workers", "keep_temp_folder"):
        assert f"args.{option}" in converter, option
    assert "args.strict" in converter and "args.inject_missing_state" in converter
    assert "latest_file = os.path.join(checkpoint_root_folder, 'latest_universal')" in converter


def test_torch_workarounds_are_checked_again_when_torch_reaches_their_bound():
    """Each torch workaround in _compat applies below the first version assumed fixed (the next minor after the
    newest torch checked). A torch at that bound fails here: check each flaw again, then raise the bounds (or drop
    the workaround) and NEWEST_TORCH_CHECKED."""
    from torch.torch_version import TorchVersion

    from lightning_accel import _compat

    version = TorchVersion(torch.__version__)
    assert version < "2.15", (
        f"torch {torch.__version__} is past {_compat.NEWEST_TORCH_CHECKED}, the newest the workarounds in "
        "lightning_accel/_compat.py were checked on (SHARED_RENDEZVOUS_STORE_LOSES_JOINERS): check them again"
    )
    assert _compat.SHARED_RENDEZVOUS_STORE_LOSES_JOINERS


def test_the_deprecation_our_cli_silences_is_still_raised_and_silenced():
    """Lightning's _pytree builds torch's deprecated LeafSpec at every fit: torch still warns (once it stops, drop
    quiet_known_deprecations), and after quiet_known_deprecations() the CLI's output does not show it."""
    import warnings

    from torch.utils._pytree import LeafSpec  # (what Lightning's _pytree builds)

    from lightning_accel._compat import quiet_known_deprecations

    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        LeafSpec()
    assert any("`isinstance(treespec, LeafSpec)` is deprecated" in str(w.message) for w in raised)
    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        quiet_known_deprecations()
        LeafSpec()
    assert not raised
