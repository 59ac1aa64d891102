"""Shared fixtures. Everything here runs on the CPU; GPU-only tests skip with a reason."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

from lightning_accel.logs import defer_to_root
from lightning_accel.testing import quiet_trainer_kwargs
from tests.helpers.zygote import fresh_env

defer_to_root()  # our records reach pytest's handlers on the root logger (caplog), as in a program that logs

# Two cores: one intra-op thread per test process keeps DDP tests from oversubscribing the machine.
torch.set_num_threads(1)
os.environ.setdefault("PYTHONHASHSEED", "0")
# Nothing in the tests asks a real cloud's metadata server, even on a CI machine in a cloud: PreemptionNotices("auto")
# and every subprocess the tests start (the guides' examples) see no cloud; the notice tests name theirs explicitly.
os.environ["LIGHTNING_ACCEL_CLOUD"] = "none"
# The node cache (staging, downloads, verdicts) of this test session and its subprocesses, not the user's ~/.cache
os.environ.setdefault("LIGHTNING_ACCEL_CACHE_DIR", tempfile.mkdtemp(prefix="lightning_accel_cache-"))
# A clean clone has no compiled bytecode: under PYTHONDONTWRITEBYTECODE (set on some CI machines) every process of
# the session would compile the package and the tests again (measured: 0.35 s against 0.17 s per process here).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
# Every process the tests start finds the repository (their scripts import tests.*), and the zygote's hook first.
ROOT = Path(__file__).resolve().parents[1]
ZYGOTE = ROOT / "tests/helpers/zygote"
_paths = [str(ZYGOTE), str(ROOT), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in _paths if p))

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none")


def tiny_trainer_kwargs(tmp_path, **overrides):
    """Quiet, fast Trainer settings for tests."""
    return quiet_trainer_kwargs(**{"accelerator": "cpu", "devices": 1, "default_root_dir": str(tmp_path), **overrides})


class SigtermAt(Callback):
    """Sends this process a real SIGTERM at the start of the batch that follows global step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


# The order the two workers take files in (the Makefile runs `--dist loadfile --no-loadscope-reorder`): the longest
# first, so the short files fill the gaps at the end instead of a long file starting last and running alone. Seconds
# are one run's on 2 cores (with the zygote). The Ray fleet starts beside files of single-process fits (docs, tune, the
# one-process resume matrix), not beside the multi-rank DeepSpeed runs: Ray's many processes start slowly when
# the other worker's ranks hold both cores (6 min to the first step once, against 1.5 min).
LONGEST_FIRST = (
    "tests/launch/test_fleet.py",  # 140 s
    "tests/test_docs.py",  # 87 s
    "tests/tune/test_tune.py",  # 52 s
    "tests/checkpoint/test_resume_matrix.py",  # 79 s
    "tests/checkpoint/test_world_change.py",  # 70 s
    "tests/launch/test_elastic.py",  # 45 s
    "tests/checkpoint/test_preemption.py",  # 31 s
    "tests/strategies/test_strategies.py",  # 29 s
    "tests/checkpoint/test_bucket.py",  # 32 s
    "tests/checkpoint/test_sharded.py",  # 17 s
    "tests/monitor/test_goodput.py",  # 20 s
    "tests/monitor/test_sentinel.py",  # 22 s
)


def pytest_collection_modifyitems(config, items):
    """Files in LONGEST_FIRST's order, the rest after them (a stable sort: a file's tests keep their order)."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


@pytest.fixture(scope="session", autouse=True)
def zygote(tmp_path_factory):
    """The session's process zygote (tests/helpers/zygote/server.py): the Python processes the tests start are
    forked from an interpreter that imported torch and Lightning once, instead of importing them again (about 6 s
    of CPU each). Each still runs our code from its first import and exits as a fresh process does. Processes
    started before it is ready start fresh. LIGHTNING_ACCEL_TEST_FRESH_PROCESSES=1 turns it off; so does a GPU
    (a process that has asked CUDA anything must not fork)."""
    if os.environ.get("LIGHTNING_ACCEL_TEST_FRESH_PROCESSES") or torch.cuda.is_available():
        yield None
        return
    socket_path = tmp_path_factory.mktemp("zygote") / "socket"
    server = subprocess.Popen(
        [sys.executable, str(ZYGOTE / "server.py"), str(socket_path)],
        env=fresh_env(),  # (the zygote itself hands nothing over)
        stdout=subprocess.DEVNULL,
        start_new_session=True,  # its handlers share its group: one killpg ends them (their processes follow)
    )
    os.environ["LIGHTNING_ACCEL_TEST_ZYGOTE"] = str(socket_path)
    os.environ["LIGHTNING_ACCEL_TEST_ZYGOTE_PYTHON"] = sys.executable
    try:
        yield server
    finally:
        os.environ.pop("LIGHTNING_ACCEL_TEST_ZYGOTE", None)
        os.environ.pop("LIGHTNING_ACCEL_TEST_ZYGOTE_PYTHON", None)
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on 127.0.0.1 behind a proxy the tests can cut (tests.helpers.object_stores.py); the standard AWS
    variables point at the proxy for this process and every subprocess it starts."""
    from tests.helpers.object_stores import MotoServer, Proxy, s3_env

    server = MotoServer().start()
    proxy = Proxy(server.port).start()
    saved = {k: os.environ.get(k) for k in s3_env(proxy.url)}
    os.environ.update(s3_env(proxy.url))
    try:
        yield proxy
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        proxy.stop()
        server.stop()


@pytest.fixture
def bucket(s3_server, request, tmp_path, monkeypatch):
    """A new bucket on the test server (its name from the test's), and a fresh local cache: an empty machine."""
    import hashlib
    import re

    import fsspec
    import s3fs

    # the test's name, cut short, and a digest of the whole (the cases of a parametrized test share its start)
    digest = hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:8]
    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:31].strip("-") + f"-{digest}-{os.getpid()}"
    s3_server.restore()  # forwarding, whatever the test before left
    # new clients for this test: a test before may have cut the pooled connections of the cached ones (the proxy's
    # refuse/stall), and with AWS_MAX_ATTEMPTS=1 botocore does not retry a reset one
    for attempt in range(3):  # a loaded machine's server may reset one connection: the tests allow no retries
        s3fs.S3FileSystem.clear_instance_cache()
        try:
            fsspec.filesystem("s3").mkdir(name)
            break
        except Exception:  # s3fs passes botocore's EndpointConnectionError through as it is
            if attempt == 2:
                raise
            time.sleep(1.0)
    monkeypatch.setenv("LIGHTNING_ACCEL_CACHE_DIR", str(tmp_path / "cache"))
    return name


@pytest.fixture(scope="session")
def azure_container(tmp_path_factory):
    """Azurite's Blob service on 127.0.0.1 (``make test`` installs it into ``.azurite/`` from the npm registry) and a
    container in it; adlfs reaches it through the standard AZURE_STORAGE_CONNECTION_STRING."""
    from tests.helpers.object_stores import AZURITE, AzuriteServer

    if not AZURITE.is_file():
        pytest.skip(f"Azurite is not installed at {AZURITE}: `make test` installs it from the npm registry")
    import fsspec

    server = AzuriteServer(tmp_path_factory.mktemp("azurite")).start()
    saved = os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
    os.environ["AZURE_STORAGE_CONNECTION_STRING"] = server.connection_string
    try:
        fsspec.filesystem("az", skip_instance_cache=True).mkdir("checkpoints")
        yield "checkpoints"
    finally:
        if saved is None:
            os.environ.pop("AZURE_STORAGE_CONNECTION_STRING", None)
        else:
            os.environ["AZURE_STORAGE_CONNECTION_STRING"] = saved
        server.stop()
