"""Every guide's Python examples run as written (in a scratch folder with the recipes beside them)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# docs that are not a capability guide (no runnable example expected)
NOT_GUIDES = {"performance.md", "architecture.md"}
GUIDES = sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in NOT_GUIDES)


def python_blocks(path: Path) -> str:
    return "\n\n".join(re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S))


def test_every_capability_has_a_guide_with_an_example():
    names = {p.stem for p in GUIDES}
    assert {"cli", "precision_compile", "distributed", "data", "monitoring", "checkpointing", "tune"} <= names
    for guide in GUIDES:
        code = python_blocks(guide)
        assert "trainer.fit" in code or "build_cli" in code or "tune(" in code, guide.name


def test_readme_links_resolve():
    for target in re.findall(r"\]\((docs/[^)]+)\)", (ROOT / "README.md").read_text()):
        assert (ROOT / target.split("#")[0]).is_file(), target  # (an anchor names a section of the file)


def needs_own_process(code: str) -> bool:
    """An example that starts processes of its own (ranks, the CLI, a launcher) or uses the test S3 server runs
    alone in a fresh interpreter; the others share one (tests/helpers/run_examples.py)."""
    return any(mark in code for mark in ("subprocess", "devices=2", "torchrun", "s3://"))


def scratch(guide: Path, folder: Path) -> Path:
    """The guide's examples as one script in ``folder``, with the recipes beside it (as the guides assume)."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copytree(ROOT / "recipes", folder / "recipes")
    script = folder / "example.py"
    script.write_text(python_blocks(guide))
    return script


@pytest.fixture(scope="module")
def shared_process_results(tmp_path_factory) -> dict[str, str | None]:
    """Each shared-process guide's failure (``None``: it ran), from one interpreter running them in turn."""
    root = tmp_path_factory.mktemp("guides")
    scripts = {g.stem: scratch(g, root / g.stem) for g in GUIDES if not needs_own_process(python_blocks(g))}
    results = root / "results.json"
    cmd = [sys.executable, "-m", "tests.helpers.run_examples", str(results), *map(str, scripts.values())]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    ran = json.loads(results.read_text()) if results.exists() else {}
    failures = {name: ran.get(str(path), f"never ran:\n{proc.stderr[-3000:]}") for name, path in scripts.items()}
    assert proc.returncode == 0 or any(failures.values()), proc.stderr[-3000:]
    return failures


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("guide", GUIDES, ids=lambda p: p.stem)
def test_guide_examples_run(guide, tmp_path, request, monkeypatch):
    code = python_blocks(guide)
    if not needs_own_process(code):
        failure = request.getfixturevalue("shared_process_results")[guide.stem]
        assert failure is None, f"{guide.name}:\n{failure[-3000:]}"
        return
    script = scratch(guide, tmp_path)
    if "s3://" in code:  # a guide with a bucket runs against the tests' S3 server on 127.0.0.1
        request.getfixturevalue("s3_server")
        monkeypatch.setenv("LIGHTNING_ACCEL_CACHE_DIR", str(tmp_path / "cache"))
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{guide.name}:\n{result.stderr[-3000:]}"
