"""Recipes: the Trainer and LightningCLI that read them (``precision: auto-mixed``, ``--ckpt_path auto``).

Everything that builds a run from a recipe imports this module: the ``lightning-accel`` commands (``cli.py``),
``tune``'s trials and the launchers' workers (``launch/``). It never imports those.
"""

from __future__ import annotations

import difflib
import logging
import re
import sys
from pathlib import Path
from typing import Any, Literal, NoReturn

from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelSummary, ProgressBar, RichModelSummary
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.model_summary import get_formatted_model_size, get_human_readable_count
from rich.table import Table
from typing_extensions import override

from lightning_accel._compat import RICH_AVAILABLE, PrecisionInput, StepsProgressBar
from lightning_accel.checkpoint import PreemptionCheckpoint, find_resume_checkpoint, verify
from lightning_accel.monitor.summary import wide_console
from lightning_accel.precision import auto_precision
from lightning_accel.strategies import check_strategy_name, init_restart_safe_process_group
from lightning_accel.strategies.elastic import nodes_in_this_round

__all__ = ["AccelArgumentParser", "AccelCLI", "AccelTrainer", "CountedModelSummary", "build_cli", "one_line_error"]

log = logging.getLogger(__name__)


class CountedModelSummary(RichModelSummary):
    """Lightning's model summary, less its FLOPs column and total where it has nothing to show.

    Lightning counts FLOPs only for a module with ``example_input_array``; without one every row reads 0 and the
    total "Total FLOPs: 0", a few lines above the MFU GoodputMonitor measured. Here the FLOPs column and total are
    left out in that case, and a line says where the measured FLOPs are.
    """

    @staticmethod
    @override
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        if total_flops:
            RichModelSummary.summarize(
                summary_data,
                total_parameters,
                trainable_parameters,
                model_size,
                total_training_modes,
                total_flops,
                **summarize_kwargs,
            )
            return
        console = wide_console()
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        columns = [(name, values) for name, values in summary_data if name != "FLOPs"]
        for name, _ in columns:
            table.add_column(name or " ", justify="right" if name in ("Params", "Params per Device") else "left")
        for row in zip(*(values for _, values in columns), strict=True):
            table.add_row(*row)
        console.print(table)
        frozen = total_parameters - trainable_parameters
        console.print(
            f"Trainable params: {get_human_readable_count(trainable_parameters).strip()}, non-trainable: "
            f"{get_human_readable_count(frozen).strip()}, total: {get_human_readable_count(total_parameters).strip()} "
            f"({get_formatted_model_size(model_size)} MB); modules in train mode: {total_training_modes['train']}, "
            f"in eval mode: {total_training_modes['eval']}. FLOPs: measured per batch by GoodputMonitor "
            "(tflops_per_sec_per_device, mfu)"
        )


class AccelTrainer(Trainer):
    """``Trainer`` that also accepts ``precision="auto-mixed"`` (resolved by :func:`auto_precision`).

    Everything else is passed to :class:`lightning.pytorch.Trainer` unchanged.
    """

    def __init__(
        self, *args: Any, precision: PrecisionInput | Literal["auto-mixed"] | None = None, **kwargs: Any
    ) -> None:
        if precision is not None:  # "auto-mixed" is resolved; an explicit choice is checked against the hardware
            precision = auto_precision(precision, accelerator=str(kwargs.get("accelerator", "auto")))
        if isinstance(kwargs.get("strategy"), str):
            check_strategy_name(kwargs["strategy"])
        nodes = nodes_in_this_round()
        if nodes is not None and kwargs.get("num_nodes", 1) != nodes:
            # An elastic torchrun job (--nnodes MIN:MAX) has as many nodes as its current round: the recipe cannot
            # name them, and Lightning refuses a num_nodes x devices that is not the world size.
            log.info(
                "num_nodes=%s in the recipe; torchrun's rendezvous round has %d node(s): using %d",
                kwargs.get("num_nodes", 1),
                nodes,
                nodes,
            )
            kwargs["num_nodes"] = nodes
        callbacks = kwargs.get("callbacks") or []
        callbacks = [callbacks] if isinstance(callbacks, Callback) else list(callbacks)
        wants_bar = kwargs.get("enable_progress_bar", True) is not False
        if wants_bar and RICH_AVAILABLE and not any(isinstance(c, ProgressBar) for c in callbacks):
            callbacks = [*callbacks, StepsProgressBar()]  # Lightning's default bar, without "Epoch 0/-2"
        wants_summary = kwargs.get("enable_model_summary", True) is not False
        if wants_summary and RICH_AVAILABLE and not any(isinstance(c, ModelSummary) for c in callbacks):
            callbacks = [*callbacks, CountedModelSummary()]  # no column of zeros where no FLOPs were counted
            kwargs["enable_model_summary"] = False  # ours is the summary (else Lightning logs that it adds none)
        kwargs["callbacks"] = callbacks
        super().__init__(*args, precision=precision, **kwargs)

    @override
    def fit(
        self,
        model: LightningModule,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        datamodule: LightningDataModule | None = None,
        ckpt_path: str | Path | None = None,
        weights_only: bool | None = None,
    ) -> None:
        """Runs the full optimization routine (Lightning's ``Trainer.fit``, unchanged).

        Args:
            model: The LightningModule to train.
            train_dataloaders: Train dataloaders, or a LightningDataModule.
            val_dataloaders: Validation dataloaders.
            datamodule: A LightningDataModule.
            ckpt_path: The checkpoint to resume from: a path or URL; or ``auto`` (lightning-accel's CLI): the newest
                valid checkpoint in the PreemptionCheckpoint folder (a bucket URL too), or a fresh start when there is
                none, so the same command resumes after every restart. Lightning's ``last``, ``hpc`` and ``registry``
                keep their meaning.
            weights_only: Passed to ``torch.load`` when the checkpoint is read.
        """
        super().fit(model, train_dataloaders, val_dataloaders, datamodule, ckpt_path, weights_only)


def one_line_error(message: str) -> str:
    """A parser's error as one line naming the bad value, its choices and the closest one (jsonargparse writes a
    union's every type on its own line; Lightning lists the names it knows)."""
    key, given = re.match(r'Parser key "([^"]+)":', message), re.search(r"Given value: (.*)", message)
    choices = [c for group in re.findall(r"Literal\[([^\]]*)\]", message) for c in re.findall(r"'([^']*)'", group)]
    choices = list(dict.fromkeys(choices))  # a union repeats a Literal: each choice once
    if key and given and choices:
        value = given.group(1).strip()
        return f"--{key.group(1)} {value!r} is not one of: {', '.join(choices)}.{_did_you_mean(value, choices)}"
    if key and "File does not exist" in message:  # a recipe path: name the recipes beside it
        missing = Path(message.split("File does not exist:", 1)[1].strip().strip("'\""))
        near = sorted(p.name for p in missing.parent.glob("*.y*ml")) if missing.parent.is_dir() else []
        return f"--{key.group(1)}: File does not exist: {missing}.{_did_you_mean(missing.name, near)}"
    accelerator = re.search(r"accelerator='([^']*)'`. Available names are: ([\w, ]+)", message)
    if accelerator:  # Lightning takes "gpu" too, although its list does not name it
        names = [*accelerator.group(2).split(", "), "gpu"]
        return message.strip().splitlines()[0] + _did_you_mean(accelerator.group(1), names)
    return " ".join(line.strip() for line in message.strip().splitlines()[:2])


def _did_you_mean(value: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(value, choices, n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


class AccelArgumentParser(LightningArgumentParser):
    """LightningCLI's parser, whose errors are one line naming the bad value and the fix, not a 50-line usage."""

    @override
    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:  # jsonargparse trying a value internally: it catches this
            super().error(message, ex)
        prog = (getattr(ex, "subcommand_parser", None) or self).prog.replace(" [options]", "")
        sys.stderr.write(f"{prog}: error: {one_line_error(message)}\n({prog} --help lists every option)\n")
        raise SystemExit(2)


class AccelCLI(LightningCLI):
    """LightningCLI whose ``fit --ckpt_path auto`` resumes from the newest valid checkpoint, and which verifies an
    explicit ``--ckpt_path`` before anything unpickles it."""

    @override
    def parse_arguments(self, parser: Any, args: Any) -> None:
        super().parse_arguments(parser, args)
        # LightningCLI reads a ckpt_path's hyperparameters (torch.load) right after parsing: a corrupt file would
        # fail deep inside torch, with advice to unpickle it with weights_only=False. Ours checks it first.
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if ckpt_path and ckpt_path != "auto" and Path(ckpt_path).is_file() and not (verdict := verify(ckpt_path)):
            parser.error(
                f"--ckpt_path {ckpt_path} is not a usable checkpoint: {verdict.reason}. Use an earlier checkpoint, or "
                "--ckpt_path auto to resume from the newest valid one in the PreemptionCheckpoint folder"
            )

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        try:
            return super().instantiate_trainer(**kwargs)
        except ValueError as err:  # a bad precision/strategy value: report it like any other config error
            self.parser.error(f"invalid trainer configuration: {err}")

    def before_fit(self) -> None:
        if isinstance(self.trainer.strategy, ParallelStrategy):
            # stock strategies too: a group that survives torchrun restarts
            init_restart_safe_process_group(self.trainer.strategy)
        cfg = self.config[self.subcommand]
        if cfg.get("ckpt_path") != "auto":
            return
        cb = next((c for c in self.trainer.callbacks if isinstance(c, PreemptionCheckpoint)), None)
        if cb is None:
            self.parser.error("--ckpt_path auto needs a PreemptionCheckpoint callback (it names the folder to search)")
        # LightningCLI has replaced `true` by the seed it set; false (or none) means nothing was seeded
        seed = self.config[self.subcommand].get("seed_everything")
        if seed is None or seed is False:
            rank_zero_warn(
                f"--ckpt_path auto with seed_everything={seed}: nothing is seeded, so every attempt starts from other "
                "random states (NumPy's and Python's come from the OS): a fresh start is not reproducible and a "
                "resumed run is not the run it continues. Set an integer seed: `seed_everything: 0` in the recipe, or "
                "--seed_everything 0."
            )
        found = find_resume_checkpoint(cb.dirpath)
        log.info("ckpt_path=auto: %s", f"resuming from {found}" if found else "no valid checkpoint, starting fresh")
        cfg["ckpt_path"] = found
        self.config_init[self.subcommand]["ckpt_path"] = found


def build_cli(args: list[str] | None = None, run: bool = True, cli_class: type[AccelCLI] | None = None) -> AccelCLI:
    """Parse ``args`` (default: ``sys.argv``), build the objects and run the subcommand (``run=False``: only build;
    ``args`` then has no subcommand). ``cli_class``: a subclass of :class:`AccelCLI` (Ray's workers use one)."""
    return (cli_class or AccelCLI)(
        LightningModule,
        LightningDataModule,
        trainer_class=AccelTrainer,
        parser_class=AccelArgumentParser,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
        auto_configure_optimizers=False,
    )
