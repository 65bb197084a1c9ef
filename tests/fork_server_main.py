"""The tests' fork server itself (started by tests/fork_server.py, which says why and how it is used).

It imports the third-party libraries once (`PRELOAD`), then forks one child per request, which becomes
`python -m MODULE ARGS` in the caller's working directory, environment and stdio; it reports each child's
pid, then its wait status, on the request's connection. Run as `python tests/fork_server_main.py SOCKET`.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import sys
import threading
from collections.abc import Mapping

#: Third-party modules imported once by the server (never the project's own).
PRELOAD = (
    "numpy",
    "threadpoolctl",
    "torch",
    "lightning.pytorch",
    "torchmetrics",
    "jsonargparse",
    "scipy.stats",
    "matplotlib",
    "timm",
    "webdataset",
    "h5py",
    "safetensors.torch",
    "tensorboard.backend.event_processing.event_accumulator",
)
#: Variables a preloaded library may read at import: a request that changes one runs in a real interpreter.
IMPORT_TIME_VARIABLES = ("OMP_PROC", "OMP_WAIT", "GOMP_", "MKL_", "OPENBLAS_", "TRITON_", "TORCH", "CUDA_")
IMPORT_TIME_VARIABLES += ("PYTORCH_", "PYTHON", "LD_", "PL_", "LIGHTNING", "HF_", "HUGGINGFACE", "TIMM", "JSONARGPARSE")
IMPORT_TIME_VARIABLES += ("MPL", "HOME", "XDG_", "TMPDIR", "TEMP", "TMP", "LANG", "LC_")
#: Variables the child applies itself, as a fresh interpreter's start would; and Lightning's seed variables,
#: which `seed_everything` in the test process sets and Lightning reads when it runs, not at import.
EMULATED = ("PYTHONPATH", "PYTHONWARNINGS", "OMP_NUM_THREADS", "PL_GLOBAL_SEED", "PL_SEED_WORKERS")
_MAX_REQUEST = 4 << 20


def _import_time_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_VARIABLES) and k not in EMULATED}


def _child(
    request: dict, fds: list[int], base_path: list[str], filters: tuple[list, list], set_by_imports: dict[str, str]
) -> None:
    """In the forked child: become `python -m MODULE ARGS` in ``cwd`` with ``env``; never returns."""
    code = 1
    try:
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
        for fd in fds[:3]:
            os.close(fd)
        for signum in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.set_wakeup_fd(-1)
        if request.get("new_session"):
            os.setsid()  # its own process group, as `start_new_session=True` gives
        if len(fds) > 3:
            os.close(fds[3])  # the session is set: the server may now give the caller the pid
        if request.get("umask") is not None:
            os.umask(request["umask"])
        os.chdir(request["cwd"])
        # PYTHONWARNINGS is read at start, before any import: its filters go below those the imports added.
        import warnings

        added, initial = filters
        warnings.resetwarnings()
        warnings._processoptions([o for o in request["env"].get("PYTHONWARNINGS", "").split(",") if o])
        warnings.filters[:] = [*added, *warnings.filters, *initial]
        getattr(warnings, "_filters_mutated", lambda: None)()
        os.environ.clear()
        os.environ.update(request["env"])
        for name, value in set_by_imports.items():  # as the imports of a fresh interpreter would set them
            os.environ.setdefault(name, value)
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [os.getcwd(), *extra, *base_path]
        # The process's own stdio, buffered as a fresh interpreter's is when it is not a terminal.
        sys.stdin = sys.__stdin__ = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = sys.__stdout__ = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")  # noqa: SIM115
        import numpy as np
        import threadpoolctl
        import torch

        np.random.seed()  # a fresh interpreter seeds NumPy's global state from the OS
        # OMP_NUM_THREADS, read by a fresh interpreter's OpenMP and BLAS when they load, applied here.
        threads = request["env"].get("OMP_NUM_THREADS", "")
        n_threads = int(threads) if threads.isdigit() and int(threads) > 0 else os.cpu_count() or 1
        torch.set_num_threads(n_threads)
        threadpoolctl.threadpool_limits(n_threads)
        import runpy

        sys.argv = [request["module"], *request["args"]]
        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exit_:
            if exit_.code is None:
                code = 0
            elif isinstance(exit_.code, int):
                code = exit_.code
            else:
                print(exit_.code, file=sys.stderr)
                code = 1
        except KeyboardInterrupt:
            import traceback

            traceback.print_exc()
            code = 130
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        threading._shutdown()  # as the interpreter does at exit: wait for non-daemon threads
        atexit._run_exitfuncs()
    except BaseException:  # the set-up itself failed: say so where the caller looks
        import traceback

        os.write(2, traceback.format_exc().encode())
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def serve(socket_path: str) -> None:
    """Preload, then fork one child per request; report each child's pid, then its wait status."""
    import warnings

    # What `import sae_pipeline` sets before SciPy's OpenBLAS loads (sae_pipeline/__init__.py), set here before
    # the preload loads it, as a fresh `python -m sae_pipeline` would have it.
    before = _import_time_env(os.environ)
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
    initial = list(warnings.filters)
    for name in PRELOAD:
        __import__(name)
    added = list(warnings.filters[: len(warnings.filters) - len(initial)])
    base_path = [p for p in sys.path if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    assert threading.active_count() == 1, "a preloaded module started a thread: fork would copy a half-held lock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    children: dict[int, socket.socket] = {}
    # The import-time variables as the preload left them, and those it set itself (Lightning sets some): a
    # request must match these, or lack one the preload sets (a fresh interpreter's imports set it the same way).
    after = _import_time_env(os.environ)
    set_by_imports = sorted(k for k in after if k not in before)
    print(json.dumps({"ready": after, "set_by_imports": set_by_imports}), flush=True)
    while True:
        readable, _, _ = select.select([listener, wake_r], [], [], 1.0)
        if wake_r in readable:
            os.read(wake_r, 4096)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass
                conn.close()
        if listener in readable:
            conn, _ = listener.accept()
            _, fds, _, _ = socket.recv_fds(conn, 1, 3)  # one byte that carries the caller's stdio
            data = b""
            while not data.endswith(b"\n"):
                more = conn.recv(_MAX_REQUEST)
                if not more:
                    break
                data += more
            request = json.loads(data)
            # A child that starts a session closes the pipe's end once it has: `popen` returns a pid whose
            # process group is already its own, as `subprocess.Popen(start_new_session=True)` does.
            set_r, set_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                os.close(wake_r)
                os.close(wake_w)
                os.close(set_r)
                _child(request, [*fds, set_w], base_path, (added, initial), {k: after[k] for k in set_by_imports})
            os.close(set_w)
            while True:
                try:
                    if not os.read(set_r, 1):
                        break
                except InterruptedError:
                    continue
            os.close(set_r)
            for fd in fds:
                os.close(fd)
            children[pid] = conn
            conn.sendall(f"{pid}\n".encode())


if __name__ == "__main__":
    sys.path.pop(0)  # this file's folder: the children must not see tests/ on their path
    serve(sys.argv[1])
