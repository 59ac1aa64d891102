"""What a run costs: the goodput ledger's seconds priced, with no Trainer in it (``GoodputMonitor(pricing=)``).

Every bucket of the ledger gets dollars beside its seconds (price per second of the whole job x seconds), plus the
dollars of work lost to restarts, the cost per million samples (and tokens, where counted) over the whole run, and
the cost to finish at the rate measured so far. Prices come from the user: in the callback, the recipe, or the
environment (:meth:`Pricing.from_env`); nothing is looked up.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from lightning_accel.monitor.ledger import BUCKETS

__all__ = ["COST_KEYS", "ENV_PREFIX", "Pricing", "cost_figures"]

ENV_PREFIX = "LIGHTNING_ACCEL_PRICE_"


@dataclass(frozen=True)
class Pricing:
    """The price of the machines a run uses.

    Args:
        on_demand_per_hour: On-demand price of one ``per`` (a device or a node) per hour.
        spot_per_hour: Spot (preemptible) price of the same, per hour.
        per: ``"device"``: the price is per device (one training process); ``"node"``: per node (machine).
        market: Which of the two prices this run pays.
        currency: Shown beside the figures (the keys say ``usd``; any currency works the same).
    """

    on_demand_per_hour: float | None = None
    spot_per_hour: float | None = None
    per: Literal["device", "node"] = "device"
    market: Literal["on_demand", "spot"] = "on_demand"
    currency: str = "USD"

    def __post_init__(self) -> None:
        if self.per not in ("device", "node"):
            raise ValueError(f"Pricing.per must be 'device' or 'node', got {self.per!r}")
        if self.market not in ("on_demand", "spot"):
            raise ValueError(f"Pricing.market must be 'on_demand' or 'spot', got {self.market!r}")
        for name in ("on_demand_per_hour", "spot_per_hour"):
            value = getattr(self, name)
            if value is None:
                continue
            # a recipe may write a price as a string ("1.2"): a number in any form is taken, anything else refused
            if isinstance(value, bool):
                raise ValueError(f"Pricing.{name} must be a number of {self.currency} per hour, got {value!r}")
            try:
                number = float(value)
            except (TypeError, ValueError):
                raise ValueError(
                    f"Pricing.{name} must be a number of {self.currency} per hour, got {value!r}"
                ) from None
            if not math.isfinite(number) or number < 0:
                raise ValueError(f"Pricing.{name} must be a finite number >= 0, got {value!r}")
            object.__setattr__(self, name, number)
        if self.price_per_hour is None:
            raise ValueError(
                f"Pricing: market={self.market!r} but {self.market}_per_hour is not set; give it, or pick the other "
                "market"
            )

    def price_for(self, market: str) -> float | None:
        """The price of one device or node and hour on ``market``."""
        return self.spot_per_hour if market == "spot" else self.on_demand_per_hour

    @property
    def price_per_hour(self) -> float | None:
        """The price this run pays, per device or node and hour."""
        return self.price_for(self.market)

    def per_second(self, world_size: int, num_nodes: int, market: str | None = None) -> float:
        """Dollars per second of the whole job (every device, or every node)."""
        price = self.price_for(market or self.market)
        if price is None:
            raise ValueError(f"Pricing: no {(market or self.market)} price set")
        return price * (world_size if self.per == "device" else num_nodes) / 3600.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Pricing | None:
        """Prices from ``LIGHTNING_ACCEL_PRICE_ON_DEMAND_PER_HOUR``, ``..._SPOT_PER_HOUR``, ``..._PER`` (device or
        node), ``..._MARKET`` (on_demand or spot) and ``..._CURRENCY``; ``None`` when neither price is set."""
        env = os.environ if environ is None else environ

        def number(name: str) -> float | None:
            text = env.get(ENV_PREFIX + name)
            if text is None or text == "":
                return None
            try:
                value = float(text)
            except ValueError:
                value = math.nan
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{ENV_PREFIX}{name}={text!r} is not a finite number >= 0 (dollars per hour)")
            return value

        on_demand, spot = number("ON_DEMAND_PER_HOUR"), number("SPOT_PER_HOUR")
        if on_demand is None and spot is None:
            return None
        default_market = "spot" if on_demand is None else "on_demand"
        return cls(
            on_demand_per_hour=on_demand,
            spot_per_hour=spot,
            per=env.get(ENV_PREFIX + "PER", "device"),  # type: ignore[arg-type]
            market=env.get(ENV_PREFIX + "MARKET", default_market),  # type: ignore[arg-type]
            currency=env.get(ENV_PREFIX + "CURRENCY", "USD"),
        )


COST_KEYS = (
    *(f"cost/{b}_usd" for b in BUCKETS),
    "cost/total_usd",
    "cost/lost_usd",
    "cost/usd_per_hour",
    "cost/usd_per_million_samples",
    "cost/usd_per_million_tokens",
    "cost/usd_to_finish",
    "cost/on_demand_equivalent_usd",
)


def cost_figures(
    goodput: Mapping[str, float],
    pricing: Pricing,
    world_size: int,
    num_nodes: int,
    samples: int,
    tokens: int | None,
    seconds_per_step: float | None,
    steps_left: int | None,
) -> dict[str, float]:
    """The cost keys for a run whose goodput figures (``goodput/<bucket>_s``, ``goodput/lost_s``) are given.

    Args:
        goodput: The ledger's figures over the whole run.
        pricing: What the machines cost.
        world_size: Devices (training processes) of the job.
        num_nodes: Nodes of the job.
        samples: Samples trained over the whole run, all ranks together.
        tokens: Tokens trained over the whole run, all ranks together (``None``: not counted).
        seconds_per_step: Wall seconds per optimizer step so far, all buckets included (``None``: unknown).
        steps_left: Optimizer steps to the end of the run (``None``: unknown).
    """
    rate = pricing.per_second(world_size, num_nodes)
    figures = {f"cost/{b}_usd": rate * goodput[f"goodput/{b}_s"] for b in BUCKETS}
    total_s = goodput["goodput/total_s"]
    figures["cost/total_usd"] = rate * total_s
    figures["cost/lost_usd"] = rate * goodput.get("goodput/lost_s", 0.0)
    figures["cost/usd_per_hour"] = rate * 3600.0
    if samples > 0:
        figures["cost/usd_per_million_samples"] = figures["cost/total_usd"] / samples * 1e6
    if tokens:
        figures["cost/usd_per_million_tokens"] = figures["cost/total_usd"] / tokens * 1e6
    if seconds_per_step is not None and steps_left is not None:
        figures["cost/usd_to_finish"] = rate * seconds_per_step * max(steps_left, 0)
    if pricing.market == "spot" and pricing.on_demand_per_hour is not None:
        figures["cost/on_demand_equivalent_usd"] = pricing.per_second(world_size, num_nodes, "on_demand") * total_s
    return figures
