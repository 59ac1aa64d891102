"""Every guide's Python examples run as written (in a scratch folder with the recipes beside them)."""

from __future__ import annotations

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


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("guide", GUIDES, ids=lambda p: p.stem)
def test_guide_examples_run(guide, tmp_path, request, monkeypatch):
    shutil.copytree(ROOT / "recipes", tmp_path / "recipes")
    script = tmp_path / "example.py"
    script.write_text(python_blocks(guide))
    if "s3://" in script.read_text():  # a guide with a bucket runs against the tests' S3 server on 127.0.0.1
        request.getfixturevalue("s3_server")
        monkeypatch.setenv("LIGHTNING_ACCEL_CACHE_DIR", str(tmp_path / "cache"))
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{guide.name}:\n{result.stderr[-3000:]}"
