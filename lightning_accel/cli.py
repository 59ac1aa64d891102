"""``lightning-accel`` command line: LightningCLI with our recipes, ``precision: auto-mixed`` and ``ckpt_path: auto``.

Usage::

    lightning-accel fit --config recipes/tiny_gpt_cpu.yaml
    lightning-accel fit --config recipes/tiny_gpt_cpu.yaml --trainer.max_steps 50 --ckpt_path auto
    lightning-accel profile --config recipes/tiny_gpt_cpu.yaml [--out runs/profile] [--active 5]
    lightning-accel doctor runs/profile
    lightning-accel tune --config recipes/tiny_gpt_cpu.yaml [--budget 5m] [--out tuned.yaml]
    lightning-accel torchrun --nproc-per-node 2 --max-restarts 3 fit --config recipes/tiny_gpt_ddp_cpu.yaml
    lightning-accel fit --config recipes/tiny_gpt_ddp_cpu.yaml --ray.num_workers 2 --ray.max_failures 2
"""

from __future__ import annotations

import argparse
import difflib
import logging
import sys
from pathlib import Path

from lightning_accel._compat import quiet_known_deprecations
from lightning_accel.launch import exit_launcher, fit_on_ray, newest_checkpoint, split_ray_args, torchrun
from lightning_accel.logs import defer_to_root
from lightning_accel.monitor import GoodputMonitor
from lightning_accel.profile import TorchProfiler, diagnose, load_run, report
from lightning_accel.recipe import build_cli
from lightning_accel.storage import download_dir, is_remote
from lightning_accel.strategies import close_gloo_process_group_at_exit
from lightning_accel.tuning import tune
from lightning_accel.tuning.config import add_cli_options, config_from_cli

__all__ = ["COMMANDS", "doctor", "fit_with_ray", "main", "overview", "profile", "tune_command"]

log = logging.getLogger(__name__)


def doctor(args: list[str]) -> int:
    """``lightning-accel doctor RUN_DIR``: print the ranked findings, write doctor.md/.png/.json there."""
    parser = argparse.ArgumentParser(prog="lightning-accel doctor", description=doctor.__doc__)
    parser.add_argument(
        "run_dir", help="folder a GoodputMonitor (and TorchProfiler) wrote into, or a bucket URL (a checkpoint dirpath)"
    )
    ns = parser.parse_args(args)
    try:
        goodput, summary = load_run(ns.run_dir)
    except (FileNotFoundError, ValueError) as err:
        parser.error(str(err))
    # a bucket's report goes beside the local copy of its run files
    out = download_dir(ns.run_dir) / "run" if is_remote(ns.run_dir) else Path(ns.run_dir)
    path = report(diagnose(goodput, summary), goodput, summary, out)
    log.info("doctor report: %s", path)
    return 0


def profile(args: list[str]) -> int:
    """``lightning-accel profile --config RECIPE``: train a short profiled window of a recipe, then the doctor."""
    parser = argparse.ArgumentParser(prog="lightning-accel profile", description=profile.__doc__)
    parser.add_argument("--config", required=True, help="recipe YAML (as for `lightning-accel fit`)")
    parser.add_argument("--out", type=Path, default=None, help="run folder (default: runs/profile/<recipe>)")
    parser.add_argument("--wait", type=int, default=5, help="batches before tracing (compilation, warm-up)")
    parser.add_argument("--active", type=int, default=5, help="batches traced")
    ns, extra = parser.parse_known_args(args)
    out = ns.out or Path("runs/profile") / Path(ns.config).stem
    window = TorchProfiler(wait=ns.wait, warmup=1, active=ns.active, dirpath=out / "profile")
    cli = build_cli(
        [
            "--config",
            ns.config,
            "--trainer.max_steps",
            str(window.window + 2),
            "--trainer.default_root_dir",
            str(out),
            # a sanity check is a large part of a short window and not the training's cost
            "--trainer.num_sanity_val_steps",
            "0",
            *extra,
        ],
        run=False,
    )
    trainer = cli.trainer
    monitors = [c for c in trainer.callbacks if isinstance(c, GoodputMonitor)]
    if monitors:
        monitors[0].run_dir = out
    else:
        trainer.callbacks.append(GoodputMonitor(every_n_steps=max(window.window, 1), run_dir=out))
    trainer.callbacks.append(window)
    trainer.fit(cli.model, datamodule=cli.datamodule)
    return doctor([str(out)])


def tune_command(args: list[str]) -> int:
    """``lightning-accel tune --config RECIPE``: measure precision, compile, loader and batch; write a tuned recipe.

    Arguments after the options are passed to the recipe (e.g. ``--trainer.max_steps 500``).
    """
    parser = argparse.ArgumentParser(prog="lightning-accel tune", description=tune_command.__doc__)
    parser.add_argument("--config", required=True, help="recipe YAML (as for `lightning-accel fit`)")
    add_cli_options(parser)
    ns, overrides = parser.parse_known_args(args)
    try:
        options = config_from_cli(ns)
    except ValueError as err:
        parser.error(str(err))
    if not Path(ns.config).is_file():
        parser.error(f"recipe {ns.config!r} does not exist")
    try:
        tune(ns.config, overrides=overrides, options=options)
    except RuntimeError as err:  # the untuned recipe does not train
        log.error("%s", err)
        return 1
    return 0


def fit_with_ray(options: argparse.Namespace, args: list[str]) -> int:
    """``lightning-accel fit ... --ray.num_workers N``: the recipe on Ray Train workers; 0, or 1 with Ray's error."""
    try:
        result = fit_on_ray(args, **vars(options))
    except (ImportError, ValueError) as err:
        log.error("%s", err)
        return 2
    if result.error is not None:
        log.error("the Ray Train run failed after %d allowed restart(s): %s", options.max_failures, result.error)
        return 1
    log.info("Ray Train run finished: %s", {k: v for k, v in (result.metrics or {}).items() if "/" in k or k == "step"})
    log.info("newest checkpoint: %s", newest_checkpoint(result))
    return 0


# Every command, with one line each: `lightning-accel --help` and a mistyped command list them all.
COMMANDS = {
    "fit": "train a recipe (--config RECIPE.yaml; --ckpt_path auto resumes from the newest valid checkpoint; "
    "--ray.num_workers N runs it on Ray Train)",
    "validate": "validate a recipe's model (LightningCLI's)",
    "test": "test a recipe's model (LightningCLI's)",
    "predict": "predict with a recipe's model (LightningCLI's)",
    "profile": "train a short profiled window of a recipe, then run the doctor on it",
    "doctor": "rank what a run's goodput ledger and profile say to fix (RUN_DIR: a folder or a bucket URL)",
    "tune": "measure precision, compile, loader and batch settings on a recipe and write the fastest as a recipe",
    "torchrun": "torchrun with restarts that resume (exit 75 preempted, 76 hang): torchrun ARGS fit --config ...",
}


def overview() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name.ljust(width)}  {what}" for name, what in COMMANDS.items())
    return (
        "usage: lightning-accel COMMAND [ARGS]   (lightning-accel COMMAND --help for a command's options)\n\n"
        f"commands:\n{rows}\n"
    )


def _check_command(argv: list[str]) -> None:
    """``--help`` (or nothing): every command; a mistyped command: one line with a did-you-mean, exit 2."""
    if not argv or argv[0] in ("-h", "--help"):
        print(overview(), end="")
        raise SystemExit(0 if argv else 2)
    if argv[0] not in COMMANDS:
        close = difflib.get_close_matches(argv[0], list(COMMANDS), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        print(f"lightning-accel: unknown command {argv[0]!r}.{hint}\n\n{overview()}", end="", file=sys.stderr)
        raise SystemExit(2)


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``lightning-accel`` console script."""
    argv = sys.argv[1:] if args is None else args
    _check_command(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    defer_to_root()  # our lines in the format above
    quiet_known_deprecations()  # dependencies' warnings at each other: noise in our output, nothing to act on
    close_gloo_process_group_at_exit()  # our program: safe for stock strategies on gloo too
    commands = {"doctor": doctor, "profile": profile, "tune": tune_command}
    if argv and argv[0] in commands:
        raise SystemExit(commands[argv[0]](argv[1:]))
    if argv and argv[0] == "torchrun":
        exit_launcher(torchrun(argv[1:]))
    ray_options, rest = split_ray_args(argv[1:]) if argv and argv[0] == "fit" else (None, argv)
    if ray_options is not None:
        raise SystemExit(fit_with_ray(ray_options, rest))
    # LightningCLI reads sys.argv itself when given no args (given both, it warns that they differ)
    build_cli(None if args is None else argv)


if __name__ == "__main__":
    main()
