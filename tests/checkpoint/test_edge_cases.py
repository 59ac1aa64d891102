"""Checkpoint promises at the edges: full disks, corrupted newest files, missing manifests, shared
folders, signal handler chaining, threads, and loaders that cannot resume."""

from __future__ import annotations

import errno
import json
import signal
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.checkpoint import (
    AsyncAtomicCheckpointIO,
    Preempted,
    PreemptionCheckpoint,
    atomic_save,
    find_resume_checkpoint,
    verify,
)
from lightning_accel.checkpoint.durable import manifest_path
from lightning_accel.data import ResumableDataLoader
from lightning_accel.monitor import GoodputMonitor
from tests.conftest import SigtermAt, tiny_trainer_kwargs


class Wide(LightningModule):
    """A model defined here: BatchNorm and Dropout, 1.5 MB of weights (more than the tmpfs below holds)."""

    def __init__(self, width: int = 600) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(8, width),
            nn.BatchNorm1d(width),
            nn.Dropout(0.2),
            nn.Linear(width, width),
            nn.ReLU(),
            nn.Linear(width, 2),
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def loader(n: int = 256, **kwargs) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 2, (n,), generator=g)), batch_size=16, **kwargs
    )


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MB tmpfs: a real full disk (needs root, as on CI; skipped elsewhere)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if (
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True).returncode
        != 0
    ):
        pytest.skip("cannot mount a tmpfs here (needs root): the full-disk case is not exercised")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_full_disk_raises_enospc_naming_the_file_not_torch_internals(small_disk):
    with pytest.raises(OSError) as err:
        atomic_save({"w": torch.zeros(600_000)}, small_disk / "big.ckpt")
    assert err.value.errno == errno.ENOSPC
    assert "big.ckpt" in str(err.value) and "No space left on device" in str(err.value) and "MB free" in str(err.value)
    assert "unexpected pos" not in str(err.value)
    assert list(small_disk.iterdir()) == []  # no torn file, no temp file left


def test_async_write_failure_stops_training_at_the_next_batch(small_disk, tmp_path):
    cb = PreemptionCheckpoint(small_disk, every_n_steps=2, async_save=True)
    trainer = Trainer(**tiny_trainer_kwargs(tmp_path, max_steps=40, callbacks=[cb]))
    with pytest.raises(OSError) as err:
        trainer.fit(Wide(), train_dataloaders=loader())
    assert err.value.errno == errno.ENOSPC
    assert trainer.global_step <= 4  # the failed write of step 2 surfaced at most one save later, not at teardown
    assert isinstance(trainer.strategy.checkpoint_io, AsyncAtomicCheckpointIO)


def _save_steps(folder: Path, steps, run_id: str = "run-a") -> None:
    for step in steps:
        path = folder / f"step={step:08d}.ckpt"
        atomic_save(
            {"global_step": step, "w": torch.full((64,), float(step))}, path, {"global_step": step, "run_id": run_id}
        )


def test_keep_last_never_deletes_good_files_because_of_a_corrupt_newest_one(tmp_path):
    _save_steps(tmp_path, (2, 4, 6))
    newest = tmp_path / "step=00000006.ckpt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, wrong content
    newest.write_bytes(bytes(data))
    cb = PreemptionCheckpoint(tmp_path, keep_last=2)
    cb.run_id = "run-a"
    cb._prune()
    # 6 is corrupt, so the two valid newest are 4 and 2: nothing may be deleted
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == [
        "step=00000002.ckpt",
        "step=00000004.ckpt",
        "step=00000006.ckpt",
    ]
    assert find_resume_checkpoint(tmp_path) == str(tmp_path / "step=00000004.ckpt")


def test_prune_leaves_another_runs_files_in_a_shared_folder_alone(tmp_path):
    _save_steps(tmp_path, (1, 2, 3), run_id="theirs")
    _save_steps(tmp_path, (10, 20, 30), run_id="ours")
    cb = PreemptionCheckpoint(tmp_path, keep_last=1)
    cb.run_id = "ours"
    cb._prune()
    names = sorted(p.name for p in tmp_path.glob("*.ckpt"))
    assert names == ["step=00000001.ckpt", "step=00000002.ckpt", "step=00000003.ckpt", "step=00000030.ckpt"]


def test_missing_or_unreadable_manifest_is_ranked_by_name_and_warned(tmp_path):
    _save_steps(tmp_path, (5, 10, 15))
    manifest_path(tmp_path / "step=00000015.ckpt").unlink()
    manifest_path(tmp_path / "step=00000010.ckpt").write_text("{not json")
    with pytest.warns(
        UserWarning, match=r"step=00000015.ckpt although it has no manifest; the zip container and its CRCs are intact"
    ):
        assert find_resume_checkpoint(tmp_path) == str(tmp_path / "step=00000015.ckpt")
    (tmp_path / "step=00000015.ckpt").unlink()
    with pytest.warns(UserWarning, match="unreadable manifest"):
        assert find_resume_checkpoint(tmp_path) == str(tmp_path / "step=00000010.ckpt")
    verdict = verify(tmp_path / "step=00000010.ckpt")
    assert verdict and verdict.checked_by == "zip"


def test_handler_chains_the_users_own_and_fit_leaves_the_original_in_place(tmp_path):
    calls = []

    def users_handler(signum, frame):
        calls.append(signum)

    previous = signal.signal(signal.SIGTERM, users_handler)
    try:
        cb = PreemptionCheckpoint(tmp_path / "ck")
        trainer = Trainer(**tiny_trainer_kwargs(tmp_path, max_steps=20, callbacks=[SigtermAt(3), cb]))
        with pytest.raises(Preempted) as stopped:
            trainer.fit(Wide(width=16), train_dataloaders=loader())
        assert stopped.value.code == 75 and stopped.value.checkpoint == tmp_path / "ck" / "step=00000004.ckpt"
        assert calls == [signal.SIGTERM]  # ours set the flag and called the user's
        assert signal.getsignal(signal.SIGTERM) is users_handler  # not ours, not Lightning's stale one
        # A second, normal fit: afterwards the user's handler is still the one in place.
        Trainer(**tiny_trainer_kwargs(tmp_path, max_steps=2, callbacks=[PreemptionCheckpoint(tmp_path / "ck2")])).fit(
            Wide(width=16), train_dataloaders=loader()
        )
        assert signal.getsignal(signal.SIGTERM) is users_handler
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_fit_off_the_main_thread_warns_and_still_saves_periodically(tmp_path):
    errors, warned = [], []

    def run():

        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            try:
                cb = PreemptionCheckpoint(tmp_path / "ck", every_n_steps=2)
                Trainer(**tiny_trainer_kwargs(tmp_path, max_steps=4, callbacks=[cb])).fit(
                    Wide(width=16), train_dataloaders=loader()
                )
            except BaseException as err:
                errors.append(err)
        warned.extend(str(w.message) for w in record)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(120)
    assert not errors
    assert any("off the main thread" in w for w in warned)
    assert sorted(p.name for p in (tmp_path / "ck").glob("*.ckpt")) == ["step=00000002.ckpt", "step=00000004.ckpt"]


def test_plain_dataloader_gets_a_warning_naming_what_to_switch_to(tmp_path):
    trainer = Trainer(**tiny_trainer_kwargs(tmp_path, max_steps=2, callbacks=[PreemptionCheckpoint(tmp_path / "ck")]))
    with pytest.warns(UserWarning, match=r"from torchdata.stateful_dataloader import StatefulDataLoader"):
        trainer.fit(Wide(width=16), train_dataloaders=loader(shuffle=True))


def test_periodic_save_after_resume_inside_accumulation_does_not_overwrite(tmp_path):
    """Resumed at step 4 with accumulation 2: the next micro-batch must not rewrite step=4."""
    ck = tmp_path / "ck"
    kwargs = dict(accumulate_grad_batches=2, callbacks=None)
    first = PreemptionCheckpoint(ck, every_n_steps=4, keep_last=None)
    Trainer(**tiny_trainer_kwargs(tmp_path, max_steps=4, **{**kwargs, "callbacks": [first]})).fit(
        Wide(width=16), train_dataloaders=loader()
    )
    saved = ck / "step=00000004.ckpt"
    before = json.loads(manifest_path(saved).read_text())["xxh3_64"]
    second = PreemptionCheckpoint(ck, every_n_steps=4, keep_last=None)
    Trainer(**tiny_trainer_kwargs(tmp_path, max_steps=6, **{**kwargs, "callbacks": [second]})).fit(
        Wide(width=16), train_dataloaders=loader(), ckpt_path=str(saved)
    )
    assert json.loads(manifest_path(saved).read_text())["xxh3_64"] == before
    assert [p.name for p in second.saved] == ["step=00000006.ckpt"]  # step 8 was never reached: the fit's end only


def test_a_finished_fit_ends_with_a_checkpoint_and_the_same_command_again_trains_nothing_and_loses_nothing(
    tmp_path, caplog
):
    """max_steps 7 with saves every 5 steps ends with step 7 saved (it was step 5: a rerun retrained 2 steps and the
    ledger counted a restart and lost work). The same command again, twice: it says the run had finished, trains
    nothing, keeps the weights, and goodput.json still counts no restart and no lost step. Raising max_steps trains on
    from the end bitwise as an uninterrupted run does. Saves every 60 steps with max_steps 3 still leave step 3; a
    fit ended by max_epochs is saved at its last batch and taken on to another epoch bitwise too."""
    data = TensorDataset(torch.randn(96, 8, generator=torch.Generator().manual_seed(0)), torch.randint(0, 2, (96,)))

    def fit(folder: Path, max_steps: int, ckpt_path=None, every: int = 5, epochs=None) -> tuple[Trainer, Wide]:
        torch.manual_seed(0)
        model = Wide(width=16)
        callbacks = [
            PreemptionCheckpoint(folder / "ck", every_n_steps=every, keep_last=None),
            GoodputMonitor(warmup_steps=0, summary=False, plot=False, run_dir=folder / "run"),
        ]
        trainer = Trainer(**tiny_trainer_kwargs(folder, max_steps=max_steps, max_epochs=epochs, callbacks=callbacks))
        trainer.fit(model, ResumableDataLoader(data, batch_size=16, seed=1), ckpt_path=ckpt_path)
        return trainer, model

    def saved(folder: Path) -> list[str]:
        return sorted(p.name for p in (folder / "ck").glob("*.ckpt"))

    _, first = fit(tmp_path / "a", 7)
    assert saved(tmp_path / "a") == ["step=00000005.ckpt", "step=00000007.ckpt"]
    ledger = json.loads((tmp_path / "a" / "run" / "goodput.json").read_text())
    assert (ledger["goodput/restarts"], ledger["goodput/lost_steps"]) == (0, 0)
    for attempt in range(2):
        caplog.clear()
        with caplog.at_level("WARNING"):
            trainer, again = fit(tmp_path / "a", 7, ckpt_path=find_resume_checkpoint(tmp_path / "a" / "ck"))
        assert "this run had finished: the checkpoint it resumed ends the fit at step 7" in caplog.text, attempt
        assert trainer.global_step == 7 and saved(tmp_path / "a") == ["step=00000005.ckpt", "step=00000007.ckpt"]
        assert all(
            torch.equal(a, b) for a, b in zip(first.state_dict().values(), again.state_dict().values(), strict=True)
        )
        assert json.loads((tmp_path / "a" / "run" / "goodput.json").read_text()) == ledger
    _, whole = fit(tmp_path / "whole", 10)
    _, longer = fit(tmp_path / "a", 10, ckpt_path=find_resume_checkpoint(tmp_path / "a" / "ck"))
    assert all(
        torch.equal(a, b) for a, b in zip(whole.state_dict().values(), longer.state_dict().values(), strict=True)
    )
    fit(tmp_path / "rare", 3, every=60)
    assert saved(tmp_path / "rare") == ["step=00000003.ckpt"]
    # ended by max_epochs (6 steps an epoch): the last batch of the last epoch is saved, and a run taken on to a
    # second epoch from it is the two-epoch run
    fit(tmp_path / "epoch", -1, every=60, epochs=1)
    assert saved(tmp_path / "epoch") == ["step=00000006.ckpt"]
    ledger = json.loads((tmp_path / "epoch" / "run" / "goodput.json").read_text())
    caplog.clear()
    with caplog.at_level("WARNING"):
        trainer, _ = fit(
            tmp_path / "epoch", -1, every=60, epochs=1, ckpt_path=find_resume_checkpoint(tmp_path / "epoch" / "ck")
        )
    assert "the checkpoint it resumed ends the fit at step 6" in caplog.text and trainer.global_step == 6
    assert json.loads((tmp_path / "epoch" / "run" / "goodput.json").read_text()) == ledger  # no restart, no loss
    _, whole = fit(tmp_path / "two", -1, every=60, epochs=2)
    _, longer = fit(
        tmp_path / "epoch", -1, every=60, epochs=2, ckpt_path=find_resume_checkpoint(tmp_path / "epoch" / "ck")
    )
    assert all(
        torch.equal(a, b) for a, b in zip(whole.state_dict().values(), longer.state_dict().values(), strict=True)
    )


def test_stateful_loader_whose_sampler_lightning_wrapped_is_flagged():
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
    from torch.utils.data import BatchSampler
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import RandomSampler, StatefulDistributedSampler

    from lightning_accel.checkpoint.loader_state import has_wrapped_stateful_sampler

    data = list(range(16))
    # what Lightning builds under DDP from StatefulDataLoader(data, shuffle=True)
    wrapped = BatchSampler(DistributedSamplerWrapper(RandomSampler(data), num_replicas=2, rank=0), 4, False)
    assert has_wrapped_stateful_sampler(StatefulDataLoader(data, batch_sampler=wrapped))
    # what the docs say to build instead, and what a single process uses
    own = StatefulDistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=0)
    assert not has_wrapped_stateful_sampler(StatefulDataLoader(data, batch_size=4, sampler=own))
    assert not has_wrapped_stateful_sampler(StatefulDataLoader(data, batch_size=4, shuffle=True))


@pytest.mark.parametrize("damage", ["{not json", "[]", "null", "{}", '{"bytes": 12}', '{"xxh3_64": "ab"}'])
def test_every_kind_of_manifest_damage_gets_one_policy_and_says_what_it_found(tmp_path, damage):
    """Garbage, a list, null, an empty object or one missing the size or the checksum: the manifest is not trusted,
    the checkpoint is used once its zip CRCs pass, with a warning that quotes what the manifest held."""
    _save_steps(tmp_path, (5, 10))
    manifest_path(tmp_path / "step=00000010.ckpt").write_text(damage)
    verdict = verify(tmp_path / "step=00000010.ckpt")
    assert verdict and verdict.checked_by == "zip" and verdict.reason.startswith("unreadable manifest (")
    assert repr(damage[:40]) in verdict.reason and "CRCs are intact" in verdict.reason
    with pytest.warns(UserWarning, match=r"step=00000010.ckpt although it has unreadable manifest"):
        assert find_resume_checkpoint(tmp_path) == str(tmp_path / "step=00000010.ckpt")


@pytest.mark.multiprocess
def test_a_signal_after_the_last_step_lets_fit_return(tmp_path):
    """SIGTERM in on_train_end, on_fit_end or a teardown hook that runs before PreemptionCheckpoint's (Lightning has
    put its own start-of-fit handlers back by the last two): fit() returns, the code after it runs, the process
    exits 0, and the log says training was complete."""
    script = Path(__file__).parent / "late_signal.py"
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    hooks = ["on_train_end", "on_train_end", "on_fit_end", "on_fit_end", "teardown"]
    assert done.stdout.splitlines() == [f"returned after {hook}" for hook in hooks]
    assert done.stderr.count("after the last training step: training is complete") == 5
