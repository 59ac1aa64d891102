"""The test session's process zygote (tests/helpers/zygote/) keeps what the tests rely on from a fresh process: the
command line, folder, environment and paths it was given, its exit code or signal, signals sent to the pid the
caller knows, and its death with that pid's. Each check also asserts the process was forked (the tests would pass
on fresh processes too, but the zygote would then save nothing)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

PROBE = """
import json, os, sys, tempfile, torch
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "x": os.environ.get("PROBE_X"),
    "tmp": tempfile.gettempdir(),
    "forked": "lightning.pytorch" in sys.modules, "main": __name__, "threads": torch.get_num_threads()}))
"""


@pytest.fixture
def zygote_on(zygote):
    if zygote is None:
        pytest.skip("the zygote is off here (LIGHTNING_ACCEL_TEST_FRESH_PROCESSES or a GPU): processes start fresh")
    deadline = time.monotonic() + 120
    while not Path(os.environ["LIGHTNING_ACCEL_TEST_ZYGOTE"]).exists():  # (it binds its socket once it has imported)
        assert time.monotonic() < deadline and zygote.poll() is None, "the zygote did not start"
        time.sleep(0.2)


def test_a_script_gets_its_command_folder_environment_and_paths_and_exits_with_its_code(zygote_on, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE + "sys.exit(7)\n")
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "PROBE_X": "given", "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path / "tmp")}
    done = subprocess.run(
        [sys.executable, str(script), "a", "b"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 7, done.stderr
    seen = json.loads(done.stdout)
    assert seen == {
        "argv": [str(script), "a", "b"],
        "cwd": str(tmp_path),
        "path0": str(tmp_path),
        "x": "given",
        "tmp": str(tmp_path / "tmp"),  # (the zygote's own was cached by the modules it preloaded)
        "forked": True,
        "main": "__main__",
        "threads": 1,
    }
    module = subprocess.run([sys.executable, "-m", "json.tool", "--help"], capture_output=True, text=True)
    assert module.returncode == 0 and "usage" in module.stdout


def _alive(pid: int) -> bool:
    """Running, not a zombie. Its /proc entry can go between any two reads (reaped): gone is not alive."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"  # the state follows the name, which may hold spaces


def test_signals_reach_the_process_and_its_death_is_the_callers(zygote_on, tmp_path):
    code = (
        "import os, signal, sys, time, torch\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))\n"
        "open(sys.argv[1], 'w').write(str(os.getpid()))\n"
        "time.sleep(60)\n"
    )
    pid_file = tmp_path / "pid"
    proc = subprocess.Popen([sys.executable, "-c", code, str(pid_file)])
    while not pid_file.exists() or not pid_file.read_text():
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # to the proxy: forwarded; the handler's exit code comes back
    assert proc.wait(timeout=30) == 75

    pid_file.unlink()
    proc = subprocess.Popen([sys.executable, "-c", code, str(pid_file)])
    while not pid_file.exists() or not pid_file.read_text():
        time.sleep(0.05)
    worker = int(pid_file.read_text())
    assert worker != proc.pid  # forked by the zygote, behind the proxy
    proc.kill()  # SIGKILL the pid the caller knows: the process goes too
    assert proc.wait(timeout=30) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while _alive(worker):
        assert time.monotonic() < deadline, "the forked process outlived its proxy"
        time.sleep(0.05)

    aborted = subprocess.run([sys.executable, "-c", "import os, signal, torch; os.kill(os.getpid(), signal.SIGABRT)"])
    assert aborted.returncode == -signal.SIGABRT  # killed by a signal: the caller sees that signal


def test_an_uncaught_exception_prints_its_traceback_and_exits_1(zygote_on):
    done = subprocess.run(
        [sys.executable, "-c", "import torch; raise ValueError('boom')"], capture_output=True, text=True
    )
    assert done.returncode == 1
    assert done.stderr.strip().endswith("ValueError: boom") and "Traceback" in done.stderr


def test_the_sessions_processes_skip_only_jsonschemas_slow_optional_iri_checker():
    """sitecustomize.py's SkippedOptionalImports, in a process the session starts (with the zygote on or off):
    rfc3987_syntax reads as not installed, jsonschema still validates, and other imports are untouched."""
    try:  # (the distribution's metadata: an xdist worker has the finder too)
        importlib.metadata.distribution("rfc3987-syntax")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("rfc3987-syntax is not installed (it comes with jupyterlab, HolisticTraceAnalysis' extra)")
    probe = (
        "import importlib.util, json, jsonschema\n"
        "try:\n    import rfc3987_syntax\n    skipped = False\nexcept ModuleNotFoundError:\n    skipped = True\n"
        "jsonschema.validate({'a': 1}, {'properties': {'a': {'type': 'integer'}}})\n"
        "print(json.dumps([skipped, importlib.util.find_spec('lark') is not None]))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert json.loads(done.stdout) == [True, True]
