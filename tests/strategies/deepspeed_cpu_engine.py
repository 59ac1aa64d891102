"""Run DeepSpeed's own engine on its CPU accelerator with our ZeRO presets' configs (Lightning refuses CPU).

Prints one JSON line per stage: {"stage": N, "losses": [...], "universal": [...]}: after training, the engine saves a
checkpoint (SGD's state) and "universal" is what converting it to DeepSpeed's universal checkpoint said, with the
run's optimizer named (as AccelDeepSpeedStrategy does) and without (DeepSpeed's converter then tries and fails);
"left" is what the checkpoint folder holds afterwards.
"""

import json
import os
import tempfile
from pathlib import Path

os.environ.update(
    MASTER_ADDR="127.0.0.1",
    MASTER_PORT=os.environ.get("MASTER_PORT", "29533"),
    RANK="0",
    WORLD_SIZE="1",
    LOCAL_RANK="0",
)

import tests.strategies.cpu_deepspeed  # noqa: F401, I001  (first: DeepSpeed on its CPU accelerator, as the tests run it)
import deepspeed
import torch
from lightning.pytorch.strategies import StrategyRegistry

import lightning_accel  # noqa: F401  (registers the presets)
from lightning_accel.strategies.deepspeed_universal import universal_checkpoint_for

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
    with tempfile.TemporaryDirectory() as folder:
        engine.save_checkpoint(folder, tag="checkpoint")  # the tag Lightning saves under
        said = []
        for optimizer in (engine.basic_optimizer, None):  # what the strategy passes; then no optimizer: DeepSpeed tries
            try:
                said.append(str(universal_checkpoint_for(folder, optimizer)))
            except RuntimeError as err:
                said.append(str(err))
        left = sorted(p.name for p in Path(folder).iterdir())
    record = {"stage": engine.zero_optimization_stage(), "losses": losses, "universal": said, "left": left}
    print(json.dumps(record), flush=True)
