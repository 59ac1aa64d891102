"""Every reader of a manifest or run file treats undecodable, truncated or hostile bytes as "not trusted" (one policy,
``storage.trust``): fuzzed with hypothesis, then the corrupt-manifest resume a torn write leaves, end to end."""

from __future__ import annotations

import importlib
import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lightning.pytorch import Trainer

from lightning_accel import PreemptionCheckpoint, find_resume_checkpoint
from lightning_accel.checkpoint import atomic_save, verify
from lightning_accel.checkpoint.bucket_listing import list_bucket_manifests
from lightning_accel.checkpoint.durable import manifest_path, read_manifest
from lightning_accel.monitor.progress import PROGRESS_FILE, last_progress_time, read_highest_step
from lightning_accel.profile.doctor import load_run
from lightning_accel.storage import parse_json_object
from tests.checkpoint.train_bucket import BucketNet, loaders
from tests.conftest import tiny_trainer_kwargs

# what a torn write, a bad sector or a hostile edit can leave: random bytes, valid JSON of the wrong shape, a
# truncated real manifest, nesting deep enough to exhaust the parser
REAL = json.dumps({"format": 2, "file": "step=00000004.ckpt", "bytes": 1234, "xxh3_64": "ab" * 8, "global_step": 4})
hostile = st.one_of(
    st.binary(max_size=256),
    st.integers(0, len(REAL)).map(lambda n: REAL[:n].encode()),
    st.recursive(st.none() | st.booleans() | st.floats() | st.text(max_size=8), st.lists, max_leaves=8).map(
        lambda v: json.dumps(v).encode()
    ),
    st.integers(1, 50_000).map(lambda n: b"[" * n),
    st.integers(1, 50_000).map(lambda n: b'{"a":' * n),
)
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


class OneFolderStore:
    """The few calls ``list_bucket_manifests`` makes of an fsspec file system, over one dict of objects."""

    def __init__(self, objects: dict[str, bytes]) -> None:
        self.objects = objects

    def invalidate_cache(self, path=None) -> None:
        pass

    def ls(self, root, detail=False):
        return [f"{root}/{name}" for name in self.objects]

    def cat_file(self, path):
        return self.objects[path.rsplit("/", 1)[-1]]


@FUZZ
@given(data=hostile)
def test_no_reader_raises_on_hostile_bytes(tmp_path_factory, data):
    folder = tmp_path_factory.mktemp("fuzz")
    ckpt = folder / "step=00000004.ckpt"
    ckpt.write_bytes(data)  # the checkpoint itself is garbage too
    manifest_path(ckpt).write_bytes(data)
    (folder / PROGRESS_FILE).write_bytes(data)
    value = parse_json_object(data)
    assert value is None or isinstance(value, dict)
    assert read_manifest(ckpt) == value
    verdict = verify(ckpt)  # judged, never raised
    assert not verdict and verdict.reason
    step = read_highest_step(folder)
    assert step is None or type(step) is int
    at = last_progress_time(folder)
    assert at is None or isinstance(at, float)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "skipping checkpoint ...: its manifest is not readable JSON"
        listed = list_bucket_manifests(OneFolderStore({"step=00000004.ckpt.manifest.json": data}), "b/run")
        assert find_resume_checkpoint(folder) is None
    assert listed == (
        []
        if value is None
        else [(value.get("global_step") if type(value.get("global_step")) is int else -1, "step=00000004.ckpt", value)]
    )
    (folder / "goodput.json").write_bytes(data)
    if value is None:
        with pytest.raises(ValueError, match=r"goodput\.json is not a JSON object"):
            load_run(folder)


def write_checkpoints(folder: Path, steps: tuple[int, ...]) -> list[Path]:
    paths = []
    for step in steps:
        path = folder / f"step={step:08d}.ckpt"
        atomic_save({"global_step": step, "w": torch.full((8,), float(step))}, path, {"global_step": step})
        paths.append(path)
    return paths


def test_a_torn_manifest_is_not_trusted_and_the_file_is_judged_by_its_zip(tmp_path):
    """64 random bytes in the newest checkpoint's manifest (what a torn write leaves): the search resumes from that
    file, whose zip container and CRCs are intact, with a warning saying why; a torn file too falls back to the
    next valid checkpoint."""
    old, new = write_checkpoints(tmp_path, (4, 8))
    manifest_path(new).write_bytes(os.urandom(64))
    with pytest.warns(UserWarning, match=r"Resuming from .*step=00000008.ckpt although it has unreadable manifest"):
        assert find_resume_checkpoint(tmp_path) == str(new)
    new.write_bytes(new.read_bytes()[:-100])  # and now the file is torn too
    with pytest.warns(UserWarning, match=r"Skipping checkpoint .*step=00000008.ckpt"):
        assert find_resume_checkpoint(tmp_path) == str(old)


def test_a_run_resumes_from_a_checkpoint_whose_manifest_is_garbage(tmp_path):
    """End to end, through PreemptionCheckpoint and Lightning's loader: the newest checkpoint's manifest replaced by
    random bytes; ``find_resume_checkpoint`` and an explicit ``ckpt_path`` both resume from it, and the run ends on
    the same weights as one that never lost its manifest."""

    def run(max_steps: int, ckpt_path: str | None, folder: Path) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = BucketNet()
        callbacks = [PreemptionCheckpoint(folder, every_n_steps=4, keep_last=None)]
        trainer = Trainer(**tiny_trainer_kwargs(tmp_path, max_steps=max_steps, callbacks=callbacks))
        trainer.fit(model, train_dataloaders=loaders()[0], ckpt_path=ckpt_path)
        return {k: v.clone() for k, v in model.state_dict().items()}

    folder = tmp_path / "ckpt"
    run(8, None, folder)
    newest = folder / "step=00000008.ckpt"
    manifest_path(newest).write_bytes(os.urandom(64))
    with pytest.warns(UserWarning, match="unreadable manifest"):
        found = find_resume_checkpoint(folder)
    assert found == str(newest)
    resumed = run(12, found, tmp_path / "after")
    explicit = run(12, str(newest), tmp_path / "explicit")
    whole = run(12, None, tmp_path / "whole")
    for key, value in whole.items():
        assert torch.equal(resumed[key], value) and torch.equal(explicit[key], value), key


def test_a_checkpoint_is_verified_once_per_node_whatever_the_number_of_readers(tmp_path, monkeypatch):
    """Every rank of a node searches and loads the same checkpoint: the first reads and checksums it, the others
    (here: later calls, and AtomicCheckpointIO's load) take its verdict; a file changed since is read again."""
    from lightning_accel.checkpoint import AtomicCheckpointIO

    verify_module = importlib.import_module("lightning_accel.checkpoint.verify")  # (the package exports verify())

    monkeypatch.setenv("LIGHTNING_ACCEL_CACHE_DIR", str(tmp_path / "node"))
    reads: list[str] = []
    real = verify_module.verify
    monkeypatch.setattr(verify_module, "verify", lambda path, *a, **k: reads.append(Path(path).name) or real(path))
    (newest,) = write_checkpoints(tmp_path / "ck", (4,))
    for _ in range(3):  # three ranks' searches
        assert find_resume_checkpoint(tmp_path / "ck") == str(newest)
    AtomicCheckpointIO().load_checkpoint(newest)  # and a load
    assert reads == ["step=00000004.ckpt"]
    newest.write_bytes(newest.read_bytes()[:-10])  # changed: a new verdict, and not a usable one
    with pytest.warns(UserWarning, match="Skipping checkpoint"):
        assert find_resume_checkpoint(tmp_path / "ck") is None
    assert reads == ["step=00000004.ckpt"] * 2


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10**12) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)


@FUZZ
@given(
    files=json_values | st.dictionaries(st.sampled_from([".metadata", "__0_0.distcp", "../x", "/etc/x"]), json_values)
)
def test_no_reader_raises_on_a_hostile_folder_manifest(tmp_path_factory, files):
    """A folder manifest that is valid JSON with anything as its list of files (a list, sizes that are not sizes,
    paths leaving the folder): the search, the bucket's check, a rank's shard check and the download all judge it,
    and none raises."""
    from lightning_accel.checkpoint.bucket_listing import confirm_objects
    from lightning_accel.checkpoint.sharded import verify_folder
    from lightning_accel.storage.shards import check_share, folder_entries

    root = tmp_path_factory.mktemp("folder")
    folder = root / "step=00000004.ckpt"
    folder.mkdir()
    (folder / ".metadata").write_bytes(b"xy")
    (folder / "__0_0.distcp").write_bytes(b"shard")
    manifest = {"format": 2, "kind": "folder", "global_step": 4, "files": files}
    manifest_path(folder).write_text(json.dumps(manifest))
    trusted = folder_entries(manifest) is not None

    def fair(rel, entry) -> bool:  # what a manifest of ours holds: a relative path inside, a size, a checksum
        inside = ".." not in Path(rel).parts and not Path(rel).is_absolute()
        size = entry.get("bytes") if isinstance(entry, dict) else None
        return inside and type(size) is int and size >= 0 and isinstance(entry.get("xxh3_64", ""), str)

    assert trusted == (isinstance(files, dict) and all(fair(k, v) for k, v in files.items()))
    verdict = verify_folder(folder, manifest)
    assert bool(verdict) is False or trusted
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = find_resume_checkpoint(root)
    assert found is None or trusted
    assert check_share(folder, manifest, 0, 1) is None or isinstance(check_share(folder, manifest, 0, 1), str)

    class Sizes:  # a store holding the folder's files with their sizes
        def info(self, path):
            local = folder / path.split("step=00000004.ckpt/", 1)[-1]
            if not local.is_file() or ".." in path:
                raise FileNotFoundError(path)
            return {"size": local.stat().st_size}

    problem = confirm_objects(Sizes(), "b/run", "step=00000004.ckpt", manifest)
    assert problem is None or isinstance(problem, str)


def test_a_checkpoint_altered_or_lost_in_the_bucket_is_skipped_on_resume_and_refused_by_name(bucket, tmp_path):
    """After their uploads, the store's copy of the newest checkpoint gets one byte flipped (same size: the listing's
    size check cannot see it) and the next one's object is deleted (its manifest left). An empty machine resumes from
    the one before, each skip named with its reason; asked for by name, the altered one is an error naming it. The
    altered download is never taken as verified by a later search, and once the store holds the right bytes again
    the newest is found."""
    import fsspec

    from lightning_accel.checkpoint.bucket_resume import fetch_from_bucket
    from lightning_accel.checkpoint.durable import MANIFEST_SUFFIX

    fs = fsspec.filesystem("s3")
    for path in write_checkpoints(tmp_path / "staged", (4, 8, 12)):
        fs.put_file(str(path), f"{bucket}/run/{path.name}")
        fs.put_file(str(manifest_path(path)), f"{bucket}/run/{path.name}{MANIFEST_SUFFIX}")  # manifest last
    newest = f"{bucket}/run/step=00000012.ckpt"
    intact = fs.cat_file(newest)
    altered = bytearray(intact)
    altered[len(altered) // 2] ^= 0xFF
    fs.pipe_file(newest, bytes(altered))
    fs.rm_file(f"{bucket}/run/step=00000008.ckpt")
    url = f"s3://{bucket}/run"

    for _ in range(2):  # the second search is not fooled by the altered copy the first one downloaded
        with pytest.warns(UserWarning) as said:
            found = find_resume_checkpoint(url)
        skipped = sorted(str(w.message) for w in said if "Skipping checkpoint" in str(w.message))
        assert len(skipped) == 2, skipped
        assert "step=00000012.ckpt" in skipped[1] and "xxh3-64 checksum does not match" in skipped[1]
        assert "step=00000008.ckpt" in skipped[0] and "missing from the store" in skipped[0]
        assert found.endswith("step=00000004.ckpt") and torch.load(found)["global_step"] == 4
    with pytest.raises(FileNotFoundError, match=r"step=00000012\.ckpt is not usable: .*xxh3-64 checksum"):
        fetch_from_bucket(f"{url}/step=00000012.ckpt")

    fs.pipe_file(newest, intact)
    found = find_resume_checkpoint(url)
    assert found.endswith("step=00000012.ckpt") and torch.load(found)["global_step"] == 12
