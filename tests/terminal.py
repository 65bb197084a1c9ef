"""Start a command as a terminal would, whatever shell started the tests, and watch it run.

A shell starts background jobs (``cmd &``, ``nohup``) with SIGINT ignored, and a child inherits
that, so Python in it never turns Ctrl-C into KeyboardInterrupt: tests that send SIGINT to a
command pass ``default_sigint`` as ``preexec_fn`` to give it the default disposition, as under a
terminal. ``Command`` does so, in the command's own process group (forked from the tests' fork
server where that gives the same process: tests/fork_server.py), and reads its output as it comes;
``child_pids`` finds the processes a command started (DDP ranks, loader workers, writers).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import fork_server

ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
TIMEOUT_S = 240


def default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Command:
    """A running ``python -m MODULE ARGS`` whose stdout and stderr are read as they come."""

    def __init__(self, cwd: Path, *args: str, module: str = "sae_pipeline", env: dict | None = None) -> None:
        self.process = fork_server.popen(
            [sys.executable, "-m", module, *args], cwd=cwd, env=env or ENV, new_session=True, default_sigint=True
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(stream, lines), daemon=True)
            for stream, lines in ((self.process.stdout, self.out), (self.process.stderr, self.err))
        ]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream, lines: list[str]) -> None:
        for line in stream:
            lines.append(line)

    def text(self) -> str:
        return "".join(self.out) + "".join(self.err)

    def wait_for(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while not ready():
            assert self.process.poll() is None, (
                f"exited {self.process.returncode} before {what}:\n{self.text()[-3000:]}"
            )
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.02)

    def signal(self, signum: int) -> None:
        if signum == signal.SIGINT:
            os.killpg(self.process.pid, signum)  # a terminal's Ctrl-C: the whole process group
        else:
            self.process.send_signal(signum)

    def finish(self) -> int:
        try:
            self.process.wait(timeout=TIMEOUT_S)
        finally:
            if self.process.poll() is None:
                self.process.kill()
        for reader in self._readers:
            reader.join(timeout=10)
        return self.process.returncode


def child_pids(pid: int) -> list[int]:
    """The processes ``pid``'s main thread started and that still run (none once it has gone)."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(child) for child in children.read_text().split()] if children.exists() else []


def command_line(pid: int) -> str:
    """A process's command line; empty once it has gone (a short-lived helper between the listing and the read)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return ""
