"""Pay for what you use: the core install runs every callback that needs no extra, and each feature that needs one
refuses at construction with lightning_accel.MissingExtra naming the pip extra."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from lightning_accel import MissingExtra
from lightning_accel.extras import EXTRAS, available, require
from lightning_accel.storage import MissingStorageBackend, UnsupportedStorageError
from tests.helpers.zygote import fresh_env

ROOT = Path(__file__).resolve().parents[1]
HEAVY = (
    "deepspeed",
    "nvidia-dali",
    "torchao",
    "ray",
    "holistictraceanalysis",
    "s3fs",
    "gcsfs",
    "adlfs",
    "pytorch-extra",
)


def test_the_core_install_names_no_heavy_package_and_every_extra_is_in_all():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"]).lower()
    assert not [name for name in HEAVY if name in core]
    assert "prometheus_client" in core  # the monitors' endpoint is core
    extras = project["optional-dependencies"]
    assert set(EXTRAS) <= set(extras) and all(
        f"{e}," in extras["all"][0] or f"{e}]" in extras["all"][0] for e in EXTRAS
    )
    assert "'.[all,dev]'" in (ROOT / "Makefile").read_text()  # make demo / make test install everything


def test_require_names_the_extra_and_finds_without_importing():
    assert available("json") and not available("no_such_package_xyz") and not available("no_such_package_xyz.sub")
    with pytest.raises(MissingExtra, match=r"^Thing needs no_such_mod, .*pip install 'lightning-accel\[dali\]'") as e:
        require("dali", "Thing", module="no_such_mod")
    assert isinstance(e.value, ImportError) and (e.value.extra, e.value.name) == ("dali", "no_such_mod")
    assert issubclass(MissingStorageBackend, UnsupportedStorageError) and issubclass(
        MissingStorageBackend, MissingExtra
    )


@pytest.mark.multiprocess
def test_without_the_extras_the_core_callbacks_train_and_each_extra_feature_names_its_extra(tmp_path):
    """tests/helpers/core_install.py: a process where DALI, DeepSpeed, torchao, Ray, HTA and the fsspec backends
    cannot be imported (as where pip never installed them; a second venv would cost minutes of install per run)."""
    out = tmp_path / "results.json"
    cmd = [sys.executable, str(ROOT / "tests/helpers/core_install.py"), str(out)]
    # a fresh interpreter: the zygote's children start with modules in memory that this test must see imported
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=fresh_env())
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["loaded_at_import"] == []  # `import lightning_accel` touched none of them
    fit = results["fit"]
    assert fit["global_step"] == 8 and fit["checkpoint"].endswith("step=00000008.ckpt") and fit["goodput_json"]
    errors = results["errors"]
    for extra in ("dali", "deepspeed", "fp8", "cloud"):
        assert errors[extra]["extra"] == extra, errors[extra]
        assert f"pip install 'lightning-accel[{extra}]'" in errors[extra]["message"]
    assert errors["cloud"]["type"] == "MissingStorageBackend"  # also an UnsupportedStorageError, as before
    # the CLI: one line and the usage-error status, no traceback
    assert errors["ray"] == {"type": "SystemExit", "extra": None, "message": "2"}
    assert "needs ray.train, which the core install leaves out: pip install 'lightning-accel[ray]'" in done.stderr
    assert "Traceback" not in done.stderr
