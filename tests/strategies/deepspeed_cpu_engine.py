"""Run DeepSpeed's own engine on its CPU accelerator with our ZeRO presets' configs (Lightning refuses CPU).

Prints one JSON line per stage: {"stage": N, "losses": [...]}.
"""

import json
import os

os.environ["DS_ACCELERATOR"] = "cpu"  # must be set before deepspeed is imported
os.environ.update(
    MASTER_ADDR="127.0.0.1",
    MASTER_PORT=os.environ.get("MASTER_PORT", "29533"),
    RANK="0",
    WORLD_SIZE="1",
    LOCAL_RANK="0",
)

import deepspeed
import torch
from lightning.pytorch.strategies import StrategyRegistry

import lightning_accel  # noqa: F401  (registers the presets)

torch.manual_seed(0)
x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
for preset in ("accel_zero2", "accel_zero3"):
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    config = {**StrategyRegistry.get(preset).config, "train_micro_batch_size_per_gpu": 16}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    losses = []
    for _ in range(8):
        loss = torch.nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    print(json.dumps({"stage": engine.zero_optimization_stage(), "losses": losses}), flush=True)
