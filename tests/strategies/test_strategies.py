"""Strategy presets: registry entries, exact generated configs, real 2-process runs on gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from torch import nn

import lightning_accel
from lightning_accel._compat import ddp_kwargs
from lightning_accel.demos import GPTBlock, TinyGPT
from lightning_accel.strategies import (
    PRESETS,
    AccelDDPStrategy,
    AccelDeepSpeedStrategy,
    AccelFSDPStrategy,
    check_strategy_name,
    find_block_classes,
    zero3_config,
)
from tests.conftest import requires_cuda

ROOT = Path(__file__).resolve().parents[2]


def test_presets_registered_and_stock_names_kept():
    for name, preset in PRESETS.items():
        assert name in StrategyRegistry
        assert StrategyRegistry[name]["description"] == preset.description
    for stock in ("ddp", "deepspeed_stage_2", "fsdp"):
        assert stock in StrategyRegistry
    lightning_accel.strategies.register_presets()  # idempotent


_EXIT_PROBE = """
import atexit, gc, os, sys, tempfile
import torch, torch.distributed as dist

def gloo_threads():
    count = 0
    for t in os.listdir("/proc/self/task"):
        try:
            count += open(f"/proc/self/task/{t}/comm").read().startswith("pt_gloo")
        except FileNotFoundError:  # a thread that ended since the listing
            pass
    return count

# atexit runs handlers last-registered-first: this one, registered before lightning_accel's hook,
# runs after it and sees what that hook left behind.
atexit.register(lambda: print("at exit:", dist.is_initialized(), gloo_threads(), flush=True))
import lightning.pytorch  # imports torch._dynamo, which must come before the group exists, as in a real run
import lightning_accel  # registers nothing at exit on its own ("import-only")
if sys.argv[1] == "explicit":
    lightning_accel.strategies.close_gloo_process_group_at_exit()
if sys.argv[1] == "accel_ddp":  # our DDP preset registers the hook when it creates a gloo group
    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel
    Trainer(accelerator="cpu", devices=1, strategy="accel_ddp", max_steps=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0).fit(BoringModel())
    print("running:", gloo_threads(), flush=True)
    sys.exit(0)
gc.disable()  # only an explicit collection may free the cycle below
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
dist.all_reduce(torch.ones(2))
holder = {"pg": dist.group.WORLD}
holder["self"] = holder  # like Lightning's trainer/strategy/model cycles that hold the group
del holder
print("running:", gloo_threads(), flush=True)
"""


@pytest.mark.parametrize(
    ("imports", "closed_at_exit"), [("explicit", True), ("accel_ddp", True), ("import-only", False)]
)
def test_gloo_process_group_closed_before_interpreter_exit(imports, closed_at_exit):
    # The control run (import only: no side effect) shows the group and its threads would otherwise
    # still be alive at exit, where gloo's threads can abort a finished run with SIGABRT.
    proc = subprocess.run([sys.executable, "-c", _EXIT_PROBE, imports], capture_output=True, text=True, timeout=120)
    # the control may itself die of the abort (-6) the hook prevents
    assert proc.returncode == 0 or (not closed_at_exit and proc.returncode == -6), proc.stderr[-2000:]
    running, at_exit = proc.stdout.strip().splitlines()[-2:]
    assert running in ("running: 1", "running: 2")  # gloo's worker threads (at least the one that ran the op)
    if closed_at_exit:
        assert at_exit == "at exit: False 0"
    else:  # still open, gloo threads still running (how many of the two are named yet varies)
        assert at_exit in ("at exit: True 1", "at exit: True 2")


def test_ddp_presets_pass_tuned_kwargs():
    ddp = StrategyRegistry.get("accel_ddp")
    assert type(ddp) is AccelDDPStrategy and isinstance(ddp, DDPStrategy)  # only adds the gloo exit hook
    assert ddp_kwargs(ddp) == {"bucket_cap_mb": 100, "gradient_as_bucket_view": True, "find_unused_parameters": False}
    assert ddp_kwargs(StrategyRegistry.get("accel_ddp_static"))["static_graph"] is True


def test_zero_presets_exact():
    # Stages 1-2: Lightning's own config from DeepSpeedStrategy(stage=..., offload_optimizer=...).
    zero2 = StrategyRegistry.get("accel_zero2")
    assert isinstance(zero2, AccelDeepSpeedStrategy)
    z = zero2.config["zero_optimization"]
    assert (z["stage"], z["overlap_comm"], z["contiguous_gradients"]) == (2, True, True)
    assert (z["reduce_bucket_size"], z["allgather_bucket_size"]) == (200_000_000, 200_000_000)
    assert "offload_optimizer" not in z
    assert zero2.config["zero_allow_untested_optimizer"] is True
    assert zero2.config["zero_force_ds_cpu_optimizer"] is False
    offload = StrategyRegistry.get("accel_zero2_offload").config
    assert offload["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert offload["zero_optimization"]["offload_optimizer"]["pin_memory"] is True
    assert offload["zero_force_ds_cpu_optimizer"] is False
    # Stage 3: ours, for the knobs Lightning has no arguments for.
    bucket = 200_000_000
    pinned = {"device": "cpu", "pin_memory": True}
    assert zero3_config(offload=True) == {
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
            "stage3_prefetch_bucket_size": bucket,
            "stage3_param_persistence_threshold": 100_000,
            "stage3_max_live_parameters": 1_000_000_000,
            "stage3_gather_16bit_weights_on_model_save": True,
            "offload_optimizer": pinned,
            "offload_param": pinned,
        },
        "zero_allow_untested_optimizer": True,
    }
    zero3 = StrategyRegistry.get("accel_zero3_offload")
    assert zero3.config == {**zero3_config(offload=True), "zero_force_ds_cpu_optimizer": False}
    with pytest.raises(ValueError, match="bucket_mb must be positive, got 0"):
        zero3_config(bucket_mb=0)


def test_zero_preset_config_is_never_shared_between_trainers():
    first, second = StrategyRegistry.get("accel_zero3"), StrategyRegistry.get("accel_zero3")
    first.config["train_micro_batch_size_per_gpu"] = 64  # what Lightning writes during a run
    assert "train_micro_batch_size_per_gpu" not in second.config
    assert first.config["zero_optimization"] is not second.config["zero_optimization"]


def test_deepspeed_preset_on_cpu_is_a_clear_error_that_leaves_the_process_clean():
    # At Trainer(...), not at fit: Lightning's own check at fit comes after its launcher wrote
    # MASTER_PORT/LOCAL_RANK into os.environ, and a later DDP subprocess then waits for peers forever.
    before = dict(os.environ)
    with pytest.raises(ValueError, match=r"need CUDA GPUs, but the accelerator is CPUAccelerator.*'accel_ddp'"):
        Trainer(strategy="accel_zero2", accelerator="cpu", logger=False)
    assert dict(os.environ) == before


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError, match="Did you mean 'accel_fsdp'") as err:
        check_strategy_name("accel_fsdpp")
    assert all(name in str(err.value) for name in PRESETS)
    assert check_strategy_name("ddp") == "ddp"


def test_fsdp_block_detection():
    model = TinyGPT(n_layers=3)
    assert find_block_classes(model) == {GPTBlock}
    assert find_block_classes(model, ["LayerNorm"]) == {nn.LayerNorm}
    with pytest.raises(ValueError, match="do not occur in TinyGPT"):
        find_block_classes(model, ["Conv2d"])
    with pytest.raises(ValueError, match="mixed_precision must be None or 'bf16'"):
        AccelFSDPStrategy(mixed_precision="fp16")


def test_fsdp_shards_the_children_a_training_step_may_call_beside_the_blocks():
    """A module whose training_step calls self.net(x) never runs the root's hooks: its direct children holding
    parameters become units. Containers and children sharing a tied weight stay with the root."""
    from lightning_accel.blocks import children_beside_blocks

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8, bias=False), nn.BatchNorm1d(8), nn.Linear(8, 1))
            self.embed, self.head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight  # tied: one unit (the root's)
            self.heads = nn.ModuleList([nn.Linear(4, 2), nn.Linear(4, 3)])  # a container: never a unit itself
            self.loss = nn.MSELoss()  # no parameters

    model = Model()
    blocks = find_block_classes(model)
    assert blocks == {nn.Linear}  # the ModuleList's children are Linears, so Linear is the block class here
    assert children_beside_blocks(model, set()) == [model.net]
    assert children_beside_blocks(model, blocks) == [model.net]  # BatchNorm's parameters are outside the Linears
    gpt = TinyGPT(n_layers=2)
    assert [type(c).__name__ for c in children_beside_blocks(gpt, {GPTBlock})] == [
        type(c).__name__ for c in gpt.children() if not isinstance(c, nn.ModuleList) and list(c.parameters())
    ]


# One two-rank launch trains every configuration below in turn (tests/strategies/train_distributed.py --run): the
# process start and the imports are paid once, not once per configuration.
RUNS = {
    "ddp": "--strategy accel_ddp",
    "fsdp": "--strategy accel_fsdp_fp32",
    "fsdp_ac": "--strategy accel_fsdp_fp32 --activation-checkpointing",
    "fsdp_bf16": "--strategy accel_fsdp",
    "fsdp_fp8": "--strategy accel_fsdp_fp32 --fp8",  # torchao's emulation on CPU; the all-gather path is the GPU's
    "ddp_compile": "--strategy accel_ddp --compile --max-steps 10",
}


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("two_ranks")
    cmd = [sys.executable, str(ROOT / "tests/strategies/train_distributed.py"), "--out", str(out)]
    cmd += [arg for name, options in RUNS.items() for arg in ("--run", f"{name}={options}")]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return out


def load_rank(out: Path, rank: int):
    return torch.load(out / f"weights_rank{rank}.pt"), json.loads((out / f"losses_rank{rank}.json").read_text())


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ddp_and_fsdp2_train_for_real_on_gloo(two_rank_runs):
    results = {}
    for key in ("ddp", "fsdp", "fsdp_ac", "fsdp_bf16", "fsdp_fp8"):
        out = two_rank_runs / key
        w0, losses0 = load_rank(out, 0)
        w1, losses1 = load_rank(out, 1)
        assert all(torch.equal(w0[k], w1[k]) for k in w0), f"{key}: ranks disagree"
        assert losses0[-1] < 0.5 * losses0[0], f"{key}: loss did not fall ({losses0[0]} -> {losses0[-1]})"
        assert losses0 != losses1  # each rank saw its own shard of the data
        ckpts = list((out / "ckpt").iterdir())
        assert [p.name for p in ckpts] == ["epoch=1-step=30.ckpt"] and ckpts[0].is_file()  # one file, rank 0
        saved = torch.load(ckpts[0], weights_only=False)["state_dict"]
        assert all(torch.equal(saved[k], w0[k]) for k in w0)
        results[key] = w0
        assert (out / "strategy_rank0.txt").read_text() == ("AccelDDPStrategy" if key == "ddp" else "AccelFSDPStrategy")
    # Same data, same seed: sharded training computes the same model as DDP (fp32, gloo) ...
    for k, v in results["ddp"].items():
        torch.testing.assert_close(results["fsdp"][k], v, rtol=1e-5, atol=1e-6)
        # ... activation checkpointing only recomputes, it changes nothing ...
        torch.testing.assert_close(results["fsdp_ac"][k], results["fsdp"][k], rtol=1e-5, atol=1e-6)
    # ... and bf16 compute really is a different (lower) precision
    assert not all(torch.equal(results["fsdp_bf16"][k], v) for k, v in results["fsdp"].items())
    # fp8 under FSDP2: every block's linear layers converted, their shards torchao's fp8-casting weights (FSDP2
    # all-gathers them in fp8), state-dict keys unchanged, and the numerics really are fp8's
    fp8 = json.loads((two_rank_runs / "fsdp_fp8" / "fp8_rank0.json").read_text())
    assert fp8["converted"] == [f"blocks.{b}.{layer}" for b in (0, 1) for layer in ("qkv", "proj", "mlp.0", "mlp.2")]
    assert "WeightWithDynamicFloat8CastTensor" in fp8["shards"]
    assert set(results["fsdp_fp8"]) == set(results["fsdp"])
    assert not all(torch.equal(results["fsdp_fp8"][k], v) for k, v in results["fsdp"].items())


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ddp_with_compile_callback_on_gloo(two_rank_runs):
    w0, losses = load_rank(two_rank_runs / "ddp_compile", 0)
    w1, _ = load_rank(two_rank_runs / "ddp_compile", 1)
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    assert losses[-1] < losses[0]
    assert len(losses) == 10 and w0.keys() == load_rank(two_rank_runs / "ddp", 0)[0].keys()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_zero_configs_run_on_deepspeeds_cpu_engine_and_their_folders_resume_from_a_bucket(bucket):
    """Lightning refuses DeepSpeed on CPU; DeepSpeed's own engine on its CPU accelerator does not. Its checkpoint of
    SGD's state cannot become a universal checkpoint (Adam's moments only): said plainly, naming the fix. Its ZeRO-2
    and ZeRO-3 folders, sealed and uploaded as PreemptionCheckpoint does it, resume from the bucket (moto's S3
    server) on an empty machine into a new engine, bitwise."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests/strategies/deepspeed_cpu_engine.py")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
        env={**os.environ, "MASTER_PORT": "29541", "BUCKET_URL": f"s3://{bucket}/ds"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    runs = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [r["stage"] for r in runs] == [2, 3]
    for r in runs:
        assert r["bucket"]["bitwise"] and r["bucket"]["found_under_cache"] and r["bucket"]["saved_ranks"] == 1, r
        files = r["bucket"]["files"]  # DeepSpeed's own layout, every file of it in the bucket's manifest
        assert "latest" in files and any(f.startswith("checkpoint/") and "optim_states" in f for f in files), files
        assert r["losses"][-1] < r["losses"][0]
        named, tried = r["universal"]
        assert "the optimizer is SGD. The universal checkpoint carries Adam-family state only" in named, named
        assert "Resume on the number of ranks that saved it" in named and "Resume on the number" in tried
        assert "checkpoint" in r["left"] and not [n for n in r["left"] if "universal" in n]  # nothing half-written


def test_a_zero_folder_tells_how_many_ranks_wrote_it_and_a_finished_conversion_is_reused(tmp_path):
    """The saved size is the number of optimizer partitions of model-parallel rank 0 (bf16 ones too); a folder
    whose latest_universal names its conversion is not converted again."""
    from lightning_accel.strategies.deepspeed_universal import saved_data_parallel_size, universal_checkpoint_for

    assert saved_data_parallel_size(tmp_path) is None  # no "latest": not DeepSpeed's
    (tmp_path / "latest").write_text("checkpoint")
    shards = tmp_path / "checkpoint"
    shards.mkdir()
    assert saved_data_parallel_size(tmp_path) is None  # no optimizer state saved
    for name in ("mp_rank_00_model_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        (shards / name).write_bytes(b"")
    (shards / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"")
    (shards / "bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt").write_bytes(b"")  # tensor parallel: not a DP rank
    assert saved_data_parallel_size(tmp_path) == 2
    (tmp_path / "checkpoint_universal").mkdir()
    (tmp_path / "latest_universal").write_text("checkpoint_universal\n")
    assert universal_checkpoint_for(tmp_path) == tmp_path / "checkpoint_universal"  # reused: these shards are empty
    with pytest.raises(RuntimeError, match="no DeepSpeed 'latest' file"):
        universal_checkpoint_for(tmp_path / "checkpoint")


@requires_cuda
def test_zero2_preset_trains_on_gpu(tmp_path):
    from lightning_accel.demos import SyntheticTokenDataModule

    trainer = Trainer(
        accelerator="gpu",
        devices=1,
        strategy="accel_zero2",
        precision="bf16-mixed",
        max_steps=5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(TinyGPT(), datamodule=SyntheticTokenDataModule())
    assert trainer.global_step == 5
    assert isinstance(trainer.strategy, AccelDeepSpeedStrategy)
    assert type(trainer.strategy.model).__name__ == "DeepSpeedEngine"
    assert trainer.strategy.model.zero_optimization_stage() == 2
    assert torch.isfinite(trainer.callback_metrics["train_loss"])
