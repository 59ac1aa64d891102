"""Run DeepSpeed's own engine on its CPU accelerator with our ZeRO presets' configs (Lightning refuses CPU).

Prints one JSON line per stage: {"stage": N, "losses": [...], "universal": [...]}: after training, the engine saves a
checkpoint (SGD's state) and "universal" is what converting it to DeepSpeed's universal checkpoint said, with the
run's optimizer named (as AccelDeepSpeedStrategy does) and without (DeepSpeed's converter then tries and fails);
"left" is what the checkpoint folder holds afterwards.

With ``BUCKET_URL`` set (an ``s3://`` prefix on the test's S3 server), the engine's checkpoint folder also goes to the
bucket as PreemptionCheckpoint sends one (sealed by rank 0, uploaded by BucketPublisher, manifest last); an empty
machine (a new cache folder) finds it there, downloads and verifies it, and a new engine loads it: "bucket" records
the files the bucket's manifest lists, the ranks the downloaded folder says saved it, and whether the loaded
weights and the next step's loss equal the saving engine's bit for bit.
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
from lightning_accel import find_resume_checkpoint
from lightning_accel.checkpoint.bucket import BucketPublisher
from lightning_accel.checkpoint.sharded import seal_folder
from lightning_accel.storage import CACHE_ENV
from lightning_accel.strategies.deepspeed_universal import saved_data_parallel_size, universal_checkpoint_for


def new_engine(preset: str):
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    config = {**StrategyRegistry.get(preset).config, "train_micro_batch_size_per_gpu": 16}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # momentum: optimizer state to carry
    return deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]


def step(engine) -> float:
    loss = torch.nn.functional.cross_entropy(engine(x), y)
    engine.backward(loss)
    engine.step()
    return loss.item()


def weights(engine) -> dict[str, torch.Tensor]:
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):  # (ZeRO-3: gathered; else a no-op)
        return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def through_the_bucket(engine, preset: str, url: str, scratch: Path) -> dict:
    """The engine's checkpoint folder to the bucket and back onto an empty machine, loaded by a new engine."""
    folder = scratch / "staging" / "step=00000008.ckpt"  # what PreemptionCheckpoint names it
    engine.save_checkpoint(str(folder), tag="checkpoint")
    seal_folder(folder, {"global_step": 8, "run_id": preset})
    publisher = BucketPublisher(url, keep_last=2, grace_period_s=60)
    publisher.submit(folder, 8, None, 0.0)
    assert publisher.wait(), "the folder did not reach the bucket"
    publisher.close()
    os.environ[CACHE_ENV] = str(scratch / "empty-machine")
    found = Path(find_resume_checkpoint(url))
    torch.manual_seed(1)  # other initial weights: the load must bring every one back
    loaded = new_engine(preset)
    loaded.load_checkpoint(str(found), tag="checkpoint")
    before, after = weights(engine), weights(loaded)
    same_weights = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    manifest = publisher.fs.cat_file(f"{publisher.root}/{found.name}.manifest.json")
    return {
        "files": sorted(json.loads(manifest)["files"]),
        "saved_ranks": saved_data_parallel_size(found),
        "found_under_cache": str(found).startswith(str(scratch / "empty-machine")),
        "bitwise": same_weights and step(engine) == step(loaded),
    }


torch.manual_seed(0)
x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
for preset in ("accel_zero2", "accel_zero3"):
    torch.manual_seed(0)
    engine = new_engine(preset)
    losses = [step(engine) for _ in range(8)]
    bucket = None
    if os.environ.get("BUCKET_URL"):
        with tempfile.TemporaryDirectory() as scratch:
            bucket = through_the_bucket(engine, preset, f"{os.environ['BUCKET_URL']}/{preset}", Path(scratch))
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
    record["bucket"] = bucket
    print(json.dumps(record), flush=True)
