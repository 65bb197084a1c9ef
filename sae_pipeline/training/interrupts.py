"""SIGTERM and Ctrl-C, one way for every command: stop within seconds, exit 143 / 130, say how to rerun.

``docker stop``, ``timeout``, a cluster's kill (SLURM pre-emption) and Kubernetes send SIGTERM and
wait a grace period before SIGKILL; Ctrl-C sends SIGINT. Left to themselves, Lightning's SIGTERM
handling lets ``validate``/``test``/``predict`` run to the end with exit 0 (and runs a collective
inside the signal handler, see :func:`sae_pipeline.training.lightning_compat.mute_sigterm_notifier`), and
Lightning turns Python's ``KeyboardInterrupt`` into "Detected KeyboardInterrupt" and exit 1.

One handler (:data:`HANDLER`) replaces both, installed for the whole of ``python -m sae_pipeline``
(:func:`stop_signals`) and by the :class:`Interrupts` callback of any Trainer started elsewhere:

- **Anything but training** (``predict`` writing codes, ``validate``/``test``, the ``features`` pass
  and its site writing, loading and set-up): the handler raises :class:`Interrupted`, a
  ``SystemExit`` with code ``128 + signal``, where the program is. Cleanup runs on the way out
  (the codes file is written under a temporary name and removed, the site is built in a staging
  folder and removed, the previous codes file or site stays as it was), and the command prints one
  line, ``interrupted (Ctrl-C): ...`` or ``terminated (SIGTERM): ...``, saying what was kept and
  to rerun the same command. Under a DDP launch rank 0 forwards the signal to the ranks it started.
  An exception raised by a signal handler is lost when it lands in a ``__del__`` or weakref
  callback ("Exception ignored in ..."), so the stop is also sticky: every later batch of a
  stage, and each page of the features site, raises it again (:func:`raise_if_interrupted`).
  Steps that must not be cut in half (the swap of a features site into ``--out``) run in
  `stops_held`: the stop waits for their end, whichever thread the signal lands in.
- **During ``fit``**: the handler only records the signal. After each training batch (and each
  validation pass) the ranks all-reduce what they received (one small all-reduce per step under
  DDP, none in a single process), so a signal that reached one rank stops every rank at the same
  step. They save ``last.ckpt`` together (:func:`sae_pipeline.training.checkpointing.save_final_checkpoint`:
  atomic, with the optimiser, schedule, dead-latent clock and data position), and exit 143 / 130
  with ``... saved FILE at global step N; continue with the same command and --ckpt_path last``.
  A second Ctrl-C while waiting for (or during) that save stops at once with one line; the save in
  progress is abandoned (its hidden partial file removed) and the previous checkpoint stays intact.
  The save is whole or absent (written to a hidden file, renamed into place), and the last line is
  read from the run's checkpoint folder when it is written (`stop_detail`), not from how far
  the save got: a second Ctrl-C just after the rename, or during Lightning's teardown, still says
  "saved FILE at global step N"; one that abandoned the save names the checkpoint kept and its step.

Both cases also set the stop flag (`feature_extraction.stop_flag`), shared with the DataLoader workers:
a wait the stop would otherwise sit out (a worker or the main thread retrying a store that has died,
the ``--data.cache`` fill) ends at once with ``Stopped``, which :func:`interruption` takes for the stop.
In ``fit`` the save at the step boundary then never comes: the line says which checkpoint is kept
(`stop_detail`), within seconds rather than after the store's retry window.

DataLoader workers are forked with this handler, so a terminal's Ctrl-C (sent to the whole process
group) does not end their loop; there the handler does nothing and the main process stops the run.
SLURM's requeue signal (SIGUSR1) stays with :mod:`sae_pipeline.training.requeue`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

import lightning as L
from torch.utils.data import get_worker_info

from feature_extraction import stop_flag
from feature_extraction.exit_status import Interrupted
from sae_pipeline.training import lightning_compat
from sae_pipeline.training.checkpointing import (
    final_checkpoint_dir,
    newest_whole_checkpoint,
    resume_flag,
    save_final_checkpoint,
)
from sae_pipeline.training.step_boundary import StepBoundaryCallback, max_over_ranks

__all__ = [
    "HANDLED",
    "HANDLER",
    "Interrupted",
    "Interrupts",
    "interruption",
    "raise_if_interrupted",
    "stop_signals",
    "stops_held",
]

HANDLED = (signal.SIGTERM, signal.SIGINT)
RESUME_HINT = "continue with the same command and --ckpt_path last"


class _Handler:
    """The one SIGTERM / SIGINT handler of the process (see the module docstring)."""

    def __init__(self) -> None:
        self.users = 0  # stop_signals() and armed Interrupts callbacks; installed while > 0
        self.previous: dict[int, Any] = {}
        self.training: Interrupts | None = None  # the callback of a fit in progress: stop at a step boundary
        self.launcher: Any = None  # rank 0 of a Lightning DDP launch: forwards the signal to the other ranks
        self.rank = 0
        self.previous_unraisable_hook = sys.unraisablehook
        self.pending = 0  # the signal of a stop already raised (raised again at the next check)
        self.held = 0  # depth of stops_held() blocks: a signal then waits for the block's end
        self.deferred = 0  # the signal that arrived inside such a block
        self.fit: L.Trainer | None = None  # the Trainer of a fit begun here: its stop's line reads its checkpoints
        self.reporting = False  # the stop is decided and its line is being written: later signals change nothing

    def __call__(self, signum: int, frame: Any) -> None:
        if get_worker_info() is not None:
            return  # a DataLoader worker (forked with this handler): the main process stops the run
        if self.users == 0:  # reinstated after we let go (Lightning's teardown restores what it found)
            _call_previous(self.previous.get(signum, signal.SIG_DFL), signum, frame)
            return
        if self.held:
            self.deferred = self.deferred or signum
            return
        if self.reporting:
            return
        if self.training is not None:
            self.training.record(signum)
            return
        self.stop(signum)

    def stop(self, signum: int) -> None:
        """Raise the stop (rank 0 of a DDP launch first forwards the signal to the ranks it started)."""
        launcher, self.launcher = self.launcher, None
        if launcher is not None and hasattr(launcher, "kill"):
            launcher.kill(signum)
        self.pending = self.pending or signum
        stop_flag.request(signum)
        raise Interrupted(signum, announce=self.rank == 0)

    def acquire(self) -> bool:
        """Install the handler (main thread only); False where signals cannot be handled here."""
        if threading.current_thread() is not threading.main_thread():
            return False
        if self.users == 0:
            self.pending, self.deferred, self.fit, self.reporting = 0, 0, None, False
            stop_flag.reset()  # before any DataLoader worker forks: they share it
            self.previous_unraisable_hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
            for signum in HANDLED:
                previous = signal.signal(signum, self)
                if previous is not self:
                    self.previous[signum] = previous
        self.users += 1
        return True

    def release(self) -> None:
        self.users -= 1
        if self.users == 0:
            self.training, self.launcher, self.rank, self.fit, self.reporting = None, None, 0, None, False
            sys.unraisablehook = self.previous_unraisable_hook
            for signum in HANDLED:
                signal.signal(signum, self.previous.get(signum, signal.SIG_DFL))

    def report(self, stop: Interrupted) -> None:
        """Put what a stopped fit left on disk in ``stop``'s line (see `stop_detail`); once it is read, more
        signals are ignored."""
        if self.fit is None or not stop.announce:
            return
        self.reporting = True
        with contextlib.suppress(OSError):  # the line the stop was raised with stays
            stop.detail = stop_detail(self.fit)

    def _unraisable(self, unraisable: Any) -> None:
        """Our stop, lost in a ``__del__``: no "Exception ignored" traceback (the next check raises it again)."""
        if not isinstance(unraisable.exc_value, Interrupted):
            self.previous_unraisable_hook(unraisable)


HANDLER = _Handler()


def raise_if_interrupted() -> None:
    """Raise the stop a signal asked for, if the handler's own raise was lost (see the module docstring)."""
    if HANDLER.pending and HANDLER.users:
        raise Interrupted(HANDLER.pending, announce=HANDLER.rank == 0)


def interruption(exn: BaseException) -> Interrupted | None:
    """The stop a signal asked for, whatever exception it surfaced as; None if no signal came.

    The handler raises where the program is. A library caught half-way through an update can then
    fail in its own cleanup (Rich's progress bar, stopped between creating and starting its refresh
    thread, raises "cannot join thread before it is started"), and that error replaces ours: the
    command must still exit 128 + signal with its one line, not 1 with a traceback.
    """
    if isinstance(exn, Interrupted):
        return exn
    signum = HANDLER.pending or (exn.signum if isinstance(exn, stop_flag.Stopped) else stop_flag.requested())
    if signum and HANDLER.users:  # a wait cut short by the stop (stop_flag), or an error on the way out of one
        return Interrupted(signum, announce=HANDLER.rank == 0)
    return None


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """SIGTERM / Ctrl-C raise :class:`Interrupted` in this block (fit defers it to a step boundary)."""
    installed = HANDLER.acquire()
    try:
        yield
    except Interrupted as stop:
        if installed:
            HANDLER.report(stop)
        raise
    except Exception as exn:  # an error on the way out of a stop is the stop (see interruption)
        stop = interruption(exn) if installed else None
        if stop is None:
            raise
        HANDLER.report(stop)
        raise stop from exn
    finally:
        if installed:
            HANDLER.release()


@contextlib.contextmanager
def stops_held() -> Iterator[None]:
    """SIGTERM / Ctrl-C wait for the end of the block, then stop as usual: for steps that must not be cut in half.

    ``pthread_sigmask`` blocks the signals for this thread only: another thread (Rich's refresh
    thread, a loader's) still receives them, and Python then runs the handler here, in the main
    thread, at the next bytecode, wherever the block is. So the handler itself waits too while a
    block is open (`_Handler.held`), and the stop is raised when the last block ends (or
    left pending for `interruption` when the block raises). The mask spares the block's
    system calls the interruption, and holds the signals where our handler is not installed.
    """
    main = threading.current_thread() is threading.main_thread()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED) if main else None
    HANDLER.held += 1
    signum = 0
    try:
        yield
    finally:
        if blocked is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)  # a signal blocked until now is handled here: held
        HANDLER.held -= 1
        if not HANDLER.held:
            signum, HANDLER.deferred = HANDLER.deferred, 0
            HANDLER.pending = HANDLER.pending or signum
    if signum and HANDLER.users:
        HANDLER.stop(signum)


class Interrupts(StepBoundaryCallback):
    """SIGTERM / SIGINT in any Trainer stage: ``fit`` saves at the next step boundary and exits 128 + signal;
    the other stages stop at once (see the module docstring)."""

    def __init__(self) -> None:
        self.received = 0  # the signal number recorded during fit, 0 for none
        self._armed = False
        self._rank = 0

    # --- Lightning hooks -----------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._armed or not HANDLER.acquire():
            return
        self._armed = True
        self.received, self._rank = 0, trainer.global_rank
        lightning_compat.mute_sigterm_notifier(trainer)
        HANDLER.rank = trainer.global_rank
        if stage == "fit":
            HANDLER.training, HANDLER.fit = self, trainer
        else:
            HANDLER.launcher = trainer.strategy.launcher if trainer.global_rank == 0 else None

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._disarm()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._disarm()

    def on_validation_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        raise_if_interrupted()

    def on_test_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        raise_if_interrupted()

    def on_predict_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        raise_if_interrupted()

    def _disarm(self) -> None:
        if not self._armed:
            return
        self._armed = False
        if HANDLER.training is self:
            HANDLER.training = None
        HANDLER.launcher = None
        HANDLER.release()

    # --- fit: record, then stop at the step boundary ---------------------------------------------
    def record(self, signum: int) -> None:
        """Called by the handler during fit (signal-handler context: no printing but ``os.write``)."""
        if self.received and signum == signal.SIGINT:  # a second Ctrl-C: stop now, the save abandoned if unfinished
            raise Interrupted(signum, announce=self._rank == 0)  # its line is read from the disk (stop_detail)
        if not self.received:
            self.received = signum
            stop_flag.request(signum)  # the step boundary saves; a wait that would hold it up ends (stop_flag)
            if self._rank == 0:
                name = signal.Signals(signum).name
                again = " (Ctrl-C again stops without saving)" if signum == signal.SIGINT else ""
                os.write(
                    2,
                    f"\n{name} received: saving a checkpoint after this training step, then exiting{again}\n".encode(),
                )

    def _check(self, trainer: L.Trainer) -> None:
        if not self._armed or HANDLER.training is not self:
            return
        signum = max_over_ranks(trainer, self.received)  # SIGTERM (15) wins over SIGINT (2); 0 for none
        if not signum:
            return
        for logger in trainer.loggers:
            logger.save()  # flush the metrics logged so far
        fpath = save_final_checkpoint(trainer)
        raise Interrupted(
            signum,
            f"saved {fpath} at global step {trainer.global_step}; {RESUME_HINT}",
            announce=trainer.is_global_zero,
        )


def stop_detail(trainer: L.Trainer) -> str:
    """What a stopped fit left, read from its checkpoint folder when the line is written.

    Not from how far the stop's save got: a second Ctrl-C can land anywhere, also after the save was renamed
    into place and before the line saying so was raised, or in Lightning's teardown after it. The save is
    whole or absent (``AtomicCheckpointIO``), so the newest checkpoint that reads whole is the truth: this
    step's state if it holds the trainer's global step, else the one kept from before.
    """
    dpath = final_checkpoint_dir(trainer)
    found = newest_whole_checkpoint(dpath)
    if found is None:
        return f"stopped without saving, no checkpoint in {dpath} yet; rerun the same command"
    fpath, step = found
    resume = f"continue with the same command and {resume_flag(fpath)}"
    if step == trainer.global_step:
        return f"saved {fpath} at global step {step}; {resume}"
    return f"stopped without saving; the previous checkpoint is kept: {fpath} (global step {step}); {resume}"


def _call_previous(previous: Any, signum: int, frame: Any) -> None:
    """What the handler we replaced would have done."""
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
