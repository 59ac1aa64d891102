"""The trial process's entry point: ``python -m lightning_accel.tuning --serve`` or ``... SPEC.json RESULT.json``.

Here rather than under ``trial.py``'s ``if __name__ == "__main__"``: the package imports ``trial``, so
``python -m lightning_accel.tuning.trial`` would run a second copy of that module (runpy warns about it).
"""

import sys

from lightning_accel.tuning.server import serve
from lightning_accel.tuning.trial import run_trial_process

if sys.argv[1:] == ["--serve"]:
    serve()
else:
    run_trial_process(sys.argv[1], sys.argv[2])
