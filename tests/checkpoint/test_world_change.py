"""Resuming on another number of ranks: one global data order, the global batch kept, the loop counters re-counted,
and what cannot follow refused with the fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import DeepSpeedStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from lightning_accel import PreemptionCheckpoint, ResumableDataLoader, find_resume_checkpoint
from lightning_accel._compat import FIT_LOOP_BATCH_PROGRESS
from lightning_accel.checkpoint import atomic_save
from lightning_accel.checkpoint.batch_change import BatchChange, plan_batch_change
from lightning_accel.checkpoint.preemption import EPOCH_STATE_KEY
from lightning_accel.checkpoint.rng import rng_for_rank, seeded_rng
from lightning_accel.checkpoint.world_change import (
    CONFIGURED_KEY,
    WORLD_KEY,
    WorldChange,
    accumulation_to_keep,
    apply_world_change,
    plan_world_change,
)
from lightning_accel.data import ResumableSampler
from lightning_accel.strategies.deepspeed import AccelDeepSpeedStrategy
from tests.conftest import tiny_trainer_kwargs

ROOT = Path(__file__).resolve().parents[2]


# -- the global order ---------------------------------------------------------------------------------------------
def dealt(n: int, batch: int, world: int, start: int = 0, drop_last: bool = False, epoch: int = 1) -> list[list[int]]:
    """Each rank's samples, from ``start`` (a global slot) on."""
    ranks = []
    for rank in range(world):
        sampler = ResumableSampler(
            range(n), seed=5, num_replicas=world, rank=rank, batch_size=batch, drop_last=drop_last
        )
        sampler.set_epoch(epoch)
        sampler.start_next_epoch_at(start)
        ranks.append(list(sampler))
    return ranks


def in_slot_order(ranks: list[list[int]], batch: int) -> list[int]:
    """Rank 0's first batch, rank 1's first batch, ... rank 0's second batch: the order the slots were dealt in."""
    batches = [[r[i : i + batch] for i in range(0, len(r), batch)] for r in ranks]
    return [i for m in range(max(map(len, batches))) for b in batches if m < len(b) for i in b[m]]


@pytest.mark.parametrize("n", [96, 22])  # even, and an epoch whose last batch is short and does not deal evenly
def test_the_sampler_deals_one_global_order_whatever_the_world_size(n):
    whole = in_slot_order(dealt(n, 4, 1), 4)
    assert sorted(whole) == list(range(n)) and whole != list(range(n))  # a shuffled permutation, every sample once
    for world in (2, 3, 4):
        ranks = dealt(n, 4, world)
        assert in_slot_order(ranks, 4)[:n] == whole, world  # then the epoch's first slots again, to even the ranks
        assert (
            len({len(ResumableSampler(range(n), num_replicas=world, rank=r, batch_size=4)) for r in range(world)}) == 1
        )
        # a run that consumed the first 6 slots at any size goes on at this one with the same samples, in order
        assert in_slot_order(dealt(n, 4, world, start=6), 4)[: n - 24] == whole[24:], world
    # drop_last: the short batch and the slots that do not deal evenly go; every rank has as many full batches
    ranks = dealt(n, 4, 3, drop_last=True)
    assert len({len(r) for r in ranks}) == 1 and all(len(r) % 4 == 0 for r in ranks)
    assert in_slot_order(ranks, 4) == whole[: len(in_slot_order(ranks, 4))]
    # with one sample per slot it is DistributedSampler's split: rank r takes order[r::W]
    one = in_slot_order(dealt(n, 1, 1), 1)
    assert dealt(n, 1, 2) == [(one + one[: n % 2])[0::2], (one + one[: n % 2])[1::2]]


def test_a_loader_saved_on_two_ranks_goes_on_at_one_and_refuses_a_split_that_does_not_divide():
    data = torch.arange(40)
    ranks = [
        ResumableDataLoader(data, 4, seed=1, sampler=ResumableSampler(data, seed=1, num_replicas=2, rank=r))
        for r in (0, 1)
    ]
    iterators = [iter(loader) for loader in ranks]
    seen = [[next(it) for _ in range(2)] for it in iterators]  # two batches on each rank: slots 0-3
    state = ranks[0].state_dict()
    assert state == {"epoch": 0, "batches_consumed": 2, "world_size": 2, "batch_size": 4, "order": 2}
    one = ResumableDataLoader(data, 4, seed=1)
    one.load_state_dict(state)
    rest = list(one)
    assert len(one) == 10 and len(rest) == 6  # the epoch's 10 batches, 4 of them done
    done = torch.cat([seen[0][0], seen[1][0], seen[0][1], seen[1][1]])
    assert sorted(torch.cat([done, *rest]).tolist()) == list(range(40))  # every sample once, none twice
    assert one.state_dict() == {"epoch": 1, "batches_consumed": 0, "world_size": 1, "batch_size": 4, "order": 2}
    three = ResumableDataLoader(data, 4, seed=1, sampler=ResumableSampler(data, seed=1, num_replicas=3, rank=0))
    three.load_state_dict(state)
    with pytest.raises(
        ValueError, match=r"16 samples into epoch 0\) is not a whole number of batches of 4 on each of 3"
    ):
        iter(three)


# -- the loop, the accumulation, the generators -------------------------------------------------------------------
class Net(LightningModule):
    """BatchNorm, Dropout, a per-step LR schedule and validation, as a user's model has them."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.Dropout(0.2), nn.ReLU(), nn.Linear(32, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", nn.functional.cross_entropy(self.net(batch[0]), batch[1]))

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return [opt], [{"scheduler": torch.optim.lr_scheduler.StepLR(opt, 2, 0.5), "interval": "step"}]


def data(n: int = 96) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 2, (n,), generator=g))


def batch_progress(checkpoint: dict) -> dict:
    for key in FIT_LOOP_BATCH_PROGRESS:
        checkpoint = checkpoint.setdefault(key, {})
    return checkpoint


def as_if_written_by_two_ranks(path: str) -> None:
    """Rewrite a one-rank checkpoint as two ranks with half the accumulation would have written it at that step:
    each rank half the batches, one RNG state and one epoch state per rank."""
    ck = torch.load(path, weights_only=False)
    ck[WORLD_KEY] = {"world_size": 2, "accumulate_grad_batches": ck[WORLD_KEY]["accumulate_grad_batches"] // 2}
    progress = batch_progress(ck)
    for counts in (progress["current"], progress["total"]):
        ready = counts["ready"]
        counts.update({key: ready // 2 + count - ready for key, count in counts.items()})
    for state in ck["loops"]["fit_loop"]["state_dict"]["combined_loader"]:
        if "world_size" in state:  # ResumableDataLoader's
            state.update(batches_consumed=state["batches_consumed"] // 2, world_size=2)
    callback = ck["callbacks"]["PreemptionCheckpoint"]
    callback.update(rng_states=[callback["rng_states"][0], seeded_rng(7)], world_size=2)
    ck[EPOCH_STATE_KEY] = ck[EPOCH_STATE_KEY] * 2
    atomic_save(ck, path)


def fit(tmp_path, train_loader, max_steps: int, accumulate: int, ckpt_path=None) -> tuple[Trainer, Net]:
    torch.manual_seed(0)
    model = Net()
    callbacks = [PreemptionCheckpoint(tmp_path / "ck", every_n_steps=3, keep_last=None)]
    kwargs = dict(max_steps=max_steps, accumulate_grad_batches=accumulate, callbacks=callbacks, limit_val_batches=1)
    trainer = Trainer(**tiny_trainer_kwargs(tmp_path, **kwargs))
    trainer.fit(model, train_loader, DataLoader(data(16), batch_size=8), ckpt_path=ckpt_path)
    return trainer, model


def test_a_two_rank_checkpoint_resumed_on_one_rank_doubles_the_accumulation_and_continues_bitwise(tmp_path, caplog):
    """A one-rank run accumulating 2 is what two ranks accumulating 1 compute (same batches, same steps). Its
    checkpoint at step 3, rewritten as two ranks would have written it, resumed on one rank with the two-rank
    script's accumulate_grad_batches=1: the accumulation becomes 2 (logged, old and new), and steps 4-8 (past an
    epoch end and its validation, with Dropout drawing from rank 0's saved generators) are bitwise the one-rank
    run's, twice over."""
    loader = lambda: ResumableDataLoader(data(), batch_size=8, shuffle=True, seed=2)  # noqa: E731
    whole_trainer, whole = fit(tmp_path / "whole", loader(), 8, 2)
    fit(tmp_path, loader(), 3, 2)
    saved = find_resume_checkpoint(tmp_path / "ck")
    assert Path(saved).name == "step=00000003.ckpt"
    as_if_written_by_two_ranks(saved)
    for attempt in range(2):
        with caplog.at_level("WARNING"), pytest.warns(UserWarning, match="resumed on 1 rank\\(s\\) from 2. Exact"):
            trainer, resumed = fit(tmp_path / f"again{attempt}", loader(), 8, 1, ckpt_path=saved)
        assert "2 -> 1 rank(s), accumulate_grad_batches 1 -> 2" in caplog.text
        assert "(6 of this epoch's batches per rank done)" in caplog.text
        assert trainer.accumulate_grad_batches == 2 and trainer.global_step == 8
        assert trainer.current_epoch == whole_trainer.current_epoch
        assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 8
        expected = whole.state_dict()
        assert all(torch.equal(t, expected[k]) for k, t in resumed.state_dict().items()), attempt
    assert whole_trainer.optimizers[0].param_groups[0]["lr"] == trainer.optimizers[0].param_groups[0]["lr"]
    # preempted again and resumed on 1 rank with the same script (accumulate_grad_batches=1): the run's 2 is kept
    again = tmp_path / "again0" / "ck" / "step=00000007.ckpt"  # (step 8 ends the fit)
    with caplog.at_level("INFO"):
        trainer, resumed = fit(tmp_path / "once-more", loader(), 8, 1, ckpt_path=again)
    assert "keeping accumulate_grad_batches=2" in caplog.text
    assert trainer.accumulate_grad_batches == 2 and trainer.global_step == 8
    assert all(torch.equal(t, expected[k]) for k, t in resumed.state_dict().items())


class Recording(Net):
    """Net that records, by optimizer step, which samples (their first feature) each micro-batch trained."""

    def __init__(self) -> None:
        super().__init__()
        self.trained: dict[int, list[float]] = {}

    def training_step(self, batch, batch_idx):
        self.trained.setdefault(self.trainer.global_step + 1, []).extend(batch[0][:, 0].tolist())
        return super().training_step(batch, batch_idx)


def fit_recording(tmp_path, batch: int, max_steps: int, accumulate: int, ckpt_path=None) -> tuple[Trainer, Recording]:
    torch.manual_seed(0)
    model = Recording()
    loader = ResumableDataLoader(data(), batch_size=batch, shuffle=True, seed=2)
    callbacks = [PreemptionCheckpoint(tmp_path / "ck", every_n_steps=3, keep_last=None)]
    kwargs = dict(max_steps=max_steps, accumulate_grad_batches=accumulate, callbacks=callbacks, limit_val_batches=1)
    trainer = Trainer(**tiny_trainer_kwargs(tmp_path, **kwargs))
    trainer.fit(model, loader, DataLoader(data(16), batch_size=8), ckpt_path=ckpt_path)
    return trainer, model


def test_a_changed_per_device_batch_keeps_the_global_batch_and_every_sample_or_is_refused_before_a_step(
    tmp_path, caplog
):
    """The issue's case: two ranks x batch 8 preempted at step 3, resumed on one rank x batch 16 with the two-rank
    script's accumulate_grad_batches=1. The global batch of 16 holds (no accumulation on top), and every optimizer
    step to step 8 (past an epoch end) trains the samples of the uninterrupted one-rank x 16 run. The same change
    at one rank (8 x accumulate 2 -> 16) too. A batch that cannot make the global batch up is refused before a step,
    naming the sizes that can; so is a loader that saved its position in its own batches."""
    whole_trainer, whole = fit_recording(tmp_path / "whole", 16, 8, 1)
    assert sorted(whole.trained) == list(range(1, 9)) and all(len(s) == 16 for s in whole.trained.values())
    _, first = fit_recording(tmp_path, 8, 3, 2)
    saved = find_resume_checkpoint(tmp_path / "ck")
    assert Path(saved).name == "step=00000003.ckpt"
    assert torch.load(saved, weights_only=False)[WORLD_KEY]["batch_size"] == 8
    for world in (1, 2):
        if world == 2:
            as_if_written_by_two_ranks(saved)  # 2 ranks x 8, accumulating 1
        caplog.clear()
        with caplog.at_level("WARNING"), pytest.warns(UserWarning, match="per-device batch of 16 from 8. Exact"):
            trainer, resumed = fit_recording(tmp_path / f"on{world}", 16, 8, 1 if world == 2 else 2, ckpt_path=saved)
        assert trainer.accumulate_grad_batches == 1 and trainer.global_step == 8, world
        assert f"per-device batch 8 -> 16 on {world} -> 1 rank(s)" in caplog.text
        assert "the global batch is 16 samples (it was 16)" in caplog.text and "from sample 48 " in caplog.text
        got = {**{step: first.trained[step] for step in (1, 2, 3)}, **resumed.trained}
        assert {k: sorted(v) for k, v in got.items()} == {k: sorted(v) for k, v in whole.trained.items()}, world
        assert trainer.current_epoch == whole_trainer.current_epoch
        assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 8
    # 12 per device cannot make 16: refused before the first resumed step, with the batches that can
    with pytest.raises(
        ValueError, match=r"global batch of 16 samples; a per-device batch of 12 on 1.*in \[1, 2, 4, 8, 16\]"
    ):
        fit_recording(tmp_path / "twelve", 12, 8, 1, ckpt_path=saved)
    assert not (tmp_path / "twelve" / "ck").exists() or not list((tmp_path / "twelve" / "ck").glob("*.ckpt"))
    stateful = lambda b: StatefulDataLoader(data(), batch_size=b)  # noqa: E731
    model = Net()
    trainer = Trainer(
        **tiny_trainer_kwargs(
            tmp_path / "sf", max_steps=3, callbacks=[PreemptionCheckpoint(tmp_path / "sf" / "ck", every_n_steps=3)]
        )
    )
    trainer.fit(model, stateful(8))
    trainer = Trainer(
        **tiny_trainer_kwargs(tmp_path / "sf2", max_steps=6, callbacks=[PreemptionCheckpoint(tmp_path / "sf2" / "ck")])
    )
    with pytest.raises(ValueError, match=r"changed from 8 to 16, but the train loader \(StatefulDataLoader\)"):
        trainer.fit(Net(), stateful(16), ckpt_path=find_resume_checkpoint(tmp_path / "sf" / "ck"))
    assert trainer.global_step == 3


def test_the_batch_change_arithmetic_keeps_the_global_batch_or_names_the_sizes_that_do():
    saved = {"world_size": 2, "accumulate_grad_batches": 1}
    assert plan_batch_change(saved, 8, 6, 16, 1, None) == BatchChange(8, 2, 1, 16, 1, 1, 6)
    assert plan_batch_change(saved, 8, 6, 4, 1, None) == BatchChange(8, 2, 1, 4, 1, 4, 24)  # halved: accumulate 4
    assert plan_batch_change({"world_size": 3, "accumulate_grad_batches": 1}, 8, 2, 12, 2, None).accumulation == 1
    with pytest.raises(ValueError, match=r"global batch of 16 samples.*batch of 16 on 4 rank\(s\).*in \[1, 2, 4\]"):
        plan_batch_change(saved, 8, 6, 16, 4, None)
    # the user's own accumulation holds: the global batch changes, the position must still be whole batches
    mine = plan_batch_change(saved, 8, 6, 16, 1, 2)
    assert (mine.accumulation, mine.global_batch, mine.saved_global_batch, mine.batches_done) == (2, 32, 16, 6)
    with pytest.raises(
        ValueError, match=r"stops 96 samples into its epoch \(6 batch\(es\) of 8 on each of 2.*batches of 10"
    ):
        plan_batch_change(saved, 8, 6, 10, 1, 3)


def test_a_loader_that_saved_per_rank_positions_is_refused_naming_the_fix(tmp_path):
    def loader():
        return StatefulDataLoader(
            data(), batch_size=8, sampler=StatefulDistributedSampler(data(), num_replicas=1, rank=0)
        )

    fit(tmp_path, loader(), 3, 2)
    saved = find_resume_checkpoint(tmp_path / "ck")
    as_if_written_by_two_ranks(saved)
    with pytest.raises(RuntimeError, match=r"StatefulDataLoader over StatefulDistributedSampler.*ResumableDataLoader"):
        fit(tmp_path / "again", loader(), 8, 1, ckpt_path=saved)


def test_rank_generators_are_kept_or_derived_the_same_way_every_time():
    states = [seeded_rng(1), seeded_rng(2)]
    assert rng_for_rank(states, 1) is states[1]
    joined = rng_for_rank(states, 2)
    assert torch.equal(joined["torch"], rng_for_rank(states, 2)["torch"])  # the same on every resume
    assert not torch.equal(joined["torch"], states[0]["torch"])  # and not a copy of rank 0's dropout masks
    assert not torch.equal(joined["torch"], rng_for_rank(states, 3)["torch"])


def trainer_like(world_size: int, accumulate: int, strategy=None, automatic: bool = True) -> SimpleNamespace:
    return SimpleNamespace(
        world_size=world_size,
        accumulate_grad_batches=accumulate,
        strategy=strategy,
        is_global_zero=True,
        lightning_module=SimpleNamespace(automatic_optimization=automatic),
    )


def test_the_global_batch_is_kept_where_it_divides_and_the_refusals_say_what_would():
    assert plan_world_change({"world_size": 4, "accumulate_grad_batches": 2}, trainer_like(4, 2)) is None
    change = plan_world_change({"world_size": 4, "accumulate_grad_batches": 3}, trainer_like(2, 3))
    assert change == WorldChange(4, 2, 3, 6) and change.keeps_global_batch
    assert plan_world_change({"world_size": 2, "accumulate_grad_batches": 4}, trainer_like(8, 4)).accumulation == 1
    with pytest.raises(ValueError, match=r"12 per-rank batches a step; 8 rank\(s\).*Resume on \[1, 2, 3, 4, 6, 12\]"):
        plan_world_change({"world_size": 4, "accumulate_grad_batches": 3}, trainer_like(8, 3))
    # a run that went 2 -> 1 (accumulation 2 -> 4) with a script that says 2 throughout: on 4 ranks 1, on 1 rank 4
    went = {"world_size": 1, "accumulate_grad_batches": 4, CONFIGURED_KEY: 2}
    assert plan_world_change(went, trainer_like(4, 2)) == WorldChange(1, 4, 4, 1)
    assert plan_world_change(went, trainer_like(1, 2)) is None and accumulation_to_keep(went, trainer_like(1, 2)) == 4
    assert accumulation_to_keep(went, trainer_like(1, 8)) is None  # the user chose 8 now: theirs
    assert plan_world_change(went, trainer_like(4, 8)) == WorldChange(1, 4, 4, 8)
    # the user chose an accumulation for the new size: theirs holds, and a changed global batch is said
    mine = plan_world_change({"world_size": 4, "accumulate_grad_batches": 3}, trainer_like(8, 1))
    assert mine == WorldChange(4, 8, 3, 1) and not mine.keeps_global_batch
    ck: dict = {}
    batch_progress(ck).update(current={"ready": 6}, total={"ready": 6})
    with pytest.warns(UserWarning, match="averages 8 per-rank batches instead of 12"):
        apply_world_change(mine, trainer_like(8, 1), ck)
    manual = plan_world_change({"world_size": 2, "accumulate_grad_batches": 1}, trainer_like(1, 1))
    with pytest.warns(UserWarning, match="manual optimization.*batches of 1 rank\\(s\\) now, not 2"):
        apply_world_change(manual, trainer_like(1, 1, automatic=False), {"loops": {}})
    batch_progress(ck)["current"]["ready"] = 3  # 3 x 4 ranks over 8: not whole
    with pytest.raises(ValueError, match="stops 3 batch\\(es\\) into the epoch on each of 4 rank"):
        apply_world_change(mine, trainer_like(8, 1), ck)
    deepspeed = DeepSpeedStrategy.__new__(DeepSpeedStrategy)  # the type is all that is read
    with pytest.raises(ValueError, match=r"universal checkpoint.*'accel_zero2' or 'accel_zero3'.*resume on 4 rank"):
        apply_world_change(change, trainer_like(2, 3, strategy=deepspeed), ck)
    ours = AccelDeepSpeedStrategy.__new__(AccelDeepSpeedStrategy)  # our presets' strategy follows (converts)
    batch_progress(ck)["current"]["ready"] = 6
    apply_world_change(change, trainer_like(2, 3, strategy=ours), ck)


# -- on real ranks --------------------------------------------------------------------------------------------------
def trained_per_step(folder: Path, phases: list[str]) -> tuple[dict[int, list[list[int]]], dict]:
    """Every micro-batch any rank trained, by the optimizer step it went into; and rank 0's final record."""
    steps: dict[int, list[list[int]]] = {}
    final: dict = {}
    for phase in phases:
        for path in sorted(folder.glob(f"{phase}-rank*.json")):
            record = json.loads(path.read_text())
            for step, ids in record["trained"]:
                steps.setdefault(step, []).append(ids)
            final = record if "params" in record else final
    return {step: sorted(batches) for step, batches in sorted(steps.items())}, final


def launch(ranks: int, folder: Path, phase: str, *stop_at: str, **env: str) -> None:
    """One attempt of tests/checkpoint/world_change_run.py on ``ranks`` gloo ranks under torchrun."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    cmd += [str(ROOT / "tests/checkpoint/world_change_run.py"), str(folder), phase, *stop_at]
    environ = {**os.environ, **env}
    result = subprocess.run(cmd, capture_output=True, text=True, env=environ, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]


def two_then_one_then(folder: Path, last: int = 2, **env: str) -> None:
    """Stopped on 2 ranks inside an accumulation window (saved at step 3), resumed on 1 and stopped again in the
    second epoch (saved at step 9), then on ``last`` ranks to the end."""
    launch(2, folder, "two", "2", **env)
    launch(1, folder, "one", "8", **env)
    launch(last, folder, "two-again", **env)  # (the phase keeps its name at 4 ranks)


def assert_trains_the_uninterrupted_run(changing: Path, whole: Path) -> None:
    """Every optimizer step trained the same micro-batches as the uninterrupted run (compared as lists); steps, LR
    and epoch match; the weights are within rtol 1e-4."""
    expected, reference = trained_per_step(whole, ["whole"])
    got, final = trained_per_step(changing, ["two", "one", "two-again"])
    assert len(expected) == 12 and all(len(batches) == 4 for batches in expected.values())
    assert got == expected
    one = json.loads((changing / "one-rank0.json").read_text())
    assert one["world_size"] == 1 and one["accumulate"] == 4 and one["trained"][0][0] == 3
    assert (final["global_step"], final["lr"]) == (reference["global_step"], reference["lr"])
    for name, value in reference["params"].items():
        torch.testing.assert_close(torch.tensor(final["params"][name]), torch.tensor(value), rtol=1e-4, atol=1e-6)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_zero2_zero3_and_fsdp2_go_from_two_ranks_to_one_and_on_training_the_uninterrupted_runs_batches(tmp_path):
    """The 2 -> 1 -> 2 run under the accel_zero2 and accel_zero3 presets' settings on DeepSpeed's CPU engine
    (Lightning's own DeepSpeed path, its CUDA check lifted: tests/strategies/cpu_deepspeed.py), and 2 -> 1 -> 4 under
    FSDP2 saving torch DCP folders (the accumulation 2 -> 4 -> 1, the Trainer saying 2 throughout), all with
    ResumableDataLoader and compared with one uninterrupted DDP run: their steps equal DDP's. Each DeepSpeed resume
    on another size loads through DeepSpeed's universal checkpoint, converted inside the checkpoint folder. (DDP's
    own 2 -> 1 -> 2 is the DALI test below and tests/launch/test_fleet.py.)"""
    whole = tmp_path / "whole"
    launch(2, whole, "whole")
    # each launch runs the strategies' fits in turn in its processes (one launch per attempt, not per strategy)
    launch(2, tmp_path, "two", "2", WORLD_CHANGE_STRATEGIES="zero2,zero3,fsdp")
    launch(1, tmp_path, "one", "8", WORLD_CHANGE_STRATEGIES="zero2,zero3,fsdp")
    launch(2, tmp_path, "two-again", WORLD_CHANGE_STRATEGIES="zero2,zero3")
    launch(4, tmp_path, "two-again", WORLD_CHANGE_STRATEGIES="fsdp")  # (the phase keeps its name at 4 ranks)
    for strategy in ("zero2", "zero3", "fsdp"):
        changing = tmp_path / strategy
        assert_trains_the_uninterrupted_run(changing, whole)
        converted = sorted(p.parent.name for p in (changing / "ck").glob("*/checkpoint_universal"))
        assert converted == ([] if strategy == "fsdp" else ["step=00000003.ckpt", "step=00000009.ckpt"]), strategy
    last = json.loads((tmp_path / "fsdp" / "two-again-rank3.json").read_text())
    assert (last["world_size"], last["accumulate"]) == (4, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none")
def test_the_accel_zero2_preset_on_one_gpu_steps_as_ddp_does_with_accumulation(tmp_path):
    """On one GPU, accumulating 2: accel_zero2 (the loss divided once, not by Lightning and again by DeepSpeed)
    trains the same micro-batches to the same weights as DDP."""
    launch(1, tmp_path / "ddp", "whole", WORLD_CHANGE_ACCELERATOR="gpu")
    launch(1, tmp_path / "zero2", "whole", WORLD_CHANGE_STRATEGY="accel_zero2", WORLD_CHANGE_ACCELERATOR="gpu")
    ddp, zero2 = (json.loads((tmp_path / run / "whole-rank0.json").read_text()) for run in ("ddp", "zero2"))
    assert zero2["trained"] == ddp["trained"] and zero2["global_step"] == ddp["global_step"] == 24
    for name, value in ddp["params"].items():
        torch.testing.assert_close(torch.tensor(zero2["params"][name]), torch.tensor(value), rtol=1e-4, atol=1e-6)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs; this machine has fewer")
def test_the_accel_zero2_preset_on_gpus_goes_from_two_ranks_to_one_and_back(tmp_path):
    """The same run with strategy="accel_zero2" as a user names it, on NCCL, against DDP on the same GPUs."""
    whole, changing = tmp_path / "whole", tmp_path / "changing"
    launch(2, whole, "whole", WORLD_CHANGE_ACCELERATOR="gpu")
    two_then_one_then(changing, WORLD_CHANGE_STRATEGY="accel_zero2", WORLD_CHANGE_ACCELERATOR="gpu")
    assert_trains_the_uninterrupted_run(changing, whole)
    assert (changing / "ck" / "step=00000003.ckpt" / "checkpoint_universal").is_dir()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_dali_over_arrays_goes_from_two_ranks_to_one_and_back_training_the_uninterrupted_runs_batches(tmp_path):
    """The 2 -> 1 -> 2 run under DDP, on DALIImageDataModule over arrays (its source deals one global order, as
    ResumableSampler does), compared with its uninterrupted 2-rank run."""
    whole, changing = tmp_path / "whole", tmp_path / "changing"
    launch(2, whole, "whole", WORLD_CHANGE_DATA="dali")
    two_then_one_then(changing, WORLD_CHANGE_DATA="dali")
    assert_trains_the_uninterrupted_run(changing, whole)


def test_each_kind_of_train_loader_follows_a_change_or_says_why_not(tmp_path):
    """ResumableDataLoader and DALI over arrays follow; a stream warns (its shards are its own); DALI's file reader
    and a sampler that saved per-rank positions are refused with the fix; a DALI file reader's checkpoint of 2 shards
    read on 1 says the same."""
    from PIL import Image
    from torch.utils.data import IterableDataset

    from lightning_accel.checkpoint.loader_state import refuse_loaders_that_cannot_follow

    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(4)

    change = WorldChange(2, 1, 1, 2)
    refuse_loaders_that_cannot_follow([ResumableDataLoader(data(), batch_size=8), None, dali_arrays(0, 1)], change)
    with pytest.warns(UserWarning, match=r"with a stream: each rank's stream position is its own"):
        refuse_loaders_that_cannot_follow({"a": DataLoader(Stream())}, change)
    for k in range(8):
        (tmp_path / "c").mkdir(exist_ok=True)
        Image.new("RGB", (6, 6), (k * 20, 0, 0)).save(tmp_path / "c" / f"{k}.png")
    folder = [dali_arrays(r, 2, train_dir=str(tmp_path)) for r in (0, 1)]
    with pytest.raises(RuntimeError, match=r"DALI's file reader saves a position inside its own shard.*train_arrays="):
        refuse_loaders_that_cannot_follow(folder[0], change)
    next(iter(folder[0]))
    state = folder[0].state_dict()
    with pytest.raises(ValueError, match=r"reader states of 1 shards, this is shard 0 of 1.*Resume on 2 rank"):
        dali_arrays(0, 1, train_dir=str(tmp_path)).load_state_dict(state)


def dali_arrays(shard: int, shards: int, train_dir: str | None = None, n: int = 40):
    """A DALI loader over ``n`` arrays whose labels are their sample ids, shard ``shard`` of ``shards``."""
    from lightning_accel.data import DALIImageDataModule

    images = torch.randint(0, 256, (n, 6, 6, 3), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    source = {"train_dir": train_dir} if train_dir else {"train_arrays": (images.numpy(), torch.arange(n).numpy())}
    dm = DALIImageDataModule(
        **source, batch_size=4, image_size=4, device="cpu", num_threads=1, seed=5, shard_id=shard, num_shards=shards
    )
    dm.setup("fit")
    return dm.train_dataloader()


def test_dali_over_arrays_goes_on_from_the_global_order_at_another_number_of_ranks():
    """Two shards take 2 batches each (slots 0-3 of 10); one shard resumed from their state trains slots 4-9 and then
    epoch 1 as an uninterrupted one-shard loader does; stopped 2 batches into epoch 1 and resumed on 2 shards, they
    deal the rest of it in the same order. Two resumes of one state give bitwise the same images (augmentation too);
    a position that does not split over 3 shards is refused."""
    ids = lambda batches: [i for _, labels in batches for i in labels.tolist()]  # noqa: E731
    whole = dali_arrays(0, 1)
    epochs = [ids(whole), ids(whole)]
    assert sorted(epochs[0]) == list(range(40)) and epochs[0] != epochs[1]
    two = [dali_arrays(r, 2) for r in (0, 1)]
    iterators = [iter(loader) for loader in two]
    seen = [[next(it) for _ in range(2)] for it in iterators]
    assert ids([seen[0][0], seen[1][0], seen[0][1], seen[1][1]]) == epochs[0][:16]  # slots dealt round robin
    state = two[0].state_dict()
    assert state["position"] == {"epoch": 0, "slot": 4} and state["world_size"] == 2
    resumed = [dali_arrays(0, 1) for _ in range(2)]
    for loader in resumed:
        loader.load_state_dict(state)
    rest = [list(loader) for loader in resumed]
    assert len(resumed[0]) == 10 and ids(rest[0]) == epochs[0][16:]
    assert all(torch.equal(a[0], b[0]) for a, b in zip(*rest, strict=True))  # reproducible, augmentation included
    one = resumed[0]
    it = iter(one)
    first_two = [next(it) for _ in range(2)]
    assert ids(first_two) == epochs[1][:8]
    state = one.state_dict()
    assert state["position"] == {"epoch": 1, "slot": 2} and state["world_size"] == 1
    back = [dali_arrays(r, 2) for r in (0, 1)]
    for loader in back:
        loader.load_state_dict(state)
    dealt = [list(loader) for loader in back]
    assert [len(d) for d in dealt] == [4, 4]  # 5 of the epoch's batches per rank, 1 done
    assert ids([b for pair in zip(*dealt, strict=True) for b in pair]) == epochs[1][8:]
    three = dali_arrays(0, 3)
    with pytest.raises(ValueError, match=r"stopped 2 batches of 4 into epoch 1 on 1 rank\(s\).*each of 3"):
        three.load_state_dict(state)
