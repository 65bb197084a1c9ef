"""`python -m sae_pipeline ...` for the tests in a few hundred milliseconds instead of ten CPU-seconds.

Why: a fresh interpreter spends about ten CPU-seconds importing torch, Lightning and what torchmetrics
pulls in (torchvision, SciPy, transformers in the test environment) before a command does anything;
the suite starts hundreds of commands. A fork server imports those third-party modules once; each
command is a `fork` of it that runs the module as `python -m` would (`runpy`, `sys.argv`, `sys.path[0]`
the working directory, the given environment, the caller's stdin/stdout/stderr), in a process of its
own with its own pid, exit status and signals. The project's own packages are not preloaded: each
command imports them fresh, so what they read from the environment at import is read as usual.

What it cannot stand in for, and where `run` falls back to a real interpreter:
- an environment that differs from the server's in a variable a preloaded library reads at import
  (`IMPORT_TIME_VARIABLES`: OpenMP's policies, Triton, CUDA, Python's own); `OMP_NUM_THREADS` is
  applied to torch and the BLAS libraries in the child, as their load would;
- anything but `python -m MODULE` with MODULE one of `MODULES`.
Tests that signal, kill or time a command keep `subprocess` (they need the pid from the start, and a
real interpreter's start is part of what some of them measure).

Usage: `run(argv, cwd=..., env=..., timeout=...)` where a test would call `subprocess.run(argv,
capture_output=True, text=True, ...)`. One server per pytest process (each xdist worker), started on
first use, stopped when the process exits.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from fork_server_main import _import_time_env

#: The modules whose `python -m` runs may be forked.
MODULES = ("sae_pipeline", "sae_pipeline.evaluate", "feature_extraction")
SERVER_FPATH = Path(__file__).with_name("fork_server_main.py")


class ForkServer:
    """A running server (one per pytest process) and the environment it was started with."""

    def __init__(self, dpath: Path) -> None:
        self.dpath = dpath
        self.socket_path = str(dpath / "fork.sock")
        self.env = dict(BASE_ENV)
        self.process = subprocess.Popen(
            [sys.executable, str(SERVER_FPATH), self.socket_path],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=self.env,
            text=True,
        )
        line = self.process.stdout.readline()
        try:
            started = json.loads(line)
            self.import_time_env, self.set_by_imports = started["ready"], set(started["set_by_imports"])
        except (ValueError, KeyError, TypeError):
            self.process.kill()
            raise RuntimeError(f"the test fork server did not start (exit {self.process.wait()})") from None

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        shutil.rmtree(self.dpath, ignore_errors=True)

    def accepts(self, argv: Sequence[str], env: Mapping[str, str]) -> bool:
        """Whether ``argv`` in ``env`` runs the same forked as in a fresh interpreter."""
        return (
            self.process.poll() is None
            and len(argv) >= 3
            and argv[0] == sys.executable
            and argv[1] == "-m"
            and argv[2] in MODULES
            and self.same_imports(env)
        )

    def same_imports(self, env: Mapping[str, str]) -> bool:
        """Whether a fresh interpreter with ``env`` would import the preloaded modules as the server did."""
        wanted = _import_time_env(env)
        return all(
            wanted.get(name) == self.import_time_env.get(name) or (name not in wanted and name in self.set_by_imports)
            for name in {*wanted, *self.import_time_env}
        )

    def start(
        self,
        argv: Sequence[str],
        *,
        cwd: str | Path,
        env: Mapping[str, str],
        stdio: tuple[int, int, int],
        umask: int | None = None,
        new_session: bool = False,
    ) -> tuple[socket.socket, int]:
        """Ask for a child with these stdin, stdout, stderr descriptors; the connection (its exit status
        comes on it) and the child's pid."""
        request = {
            "module": argv[2],
            "args": list(argv[3:]),
            "cwd": str(Path(cwd).resolve()),
            "env": dict(env),
            "umask": umask,
            "new_session": new_session,
        }
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.socket_path)
        socket.send_fds(conn, [b"."], list(stdio))
        conn.sendall(json.dumps(request).encode() + b"\n")
        return conn, int(_Lines(conn).next(None))

    def run(
        self,
        argv: Sequence[str],
        *,
        cwd: str | Path,
        env: Mapping[str, str],
        timeout: float | None,
        input: str | None = None,
        umask: int | None = None,
    ) -> subprocess.CompletedProcess:
        with (
            tempfile.TemporaryFile() as stdin,
            tempfile.TemporaryFile() as stdout,
            tempfile.TemporaryFile() as stderr,
        ):
            if input is not None:
                stdin.write(input.encode())
                stdin.seek(0)
            process = ForkedProcess(self, argv, cwd=cwd, env=env, stdio=(stdin, stdout, stderr), umask=umask)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                raise
            stdout.seek(0)
            stderr.seek(0)
            out = stdout.read().decode("utf-8", "backslashreplace")
            err = stderr.read().decode("utf-8", "backslashreplace")
        return subprocess.CompletedProcess(list(argv), process.returncode, out, err)


class ForkedProcess:
    """The part of `subprocess.Popen` the tests use, for a child of the server: `pid`, `poll`, `wait`,
    `send_signal`, `terminate`, `kill`, `returncode`, and `stdout`/`stderr` as text pipes (`PIPE`) or the
    files given. Its exit status is the server's to read (it is the parent); it arrives on the connection.
    """

    def __init__(
        self,
        server: ForkServer,
        argv: Sequence[str],
        *,
        cwd: str | Path,
        env: Mapping[str, str],
        stdio: tuple | None = None,
        umask: int | None = None,
        new_session: bool = False,
    ) -> None:
        self.args, self.returncode = list(argv), None
        self.stdout = self.stderr = None
        ours: list[int] = []
        if stdio is None:  # stdin from /dev/null, stdout and stderr as pipes the caller reads
            stdin = os.open(os.devnull, os.O_RDONLY)
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            fds, ours = (stdin, out_w, err_w), [stdin, out_w, err_w]
            self.stdout = open(out_r, errors="backslashreplace")  # noqa: SIM115 (closed with the process)
            self.stderr = open(err_r, errors="backslashreplace")  # noqa: SIM115
        else:
            fds = tuple(f if isinstance(f, int) else f.fileno() for f in stdio)
        try:
            self.conn, self.pid = server.start(argv, cwd=cwd, env=env, stdio=fds, umask=umask, new_session=new_session)
        finally:
            for fd in ours:
                os.close(fd)
        self._status = _Lines(self.conn)

    def poll(self) -> int | None:
        if self.returncode is None:
            line = self._status.next(time.monotonic())
            if line is not None:
                self._finish(line)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            line = self._status.next(None if timeout is None else time.monotonic() + timeout)
            if line is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._finish(line)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        """Both pipes read to their end (beside each other, so neither fills), then the exit status."""
        deadline = None if timeout is None else time.monotonic() + timeout
        texts: dict[str, str] = {}
        readers = [
            threading.Thread(target=lambda n=name, f=stream: texts.__setitem__(n, f.read()), daemon=True)
            for name, stream in (("out", self.stdout), ("err", self.stderr))
            if stream is not None
        ]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(None if deadline is None else max(deadline - time.monotonic(), 0.0))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(deadline - time.monotonic(), 0.0))
        return texts.get("out"), texts.get("err")

    def _finish(self, line: str) -> None:
        self.returncode = int(line) if line else -signal.SIGKILL  # '' : the server itself went away
        self.conn.close()

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Lines:
    """Lines from a socket, each waited for until a deadline (None: for ever); '' when the peer closed."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn, self.buffer = conn, b""

    def next(self, deadline: float | None) -> str | None:
        while b"\n" not in self.buffer:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            ready, _, _ = select.select([self.conn], [], [], left)
            if ready:
                chunk = self.conn.recv(4096)
                if not chunk:
                    return ""
                self.buffer += chunk
            elif left is not None and deadline - time.monotonic() <= 0:
                return None
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line.decode()


_SERVER: ForkServer | None = None
#: How many `run` calls this process forked and how many started a fresh interpreter.
COUNTS = {"forked": 0, "fresh": 0}
#: The environment when the suite started (conftest imports this module first): the server's, whichever
#: test happens to start it with its own variables set.
BASE_ENV = dict(os.environ)


def run(
    argv: Sequence[str],
    *,
    cwd: str | Path,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    input: str | None = None,
    umask: int | None = None,
) -> subprocess.CompletedProcess:
    """`subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)`, forked
    from the server where it gives the same result (see the module docstring), else exactly that;
    ``umask``: the process's umask (what a `preexec_fn` calling `os.umask` would set)."""
    env = dict(os.environ if env is None else env)
    server = _SERVER or (_start() if ENABLED else None)
    if server is not None and server.accepts(argv, env):
        COUNTS["forked"] += 1
        return server.run(argv, cwd=cwd, env=env, timeout=timeout, input=input, umask=umask)
    COUNTS["fresh"] += 1
    return subprocess.run(
        list(argv),
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        input=input,
        preexec_fn=None if umask is None else (lambda: os.umask(umask)),
    )


def popen(
    argv: Sequence[str],
    *,
    cwd: str | Path,
    env: Mapping[str, str] | None = None,
    new_session: bool = False,
    default_sigint: bool = False,
) -> ForkedProcess | subprocess.Popen:
    """`subprocess.Popen(argv, cwd=cwd, env=env, stdout=PIPE, stderr=PIPE, text=True, start_new_session=...)`,
    forked where it gives the same process (see `run`). A forked child always has Python's own Ctrl-C handler,
    what ``default_sigint`` asks of a fresh interpreter (the SIGINT disposition a terminal gives)."""
    env = dict(os.environ if env is None else env)
    server = _SERVER or (_start() if ENABLED else None)
    sigint_as_forked = default_sigint or signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
    if server is not None and server.accepts(argv, env) and sigint_as_forked:
        COUNTS["forked"] += 1
        return ForkedProcess(server, argv, cwd=cwd, env=env, new_session=new_session)
    COUNTS["fresh"] += 1
    return subprocess.Popen(
        list(argv),
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=new_session,
        preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) if default_sigint else None,
    )


#: `SAE_PIPELINE_TEST_FORK=0` runs every command in a fresh interpreter (to compare, or to rule the server out).
ENABLED = os.environ.get("SAE_PIPELINE_TEST_FORK", "1") != "0"


def _start() -> ForkServer:
    """Start this process's server, on first use; stopped when the process exits."""
    global _SERVER
    if _SERVER is None:
        _SERVER = ForkServer(Path(tempfile.mkdtemp(prefix="fork-server-")))
        atexit.register(_SERVER.stop)
    return _SERVER
