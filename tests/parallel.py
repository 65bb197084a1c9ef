"""The suite on two workers (pytest-xdist, `make test`): which tests must share a worker, which start
first, and artifacts built once for both workers.

Why each rule:

- **Groups.** A module- or class-scoped fixture is built once per worker that runs a test using it.
  Spread over two workers, a fixture that trains an SAE or builds an image would be built twice, so
  every test that uses one gets the `xdist_group` of its module (`--dist loadgroup` keeps a group on
  one worker, in collection order). Tests of a module that use no such fixture stay free to go to
  either worker. A test can name its group itself (`@pytest.mark.xdist_group("...")`): tests that
  share a system resource that exists once per machine (a SLURM controller's state, a network
  bridge's name) do.
- **Longest first.** The scheduler hands work out in collection order (`--no-loadscope-reorder`),
  one unit at a time to the worker that runs short of work: a long unit that starts last makes the
  other worker wait at the end. `LONG_FIRST` names the units that took longest (the `--durations`
  list in BENCHMARKS.md, "The test suite's time"); they start first, in that order, each group
  whole. A wrong or stale entry costs a few seconds of balance, never a result.
- **Built once.** `built_once` builds a directory for the whole run under a lock: the first worker
  to ask builds it, the other waits and reuses it. For artifacts several modules read and none
  writes (shards, a trained run, an export): copy before writing into one.
- **Threads.** Each worker's torch runs on one thread (and its child processes: `OMP_NUM_THREADS`),
  so two workers fill two cores instead of four spinning OpenMP threads contending for them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1" under xdist; None in a plain run

#: Test modules (or `module::test` prefixes) that start first, longest first.
LONG_FIRST: tuple[str, ...] = (
    "tests/test_docker.py::test_image_builds_and_runs_fit_and_extract_as_uid_1000",
    "tests/test_slurm_train.py",
    "tests/test_benchmarks_rehearsal.py",
    "tests/test_chaos.py",
    "tests/test_cli.py",
    "tests/test_signals.py",
    "tests/test_docs_commands.py::test_documented_commands_run_at_a_tiny_size",
    "tests/test_ddp_equality.py",
    "tests/test_demo.py::test_shard_stage_end_to_end",
    "tests/test_benchmarks_short_run.py",
    "tests/test_slurm_multinode.py",
    "tests/test_benchmarks_scaling_pipeline.py",
    "tests/test_disk_full.py",
)

_SCOPED = ("module", "class", "package")


def threads_per_process() -> int:
    """Torch threads of this pytest process: one per worker, both cores for a plain run."""
    return 1 if WORKER else 2


def configure_threads() -> None:
    import torch

    torch.set_num_threads(threads_per_process())
    if WORKER:
        os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config: pytest.Config) -> None:
    configure_threads()


def _module_of(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def uses_scoped_fixture(item: pytest.Item) -> bool:
    """Whether ``item`` takes a fixture that lives longer than a test but not a whole session."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(definitions[-1].scope in _SCOPED for definitions in info.name2fixturedefs.values() if definitions)


def _rank(nodeid: str) -> int:
    for index, prefix in enumerate(LONG_FIRST):
        if nodeid == prefix or nodeid.startswith(prefix + "::") or nodeid.startswith(prefix + "["):
            return index
    return len(LONG_FIRST)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Groups for tests sharing a scoped fixture; then the `LONG_FIRST` units first, each group whole."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None and uses_scoped_fixture(item):
            item.add_marker(pytest.mark.xdist_group(_module_of(item)))

    def unit(item: pytest.Item) -> str:
        marker = item.get_closest_marker("xdist_group")
        if marker is not None:
            return "@" + str(marker.args[0] if marker.args else marker.kwargs.get("name"))
        return item.nodeid

    first_rank: dict[str, int] = {}
    for item in items:
        key = unit(item)
        first_rank[key] = min(first_rank.get(key, len(LONG_FIRST)), _rank(item.nodeid))
    order = {id(item): index for index, item in enumerate(items)}
    items.sort(key=lambda item: (first_rank[unit(item)], order[id(item)]))


def shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of this run that every worker sees: the run's base temp (the workers' parent under xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if WORKER else base


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """``ROOT/name``, built by ``build(dpath)`` once in this run, whichever worker asks first.

    A failed build leaves nothing behind, so the next asker builds again (and fails the same way, with
    its own traceback in its own test).
    """
    root = shared_root(tmp_path_factory)
    dpath = root / "built-once" / name
    dpath.parent.mkdir(parents=True, exist_ok=True)
    done = dpath.parent / f"{name}.done"
    with _locked(dpath.parent / f"{name}.lock"):
        if not done.exists():
            shutil.rmtree(dpath, ignore_errors=True)
            dpath.mkdir()
            try:
                build(dpath)
            except BaseException:
                shutil.rmtree(dpath, ignore_errors=True)
                raise
            done.touch()
    return dpath
