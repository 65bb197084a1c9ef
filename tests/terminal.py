"""Start a command as a terminal would, whatever shell started the tests.

A shell starts background jobs (``cmd &``, ``nohup``) with SIGINT ignored, and a child inherits
that, so Python in it never turns Ctrl-C into KeyboardInterrupt: tests that send SIGINT to a
command pass this as ``preexec_fn`` to give it the default disposition, as under a terminal.
"""

from __future__ import annotations

import signal


def default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
