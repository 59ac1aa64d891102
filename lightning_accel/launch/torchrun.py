"""``lightning-accel torchrun``: torchrun running ``lightning-accel``, with the exit codes a scheduler needs.

Plain torchrun restarts a failed group (``--max-restarts``) as it should, but when the launcher itself gets
SIGTERM (a spot reclaim, Kubernetes stopping the pod) it stops the workers and exits 1 with a
``SignalException`` traceback, so a scheduler sees a crash even though the workers saved a checkpoint and
exited 75. This wrapper runs torchrun's own launcher in-process (its agent, rendezvous, restarts and shutdown
grace are unchanged) and maps the ends:

- the launcher was signalled: the agent gives the workers its shutdown grace to save (PreemptionCheckpoint
  saves at the next optimizer step and exits 75), then this exits **75** (EX_TEMPFAIL: requeue, resume with
  ``--ckpt_path auto``); nothing is restarted;
- every failed worker exited 75 (it was signalled and saved): **75**;
- any other failure, after torchrun's restarts ran out: **1**, with one line naming the worker and its code;
- success: 0.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import NoReturn

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run

from lightning_accel._compat import SHARED_RENDEZVOUS_STORE_LOSES_JOINERS
from lightning_accel.checkpoint import PREEMPTED_EXIT_CODE

__all__ = ["SUBCOMMANDS", "USAGE", "exit_launcher", "torchrun"]

log = logging.getLogger(__name__)

SUBCOMMANDS = ("fit", "validate", "test", "predict")
USAGE = (
    "usage: lightning-accel torchrun [TORCHRUN OPTIONS] {fit,validate,test,predict} [LIGHTNING-ACCEL OPTIONS]\n"
    "  e.g. lightning-accel torchrun --nproc-per-node 2 --max-restarts 3 fit --config recipe.yaml --ckpt_path auto"
)


def torchrun(argv: list[str]) -> int:
    """Run ``torchrun [options] -m lightning_accel.cli SUBCOMMAND ...``; return the exit code (see module doc)."""
    split = next((i for i, arg in enumerate(argv) if arg in SUBCOMMANDS), None)
    if split is None:
        print(f"{USAGE}\nerror: no subcommand ({', '.join(SUBCOMMANDS)}) in {' '.join(argv) or 'the arguments'}")
        return 2
    args = get_args_parser().parse_args([*argv[:split], "--module", "lightning_accel.cli", *argv[split:]])
    elastic = ":" in str(args.nnodes)
    if elastic and SHARED_RENDEZVOUS_STORE_LOSES_JOINERS and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in os.environ:
        # a node joining a running elastic job gets no store address from the shared rendezvous store (the flag's
        # note in _compat: the versions it applies to); a store per round does not have that flaw
        log.info(
            "elastic job (--nnodes %s): one rendezvous store per round (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)",
            args.nnodes,
        )
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    try:
        run(args)
    except SignalException as err:
        log.warning(
            "torchrun received %s: the workers were told to save and stop; exiting %d (preempted: run the same "
            "command again, --ckpt_path auto resumes from the newest valid checkpoint)",
            signal.Signals(err.sigval).name,
            PREEMPTED_EXIT_CODE,
        )
        return PREEMPTED_EXIT_CODE
    except ChildFailedError as err:
        codes = {failure.exitcode for failure in err.failures.values()}
        if codes == {PREEMPTED_EXIT_CODE}:
            log.warning("the workers were preempted and saved; exiting %d", PREEMPTED_EXIT_CODE)
            return PREEMPTED_EXIT_CODE
        rank, failure = min(err.failures.items())
        log.error(
            "worker rank %d failed with exit code %s after torchrun's restarts (--max-restarts %s); its output is "
            "above",
            rank,
            failure.exitcode,
            args.max_restarts,
        )
        return 1
    return 0


def exit_launcher(code: int) -> NoReturn:
    """End the launcher process with ``code``, skipping the interpreter's teardown (logs flushed first).

    When the launcher itself is signalled, torchrun leaves its rendezvous store running on purpose (a C++ server
    thread, kept so a later rendezvous can reuse it), and tearing the interpreter down around it can abort the
    process: the launcher logged "exiting 75" and then died of SIGABRT ("terminate called without an active
    exception"), which a scheduler reads as a crash. By now torchrun has stopped and
    reaped every worker, so the teardown has nothing left to do.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
