"""Where a feature browser site goes: ``--out`` checked, the site built beside it, swapped in whole.

The site is written into a sibling staging folder (``.OUT.partial-PID``) and swapped in at the
end, so a failure leaves the previous site (or nothing) in place. Because of that swap, ``--out``
is checked before the pass: its folder must be writable and ``--out`` must not be a mount point
(pass a folder inside it); either is one line, exit 2. A run killed before the swap leaves its
staging folder behind; the next run removes those whose process is gone. A full disk removes the
staging folder and ends with one ``no space left on device`` line (exit 1), the previous site whole.
A SIGTERM or Ctrl-C during the swap takes effect once it is done: the new site is then in place, whole,
and the features command's line says so (`site_identity`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from feature_extraction.atomic_files import DiskFullError, out_of_space
from feature_extraction.output_dirs import dir_problem
from sae_pipeline.training.interrupts import stops_held

MARKER_FNAME = "features.json"  # in every site: what was run, and how a rerun recognises a site it may replace


def check_out_dir(out: Path) -> None:
    """Refuse an ``--out`` the site cannot be swapped into: something other than a previous site, a mount
    point, or in a folder that cannot be written (nothing is written here)."""
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MARKER_FNAME).is_file())):
        raise ValueError(f"--out {out}: exists and is not a feature browser site; choose a new or empty directory")
    if out.is_dir() and os.path.ismount(out):
        raise ValueError(
            f"--out {out}: is a mount point; the site is built next to --out and renamed into place, "
            f"which a mount point cannot be; pass a folder inside it, e.g. --out {out / 'site'}"
        )
    problem = dir_problem(out.parent)
    if problem:
        raise ValueError(f"--out {out}: its folder {out.parent} {problem}; choose a writable location for --out")


def remove_stale_partials(out: Path) -> list[Path]:
    """Remove the staging (``.OUT.partial-PID``) and swapped-out (``.OUT.old-PID``) folders of runs whose
    process is gone (killed before they could clean up); returns what was removed. A swapped-out site
    with no site in its place (killed between the two renames) is put back instead."""
    removed = []
    parent = out.parent if out.parent.is_dir() else None
    for path in sorted(parent.iterdir()) if parent else ():
        head, _, pid = path.name.rpartition("-")
        if head not in (f".{out.name}.partial", f".{out.name}.old") or not pid.isdigit() or _alive(int(pid)):
            continue
        if head == f".{out.name}.old" and not out.exists():
            path.rename(out)
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


@contextlib.contextmanager
def staged_site(out: Path) -> Iterator[Path]:
    """The staging folder to write the site into; swapped in for ``out`` when the block ends normally,
    removed when it raises (a full disk then becomes :class:`DiskFullError` naming what was kept)."""
    check_out_dir(out)
    remove_stale_partials(out)
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    previous = out.is_dir() and (out / MARKER_FNAME).is_file()
    try:
        yield staging
        _swap_in(staging, out)
    except BaseException as exn:
        shutil.rmtree(staging, ignore_errors=True)
        if out_of_space(exn) and not isinstance(exn, DiskFullError):
            kept = f"the previous site in {out}, unchanged" if previous else f"no site in {out}"
            raise DiskFullError(out, f"{kept} (the partial {staging.name} was removed)") from exn
        raise


def _swap_in(staging: Path, out: Path) -> None:
    """Replace ``out`` by ``staging``: the previous site renamed aside, the new one renamed in, the aside copy
    deleted. SIGINT / SIGTERM wait for all three, in whichever thread they land (`stops_held`), so a
    stop finds the previous site or the new one in ``out``, never none, and no half-deleted copy beside it."""
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    with stops_held():
        if out.exists():
            out.rename(old)
        staging.rename(out)
        shutil.rmtree(old, ignore_errors=True)


def site_identity(out: Path) -> tuple[int, int] | None:
    """Which site is in ``out`` now (its marker file's device and inode; None: none): the stop's line compares
    it with the one before the run to say truthfully whether the new site is in place."""
    try:
        stat = (out / MARKER_FNAME).stat()
    except OSError:
        return None
    return stat.st_dev, stat.st_ino


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # a previous run that had our PID: no running site build of this process left it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
