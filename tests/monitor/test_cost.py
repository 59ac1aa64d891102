"""The cost ledger: prices from the user (callback, recipe, environment), dollars equal to price x measured seconds,
carried across restarts, and the cost to finish from the measured rate."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_accel as la
from lightning_accel.monitor.accounting import GoodputAccounting
from lightning_accel.monitor.cost import COST_KEYS, Pricing, cost_figures
from lightning_accel.monitor.ledger import BUCKETS
from lightning_accel.monitor.progress import steps_left
from tests.conftest import tiny_trainer_kwargs


class Net(LightningModule):
    """BatchNorm, Dropout and a scheduler; batches of (features, labels)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.1), nn.Linear(16, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=5)]


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(160, 8, generator=g), torch.randint(0, 2, (160,), generator=g)), 8)


def test_prices_are_checked_and_read_from_the_environment():
    assert Pricing.from_env({}) is None
    env = {"LIGHTNING_ACCEL_PRICE_ON_DEMAND_PER_HOUR": "4.0", "LIGHTNING_ACCEL_PRICE_SPOT_PER_HOUR": "1.2"}
    assert Pricing.from_env(env) == Pricing(on_demand_per_hour=4.0, spot_per_hour=1.2)
    spot = Pricing.from_env({**env, "LIGHTNING_ACCEL_PRICE_MARKET": "spot", "LIGHTNING_ACCEL_PRICE_PER": "node"})
    assert spot.market == "spot" and spot.per == "node" and spot.price_per_hour == 1.2
    assert Pricing.from_env({"LIGHTNING_ACCEL_PRICE_SPOT_PER_HOUR": "0.9"}).market == "spot"  # the only price
    with pytest.raises(ValueError, match=r"LIGHTNING_ACCEL_PRICE_ON_DEMAND_PER_HOUR='\$4' is not a finite number"):
        Pricing.from_env({"LIGHTNING_ACCEL_PRICE_ON_DEMAND_PER_HOUR": "$4"})
    for bad in ("nan", "inf", "-inf", "NaN"):
        with pytest.raises(ValueError, match=rf"SPOT_PER_HOUR='{bad}' is not a finite number >= 0"):
            Pricing.from_env({"LIGHTNING_ACCEL_PRICE_SPOT_PER_HOUR": bad})
    # a recipe's YAML may give a price as a string: a number in any form is taken, anything else refused
    assert Pricing(spot_per_hour="1.2", market="spot").price_per_hour == 1.2  # type: ignore[arg-type]
    for bad in ("1.2 USD", float("nan"), float("inf"), True, [1]):
        with pytest.raises(ValueError, match=r"Pricing\.spot_per_hour must be a (finite )?number"):
            Pricing(spot_per_hour=bad, market="spot")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="market='spot' but spot_per_hour is not set"):
        Pricing(on_demand_per_hour=4.0, market="spot")
    with pytest.raises(ValueError, match="per must be 'device' or 'node', got 'gpu'"):
        Pricing(on_demand_per_hour=4.0, per="gpu")
    with pytest.raises(ValueError, match="on_demand_per_hour must be a finite number >= 0, got -1"):
        Pricing(on_demand_per_hour=-1)


def test_cost_is_price_times_seconds_for_every_bucket_and_figure():
    seconds = {b: float(i + 1) for i, b in enumerate(BUCKETS)}
    goodput = {**{f"goodput/{b}_s": s for b, s in seconds.items()}, "goodput/total_s": sum(seconds.values())}
    goodput["goodput/lost_s"] = 2.5
    pricing = Pricing(on_demand_per_hour=3.6, spot_per_hour=1.08, per="node", market="spot")
    figures = cost_figures(
        goodput, pricing, world_size=8, num_nodes=2, samples=4000, tokens=None, seconds_per_step=0.5, steps_left=100
    )
    rate = 1.08 * 2 / 3600  # per node: 2 nodes at the spot price
    for b, s in seconds.items():
        assert figures[f"cost/{b}_usd"] == rate * s
    assert figures["cost/total_usd"] == rate * goodput["goodput/total_s"]
    assert figures["cost/lost_usd"] == rate * 2.5
    assert figures["cost/usd_per_hour"] == rate * 3600
    assert figures["cost/usd_per_million_samples"] == figures["cost/total_usd"] / 4000 * 1e6
    assert figures["cost/usd_to_finish"] == rate * 0.5 * 100
    assert figures["cost/on_demand_equivalent_usd"] == 3.6 * 2 / 3600 * goodput["goodput/total_s"]
    assert "cost/usd_per_million_tokens" not in figures and set(figures) <= set(COST_KEYS)
    per_device = cost_figures(
        goodput,
        Pricing(on_demand_per_hour=3.6),
        world_size=8,
        num_nodes=2,
        samples=0,
        tokens=1000,
        seconds_per_step=None,
        steps_left=None,
    )
    assert per_device["cost/total_usd"] == 3.6 * 8 / 3600 * goodput["goodput/total_s"]
    assert per_device["cost/usd_per_million_tokens"] == per_device["cost/total_usd"] / 1000 * 1e6
    assert "cost/usd_to_finish" not in per_device and "cost/usd_per_million_samples" not in per_device


class StopAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.should_stop = True  # the fit ends early: 12 of its 20 steps are left


def test_a_priced_fit_reports_dollars_equal_to_price_times_its_measured_seconds(tmp_path):
    pricing = Pricing(on_demand_per_hour=2.0, spot_per_hour=0.7, market="spot")
    monitor = la.GoodputMonitor(every_n_steps=5, summary=True, plot=False, pricing=pricing)
    trainer = Trainer(**tiny_trainer_kwargs(tmp_path, max_steps=20, callbacks=[monitor, StopAt(8)]))
    trainer.fit(Net(), loader())
    r = monitor.results
    rate = 0.7 / 3600
    for b in BUCKETS:
        assert r[f"cost/{b}_usd"] == rate * r[f"goodput/{b}_s"]
    assert r["cost/total_usd"] == rate * r["goodput/total_s"]
    assert r["cost/usd_per_million_samples"] == r["cost/total_usd"] / (8 * 8) * 1e6  # 8 batches of 8
    # 12 steps left at this attempt's wall seconds per step (the whole run so far: one attempt, 8 steps)
    assert r["cost/usd_to_finish"] == pytest.approx(rate * r["goodput/total_s"] / 8 * 12, rel=1e-9)
    assert r["cost/on_demand_equivalent_usd"] == 2.0 / 3600 * r["goodput/total_s"]


def test_samples_carry_over_a_restart_and_steps_left_follow_max_epochs(tmp_path):
    acc = GoodputAccounting()
    for _ in range(5):
        acc.update(samples=8, tokens=None, step=1)
    state = acc.state_dict()
    assert state["samples"] == 40 and state["tokens"] is None
    resumed = GoodputAccounting()
    resumed.load_state_dict(state)
    resumed.update(samples=8, tokens=None, step=6)
    assert resumed.run_samples() == 48
    monitor = la.GoodputMonitor(summary=False, plot=False, pricing=Pricing(on_demand_per_hour=1.0))
    trainer = Trainer(**tiny_trainer_kwargs(tmp_path, max_epochs=2, accumulate_grad_batches=3, callbacks=[monitor]))
    trainer.fit(Net(), loader())
    assert trainer.global_step == 2 * 7  # 20 batches an epoch, windows of 3: 7 steps (the last window of 2)
    assert monitor.results["cost/usd_to_finish"] == 0.0 and steps_left(trainer) == 0
