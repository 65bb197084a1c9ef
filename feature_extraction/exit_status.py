"""One exit-status convention for the commands that are not Lightning's (extraction, evaluate, export, demo).

docs/design.md ("Contracts"): 0 success; 2 bad input, one ``error:`` line on stderr saying what is wrong and how
to fix it (as argparse does); 1 a runtime failure (disk full, a held lock), also one line;
130 Ctrl-C and 143 SIGTERM (``docker stop``, ``timeout``, a cluster's kill), one line saying
what was kept. A full disk (or quota), wherever it happens and however a library wraps it, is one
line too: ``error: no space left on device writing PATH; kept: ...; free space and rerun the same
command``, exit 1 (``atomic_files.disk_full_line``). Errors the product raises for bad input are
``ValueError`` s whose message names the file or flag and the fix; runtime failures are
``OSError`` / ``RuntimeError``. Anything else is a bug and keeps its traceback. ``SAE_PIPELINE_TRACEBACK=1`` shows the
traceback of every error instead of the line.

SIGTERM is turned into ``Terminated`` (a ``KeyboardInterrupt``), so the cleanup that Ctrl-C
runs (``finally`` blocks, the shard writers' abort, temporary files removed) runs for it too.
Both also set the stop flag (``stop_flag``): a wait in another thread or a forked worker (an upload
retrying a store that has died) ends as well, and the ``Stopped`` it raises is the same stop, whose
line then names the store that was not answering.
The Lightning commands stop with :class:`Interrupted` instead (``sae_pipeline.training.interrupts``: a
``SystemExit``, because Lightning turns a ``KeyboardInterrupt`` into exit 1); :func:`run_command`
treats it as the interruption it is.

Every such command is a jsonargparse parser (as LightningCLI's ``fit`` is) run by :func:`run_cli`,
the one wrapper: a flag error is the same one line and exit 2 as a bad value found later
(jsonargparse's own would print the usage, a tip and the error), then the command runs under
:func:`run_command`. ``python -m sae_pipeline``'s dispatcher prints its errors with
:func:`error_line` too.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from feature_extraction import stop_flag
from feature_extraction.atomic_files import disk_full_line, quiet_thread_disk_full
from feature_extraction.file_checks import terminal_text

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_INTERRUPTED",
    "EXIT_RUNTIME",
    "EXIT_TERMINATED",
    "Interrupted",
    "Terminated",
    "error_line",
    "flag_error",
    "interrupted_head",
    "one_line",
    "run_cli",
    "run_command",
]

EXIT_RUNTIME = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM received; a KeyboardInterrupt so that every Ctrl-C cleanup path runs for it too."""


class Interrupted(SystemExit):
    """A command stopped by SIGINT / SIGTERM: exits ``128 + signum``.

    A ``SystemExit`` so that Lightning runs its exception hooks (temporary files removed) and then
    lets it through, and so that ``except Exception`` cleanup code does not swallow it.
    ``detail`` says what was kept and how to rerun (set by whoever knows: the command catching it
    fills it in when empty); ``announce`` is False on the DDP ranks that must not print it too.
    """

    def __init__(self, signum: int, detail: str = "", announce: bool = True) -> None:
        super().__init__(128 + int(signum))
        self.signum, self.detail, self.announce = int(signum), detail, announce

    def line(self, default: str = "") -> str:
        """The one line printed for it: ``interrupted (Ctrl-C): ...`` or ``terminated (SIGTERM): ...``."""
        return f"{interrupted_head(self.signum)}: {self.detail or default}"


def interrupted_head(signum: int) -> str:
    return "terminated (SIGTERM)" if signum == signal.SIGTERM else "interrupted (Ctrl-C)"


_TERMINATED: list[int] = []  # SIGTERM seen by this process


def _raise_terminated(signum: int, frame: Any) -> None:  # noqa: ARG001 (signal handler signature)
    _TERMINATED.append(signum)
    stop_flag.request(signum)  # the waits of other threads and of forked workers end too
    raise Terminated()


def _raise_keyboard_interrupt(signum: int, frame: Any) -> None:  # noqa: ARG001 (signal handler signature)
    stop_flag.request(signum)
    raise KeyboardInterrupt


def _stop_line(signum: int, interrupted: str) -> int:
    """Print the one stop line (with the store that was not answering, if one was) and return 128 + signal."""
    note = stop_flag.unanswered()
    detail = f"{interrupted}; {note}" if note else interrupted
    if signum == signal.SIGTERM:
        print(f"terminated (SIGTERM): {detail}", file=sys.stderr)
        return EXIT_TERMINATED
    print(f"\ninterrupted (Ctrl-C): {detail}", file=sys.stderr)
    return EXIT_INTERRUPTED


def one_line(error: BaseException) -> str:
    """The error's message on one line (whitespace collapsed, control characters escaped: it may quote a file);
    its type name when it has none."""
    return terminal_text(" ".join(str(error).split()), limit=None) or type(error).__name__


def error_line(error: BaseException, error_type: bool = False) -> str:
    """``error: [Type: ]message`` on one line, as every command prints its one error line."""
    return f"error: {type(error).__name__ + ': ' if error_type else ''}{one_line(error)}"


def flag_error(error: argparse.ArgumentError, subcommands: Sequence[str] = ()) -> str:
    """A jsonargparse parse error on one line, naming flags as typed (``--k``, not ``Parser key "inference.k"``)."""

    def flag(key: str) -> str:
        head, _, rest = key.partition(".")
        return "--" + (rest if head in subcommands and rest else key)

    message = re.sub(r'Parser key "([^"]+)"', lambda m: flag(m.group(1)), one_line(error))
    required = re.match(r"(the following arguments are required: )(.*)", message)
    if required:
        names = [name.strip() for name in required.group(2).split(",")]
        message = required.group(1) + ", ".join(name if name.startswith("-") else flag(name) for name in names)
    return message


def run_cli(
    parser: Any,
    argv: Sequence[str],
    command: Callable[[Any], Any],
    *,
    interrupted: str | Callable[[Any], str],
    error_type: bool = False,
    kept: str | Callable[[Any], str] | None = None,
) -> tuple[int, Any]:
    """Parse ``argv`` with ``parser`` (jsonargparse, ``exit_on_error=False``), then run ``command(config)``.

    A flag error prints one ``error: ... (see PROG --help)`` line and returns exit status 2 before
    anything runs; ``--help`` and ``--print_config`` exit 0 as usual. The rest is
    :func:`run_command`'s; ``interrupted`` and ``kept`` may be functions of the parsed config (they
    name what was kept, e.g. the ``--out`` folder).
    """
    subcommands = [
        name for action in parser._actions if isinstance(action, argparse._SubParsersAction) for name in action.choices
    ]
    try:
        config = parser.parse_args(list(argv))
    except argparse.ArgumentError as error:
        if os.environ.get("SAE_PIPELINE_TRACEBACK"):
            raise
        print(f"error: {flag_error(error, subcommands)} (see {parser.prog} --help)", file=sys.stderr)
        return EXIT_BAD_INPUT, None
    kept_interrupted = interrupted(config) if callable(interrupted) else interrupted
    kept_disk_full = kept(config) if callable(kept) else kept
    return run_command(
        lambda: command(config), interrupted=kept_interrupted, error_type=error_type, kept=kept_disk_full
    )


def run_command(
    function: Callable[[], Any], *, interrupted: str, error_type: bool = False, kept: str | None = None
) -> tuple[int, Any]:
    """Run ``function()`` under the convention; returns ``(exit status, result or None)``.

    ``interrupted`` says what an interruption leaves (e.g. "finished shards are kept; rerun
    the same command to resume"), printed after ``interrupted (Ctrl-C):``. ``error_type``:
    lines read ``error: ExportError: ...``, as ``python -m sae_pipeline``'s own commands print them.
    ``kept``: what a full disk leaves, for the ``kept:`` part of its line when the error itself does
    not say (``atomic_files.DiskFullError.kept``).
    """
    previous = previous_int = None
    _TERMINATED.clear()
    stop_flag.reset()
    threading.excepthook = quiet_thread_disk_full
    try:
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not ignored, not a Lightning command's
            previous_int = signal.signal(signal.SIGINT, _raise_keyboard_interrupt)
    except ValueError:  # not the main thread: leave SIGTERM alone
        pass
    try:
        return 0, function()
    except Interrupted as stop:  # a Lightning stage inside the command (evaluate's training runs)
        if stop.announce:
            print(f"{interrupted_head(stop.signum)}: {interrupted}", file=sys.stderr)
        return int(stop.code), None
    except Terminated:
        return _stop_line(signal.SIGTERM, interrupted), None
    except KeyboardInterrupt:
        return _stop_line(signal.SIGINT, interrupted), None
    except stop_flag.Stopped as stopped:  # a wait of this thread cut short by a stop (stop_flag)
        return _stop_line(stopped.signum, interrupted), None
    except (ValueError, OSError, RuntimeError) as error:
        # a stop, then an error it caused: a helper process (DataLoader worker) died of a SIGTERM to the whole group
        signum = stop_flag.requested() or (signal.SIGTERM if _TERMINATED else 0)
        if signum:
            return _stop_line(signum, interrupted), None
        if os.environ.get("SAE_PIPELINE_TRACEBACK"):
            raise
        disk_full = disk_full_line(error, kept)
        if disk_full:
            print(disk_full, file=sys.stderr)
            return EXIT_RUNTIME, None
        print(error_line(error, error_type), file=sys.stderr)
        return (EXIT_BAD_INPUT if isinstance(error, ValueError) else EXIT_RUNTIME), None
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if previous_int is not None:
            signal.signal(signal.SIGINT, previous_int)
