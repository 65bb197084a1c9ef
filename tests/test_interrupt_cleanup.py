"""A signal stays the stop even when a library's cleanup fails on the way out.

The SIGTERM / Ctrl-C handler raises where the program is (sae_pipeline.training.interrupts). A CI run
caught it inside Rich's progress bar start, between creating and starting its refresh thread; the
bar's ``stop()`` then raised "cannot join thread before it is started", which replaced the stop:
``features`` exited 1 with a traceback instead of 143 with its one line. These tests put the signal
exactly there, in-process, instead of waiting for the race. Another CI run caught a stop while extraction's
main process was taking a batch from a loader worker, whose resource sharer then printed the dropped
connection; the last test drops such a connection on purpose.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import lightning as L
import pytest
import rich.live
import torch
from torch.utils.data import DataLoader

from feature_extraction.exit_status import Interrupted
from sae_pipeline.features.cli import pass_progress_bar
from sae_pipeline.training.interrupts import HANDLER, Interrupts, interruption, stop_signals


class Doubler(L.LightningModule):
    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return 2 * batch


def signal_while_rich_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM arrives inside ``Live.start``: the handler raises there, as it did in CI."""
    original = rich.live.Live.start

    def start(self: rich.live.Live, refresh: bool = False) -> None:
        original(self, refresh)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(rich.live.Live, "start", start)


def test_the_features_bar_lets_a_stop_through_when_rich_was_caught_starting(monkeypatch: pytest.MonkeyPatch) -> None:
    signal_while_rich_starts(monkeypatch)
    trainer = L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[Interrupts(), pass_progress_bar()],
    )
    with pytest.raises(Interrupted) as info:  # the Interrupts callback installs the handler
        trainer.predict(Doubler(), DataLoader(torch.zeros(4, 3), batch_size=2))
    assert info.value.code == 128 + signal.SIGTERM
    assert HANDLER.users == 0  # the Interrupts callback let go of the handler


def test_an_error_raised_after_a_signal_exits_as_the_signal() -> None:
    with pytest.raises(Interrupted) as info, stop_signals():
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler raises Interrupted here
        finally:
            raise RuntimeError("cannot join thread before it is started")  # what the cleanup raised
    assert info.value.code == 128 + signal.SIGTERM
    assert isinstance(info.value.__cause__, RuntimeError)


def test_an_error_without_a_signal_is_left_as_it_is() -> None:
    with pytest.raises(RuntimeError, match="a real bug"), stop_signals():
        raise RuntimeError("a real bug")

    with pytest.raises(Interrupted), stop_signals():
        os.kill(os.getpid(), signal.SIGTERM)
    assert interruption(RuntimeError("later")) is None  # outside stop_signals() no signal is pending
    with stop_signals():
        assert interruption(ValueError("x")) is None  # nor in the next one


def test_features_stopped_before_its_pass_says_no_site_was_written(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """CI caught a Ctrl-C after the pass's Trainer was built but before the pass: the line must still say what
    was kept, not the generic "rerun the same command"."""
    import sae_pipeline.features.cli as features_cli
    from sae_pipeline.__main__ import main

    def load_model(args: object) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # the handler raises here, before any data is read

    monkeypatch.setattr(features_cli, "load_model", load_model)
    site = tmp_path / "site"
    argv = ["features", "--sae", str(tmp_path), "--data.source", "digits", "--out", str(site)]
    assert main(argv) == 128 + signal.SIGTERM
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert (
        line == f"terminated (SIGTERM): no site written to {site} (nothing was written there); rerun the same command"
    )
    assert not site.exists()


@pytest.mark.parametrize("where", ["between the renames", "while the previous site is deleted"])
def test_sigterm_in_another_thread_during_the_site_swap_waits_for_it(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, where: str
) -> None:
    """The swap blocks the signals in the main thread only; CI had one land in another thread (Rich's refresh
    thread) while the previous site was being deleted: Python ran the handler in the main thread there, which
    left half the old copy behind and said "the previous site there is unchanged" with the new site in place.
    The swap now finishes first, and the line says the new site is in place."""
    from features_fixtures import identity_sae, write_export, write_shards

    from sae_pipeline.__main__ import main

    write_shards(tmp_path / "shards", tmp_path / "images")
    site = tmp_path / "site"
    argv = ["features", "--sae", str(write_export(identity_sae(), tmp_path / "sae")), "--out", str(site)]
    argv += ["--data.source", str(tmp_path / "shards"), "--data.num_workers", "0", "--trainer.accelerator", "cpu"]
    assert main(argv) == 0
    previous = (site / "features.json").stat().st_ino
    pages = sorted(p.relative_to(site) for p in site.rglob("*"))
    waiting = threading.Event()
    other = threading.Thread(target=waiting.wait, daemon=True)  # a thread that does not block SIGTERM
    other.start()

    def signal_the_other_thread() -> None:
        signal.pthread_kill(other.ident, signal.SIGTERM)
        time.sleep(0.2)  # Python runs the handler in the main thread at its next bytecode

    rename, rmtree = Path.rename, shutil.rmtree

    def rename_then_signal(self: Path, target: Path) -> Path:
        moved = rename(self, target)
        if where == "between the renames" and Path(target).name.startswith(".site.old-"):
            signal_the_other_thread()
        return moved

    def rmtree_with_signal(path, *args, **kwargs) -> None:
        if where == "while the previous site is deleted" and Path(path).name.startswith(".site.old-"):
            rmtree(Path(path) / "atoms")  # the old copy half deleted when the signal lands
            signal_the_other_thread()
        rmtree(path, *args, **kwargs)

    monkeypatch.setattr(Path, "rename", rename_then_signal)
    monkeypatch.setattr(shutil, "rmtree", rmtree_with_signal)
    try:
        assert main(argv) == 128 + signal.SIGTERM
    finally:
        waiting.set()
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == (
        f"terminated (SIGTERM): the new site is in place in {site}, whole (the stop came after its swap); "
        f"open {site / 'index.html'}"
    )
    assert (site / "features.json").stat().st_ino != previous  # the new site
    assert sorted(p.relative_to(site) for p in site.rglob("*")) == pages  # whole
    assert not list(tmp_path.glob(".site.*"))  # no staging folder, no (half-deleted) old copy


HANDOFF = """
import os, socket, sys, time
from multiprocessing import resource_sharer
from feature_extraction.shard_loop import loader_worker_init
if sys.argv[1] == "worker":
    loader_worker_init(0)
read_end, _ = os.pipe()
resource_sharer.DupFd(read_end)  # a batch waiting to be fetched: the sharer's thread listens
address = resource_sharer._resource_sharer._address
fetcher = socket.socket(socket.AF_UNIX)
fetcher.connect(address)
time.sleep(0.3)  # the sharer has sent its challenge; the fetcher is stopped before it answers
fetcher.close()
time.sleep(0.5)
sys.excepthook(ValueError, ValueError("an unrelated error"), None)
"""


@pytest.mark.parametrize("process", ["worker", "plain"])
def test_a_fetch_dropped_by_a_stop_leaves_no_traceback_in_a_loader_worker(process: str) -> None:
    """CI: Ctrl-C landed while extraction's main process was taking a batch from its loader worker; the worker's
    resource sharer printed the dropped connection's traceback under the stop line. A plain process (no worker
    init) still prints it, so this reproduces the drop; unrelated errors print in both."""
    result = subprocess.run([sys.executable, "-c", HANDOFF, process], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "ValueError: an unrelated error" in result.stderr
    dropped = "resource_sharer.py" in result.stderr
    assert dropped == (process == "plain"), result.stderr
