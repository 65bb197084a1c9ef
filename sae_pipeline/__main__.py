"""``python -m sae_pipeline COMMAND ...``: one entry point for every command (also the Docker image's).

``fit``, ``validate``, ``test`` and ``predict`` go to :class:`sae_pipeline.cli.SAECLI`
(LightningCLI); the other commands are listed in :data:`COMMANDS` (name -> module whose
``main(argv)`` runs it, and its one-line help), so adding a command is one line here.

Exit codes, the same for every command (docs/design.md): 0 success, 2 bad input (one ``error:``
line on stderr saying what is wrong and how to fix it), 130 / 143 interrupted (Ctrl-C /
SIGTERM; one ``interrupted (Ctrl-C): ...`` / ``terminated (SIGTERM): ...`` line saying what was
kept and how to rerun, :mod:`sae_pipeline.training.interrupts`), 1 anything unexpected. Errors the product raises for
bad input are ``ValueError`` s naming the file, field or flag and the fix, printed by
``feature_extraction.exit_status`` (whose ``run_cli`` runs every command that is not Lightning's); set
``SAE_PIPELINE_TRACEBACK=1`` to see the traceback instead. A full disk is one line and exit 1 in every
command: ``error: no space left on device writing PATH; kept: ...; free space and rerun the same
command`` (``feature_extraction.atomic_files.DiskFullError``); so is an object store that did not answer
for its whole retry window (``feature_extraction.store.StoreUnavailable``).

In a multi-process job (``srun``, torchrun) every rank usually hits the same bad input at the
same moment. Ranks other than 0 wait a few seconds before printing theirs: rank 0's exit
makes the launcher stop them (``srun --kill-on-bad-exit=1`` in ``slurm/train.sh``), so the
job log gets the line once; an error only one rank hits is still printed, a little later.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
import time

from feature_extraction import exit_status, stop_flag
from feature_extraction.atomic_files import disk_full_line, quiet_thread_disk_full
from feature_extraction.exit_status import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_RUNTIME, error_line
from feature_extraction.store.urls import StoreUnavailable

PROG = "python -m sae_pipeline"
PEER_ERROR_DELAY_S = 5.0
LIGHTNING_COMMANDS = {
    "fit": "train an SAE (--config configs/<variant>_<data>.yaml)",
    "validate": "R², L0, dead fraction of a trained SAE on the validation split (--ckpt_path)",
    "test": "the same metrics on the test split (--ckpt_path)",
    "predict": "write the sparse codes of a trained SAE to HDF5 (--ckpt_path)",
}
# What an interruption of a Lightning command leaves, when nothing more precise was said (fit's
# checkpoint line, predict's codes file: sae_pipeline.training.interrupts, sae_pipeline.training.predict).
INTERRUPTED = {
    "fit": "stopped before training began, nothing was saved; rerun the same command",
    "validate": "stopped before the metrics were complete, nothing was written; rerun the same command",
    "test": "stopped before the metrics were complete, nothing was written; rerun the same command",
    "predict": "no codes file was written; rerun the same command",
}
# Commands that handle SIGTERM / Ctrl-C themselves (feature_extraction.exit_status.run_cli).
OWN_SIGNALS = ("export", "extract", "evaluate")
# name -> (module with main(argv) -> int | None, help)
COMMANDS = {
    "export": ("sae_pipeline.artifacts.export", "export a checkpoint to sae.safetensors + config.json"),
    "extract": (
        "feature_extraction.__main__",
        "extract backbone token activations into shards (the flags of python -m feature_extraction)",
    ),
    "features": (
        "sae_pipeline.features.cli",
        "feature browser: top images and heatmaps per atom as a static site (--ckpt_path or --sae, --out DIR); "
        "`features explain`: the atoms of your own images",
    ),
    "evaluate": ("sae_pipeline.evaluate.__main__", "the paper's studies and reports (python -m sae_pipeline.evaluate)"),
}


def usage() -> str:
    width = max(map(len, [*LIGHTNING_COMMANDS, *COMMANDS]))
    lines = [f"usage: {PROG} COMMAND [options]   ({PROG} COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, text in LIGHTNING_COMMANDS.items()]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines)


def _rank() -> int:
    """This process's global rank in a multi-process launch (0 when alone)."""
    for name in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):  # LOCAL_RANK: the ranks Lightning's launcher starts
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def _run(args: list[str], argv: list[str] | None) -> int:
    if args[:1] in ([], ["-h"], ["--help"]):
        print(usage())
        return 0 if args else EXIT_BAD_INPUT
    if not args[0].startswith("-") and args[0] not in COMMANDS and args[0] not in LIGHTNING_COMMANDS:
        raise ValueError(
            f"unknown command {args[0]!r}; choose from {', '.join([*LIGHTNING_COMMANDS, *COMMANDS])} "
            f"(see {PROG} --help)"
        )
    if args[0] in OWN_SIGNALS:
        status = importlib.import_module(COMMANDS[args[0]][0]).main(args[1:])
        return status if isinstance(status, int) else 0
    _stop_early()
    try:
        # these load torch and Lightning (seconds)
        from sae_pipeline.training.interrupts import stop_signals
        from sae_pipeline.training.lightning_noise import quiet_lightning

        quiet_lightning()
        with stop_signals():
            if args[0] in COMMANDS:
                status = importlib.import_module(COMMANDS[args[0]][0]).main(args[1:])
                return status if isinstance(status, int) else 0
            from sae_pipeline.cli import cli_main

            cli_main(argv)  # None: LightningCLI reads sys.argv itself
            return 0
    except exit_status.Interrupted as stop:
        if stop.announce and _rank() == 0:
            print(stop.line(INTERRUPTED.get(args[0], "rerun the same command")), file=sys.stderr, flush=True)
        return int(stop.code)


def _raise_interrupted(signum: int, frame: object) -> None:
    stop_flag.request(signum)
    raise exit_status.Interrupted(signum)


def _stop_early() -> None:
    """SIGTERM / Ctrl-C stop with 143 / 130 while the modules load (then sae_pipeline.training.interrupts does)."""
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            if signal.getsignal(signum) in (signal.SIG_DFL, signal.default_int_handler):
                signal.signal(signum, _raise_interrupted)


def _error_exit(exn: Exception, status: int) -> int:
    """The error's one line and ``status``; a DDP peer's line comes after rank 0's, the one a user reads first."""
    if os.environ.get("SAE_PIPELINE_TRACEBACK"):
        raise exn
    if _rank() > 0:
        time.sleep(PEER_ERROR_DELAY_S)
    print(error_line(exn, error_type=True), file=sys.stderr)
    return status


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    threading.excepthook = quiet_thread_disk_full  # the main thread prints a full disk's one line
    try:
        return _run(args, argv)
    except KeyboardInterrupt:  # Ctrl-C outside training (fit saves and exits 130 itself: training/interrupts.py)
        print("interrupted (Ctrl-C): rerun the same command", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ValueError as exn:  # includes FloatingPointError subclasses of ValueError, ShardFormatError, ...
        return _error_exit(exn, EXIT_BAD_INPUT)
    except StoreUnavailable as exn:  # the store did not answer for its retry window: a runtime failure
        return _error_exit(exn, EXIT_RUNTIME)
    except (OSError, RuntimeError) as exn:  # a full disk in fit, predict or features; anything else is a bug
        line = disk_full_line(exn)
        if line is None or os.environ.get("SAE_PIPELINE_TRACEBACK"):
            raise
        print(line, file=sys.stderr)
        return EXIT_RUNTIME


if __name__ == "__main__":
    sys.exit(main())
