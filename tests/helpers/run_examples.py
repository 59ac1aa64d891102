"""Run several guides' examples one after another in this one process, each as ``python example.py`` would run it
(``__main__``, its own folder as the working directory, a fresh module namespace), so the suite pays the interpreter
start and the imports once instead of once per guide.

python -m tests.helpers.run_examples RESULTS_JSON EXAMPLE_PY [EXAMPLE_PY ...]

RESULTS_JSON gets, for each example, ``null`` when it ran to the end (or exited 0) and the traceback otherwise; an
example that fails does not stop the next one.
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import sys
import traceback
from pathlib import Path


def run(example: Path) -> str | None:
    """The example's failure as text, or ``None``."""
    cwd, argv = os.getcwd(), sys.argv
    os.chdir(example.parent)
    sys.argv = [str(example)]
    try:
        runpy.run_path(str(example), run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (0, None):
            return f"exited with {stop.code!r}\n{traceback.format_exc()}"
    except BaseException:  # any failure is the example's result
        return traceback.format_exc()
    finally:
        os.chdir(cwd)
        sys.argv = argv
    return None


def main() -> None:
    results_path, *examples = sys.argv[1:]
    results = {}
    for example in map(Path, examples):
        results[str(example)] = run(example)
        # The example's objects are garbage now; a DALI pipeline among them must be collected here, where its threads
        # live, not by a collection inside a later example's forked loader worker (it would wait there forever).
        gc.collect()
        Path(results_path).write_text(json.dumps(results))  # after each: a crash still reports the ones before


if __name__ == "__main__":
    main()
