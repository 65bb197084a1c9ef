"""SIGTERM and Ctrl-C during ``fit``: save a resumable checkpoint at a step boundary, then exit 143 / 130.

``docker stop``, ``timeout``, a cluster's kill and Kubernetes send SIGTERM and wait a grace period
before SIGKILL; Ctrl-C sends SIGINT. Lightning's own SIGTERM handling exits with status 0 and no
checkpoint, and its handler runs a collective inside the signal handler (see
:func:`sae_pipeline.training.lightning_compat.mute_sigterm_notifier`); Python's SIGINT raises
``KeyboardInterrupt`` wherever the interpreter is, which Lightning turns into exit 1, again
without a checkpoint.

:class:`Interrupts` replaces both for the duration of ``fit``: the handler only records the
signal. After each training batch (and each validation pass) the ranks all-reduce what they
received (one small all-reduce per step under DDP, none in a single process), so a signal that
reached one rank stops every rank at the same step. Then they save ``last.ckpt`` together
(:func:`sae_pipeline.training.checkpointing.save_final_checkpoint`: atomic, with the optimiser, schedule,
dead-latent clock and data position), rank 0 prints where, and every rank exits with
``128 + signal`` (143 for SIGTERM, 130 for SIGINT), the shell convention. ``fit --ckpt_path last``
continues from it. A second Ctrl-C while waiting for the step boundary stops at once, without
saving (``KeyboardInterrupt``). DataLoader workers are forked with this handler, so a terminal's Ctrl-C
(sent to the whole process group) does not end their loop with ``KeyboardInterrupt`` (the next
batch would then fail before the checkpoint is saved); there the handler does nothing at all.

SLURM's requeue signal (SIGUSR1) stays with :mod:`sae_pipeline.training.requeue`.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

import lightning as L
from torch.utils.data import get_worker_info

from sae_pipeline.training import lightning_compat
from sae_pipeline.training.checkpointing import save_final_checkpoint
from sae_pipeline.training.step_boundary import StepBoundaryCallback, max_over_ranks

HANDLED = (signal.SIGTERM, signal.SIGINT)


class Interrupts(StepBoundaryCallback):
    """Turn SIGTERM / SIGINT during ``fit`` into "checkpoint at the next step boundary, exit 128 + signal"."""

    def __init__(self) -> None:
        self.received = 0  # the signal number recorded by the handler, 0 for none
        self._armed = False
        self._previous: dict[int, Any] = {}
        self._rank = 0

    # --- the handler --------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: Any) -> None:
        if get_worker_info() is not None:
            return  # a DataLoader worker (forked with this handler): the main process stops the run
        if not self._armed:  # outside fit (Lightning's teardown may reinstate us): behave as before
            _call_previous(self._previous.get(signum, signal.SIG_DFL), signum, frame)
            return
        if self.received and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without the checkpoint
        if not self.received:
            self.received = signum
            if self._rank == 0:  # os.write: print() is not safe inside a signal handler
                name = signal.Signals(signum).name
                again = " (Ctrl-C again stops without saving)" if signum == signal.SIGINT else ""
                os.write(2, f"\n{name} received: saving a checkpoint after this training step, then exiting"
                            f"{again}\n".encode())

    # --- Lightning hooks -----------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit" or threading.current_thread() is not threading.main_thread():
            return
        self.received, self._rank = 0, trainer.global_rank
        lightning_compat.mute_sigterm_notifier(trainer)
        for signum in HANDLED:
            previous = signal.signal(signum, self._on_signal)
            if previous is not self._on_signal and getattr(previous, "__self__", None) is not self:
                self._previous[signum] = previous
        self._armed = True

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._disarm()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._disarm()

    # --- the stop ------------------------------------------------------------------------------
    def _disarm(self) -> None:
        if not self._armed:
            return
        self._armed = False
        if threading.current_thread() is threading.main_thread():
            for signum in HANDLED:
                signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))

    def _check(self, trainer: L.Trainer) -> None:
        if not self._armed:
            return
        signum = max_over_ranks(trainer, self.received)  # SIGTERM (15) wins over SIGINT (2); 0 for none
        if not signum:
            return
        for logger in trainer.loggers:
            logger.save()  # flush the metrics logged so far
        fpath = save_final_checkpoint(trainer)
        if trainer.is_global_zero:
            print(f"{signal.Signals(signum).name}: saved {fpath} at global step {trainer.global_step}; continue "
                  "with the same command and --ckpt_path last", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)


def _call_previous(previous: Any, signum: int, frame: Any) -> None:
    """What the handler we replaced would have done."""
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
