"""The one whole-or-absent file writer (feature_extraction/atomic_files.py): what every artifact relies on."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from feature_extraction.atomic_files import (
    DiskFullError,
    atomic_path,
    check_free_space,
    disk_full_line,
    free_bytes,
    out_of_space,
    write_json_atomic,
    write_text_atomic,
)


def test_atomic_path_renames_only_a_finished_file(tmp_path: Path) -> None:
    target = tmp_path / "a.bin"
    target.write_bytes(b"old")
    with atomic_path(target) as tmp:
        tmp.write_bytes(b"new")
        assert tmp.name == "a.bin.tmp" and target.read_bytes() == b"old"  # nothing visible before the end
    assert target.read_bytes() == b"new" and sorted(p.name for p in tmp_path.iterdir()) == ["a.bin"]


@pytest.mark.parametrize("error", [OSError, KeyboardInterrupt])
def test_an_error_keeps_the_old_file_and_removes_the_temporary_one(tmp_path: Path, error: type) -> None:
    target = tmp_path / "a.json"
    write_text_atomic(target, "old")
    with pytest.raises(error), atomic_path(target, tmp_path / ".a.json.partial") as tmp:
        tmp.write_text("half")
        raise error()
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


def test_nested_paths_rename_the_inner_file_first(tmp_path: Path) -> None:
    """How an export replaces weights then config: a reader that sees the new config sees the new weights."""
    with atomic_path(tmp_path / "config.json") as config_tmp, atomic_path(tmp_path / "weights.bin") as weights_tmp:
        weights_tmp.write_bytes(b"w")
        config_tmp.write_text("c")
    seen = sorted(p.name for p in tmp_path.iterdir())
    assert seen == ["config.json", "weights.bin"]
    with pytest.raises(RuntimeError), atomic_path(tmp_path / "config.json") as config_tmp:
        config_tmp.write_text("c2")
        with atomic_path(tmp_path / "weights.bin") as weights_tmp:
            weights_tmp.write_bytes(b"w2")
        raise RuntimeError("after the weights")  # the config must not be replaced
    assert (tmp_path / "config.json").read_text() == "c" and (tmp_path / "weights.bin").read_bytes() == b"w2"


def test_write_json_atomic_exclusive_keeps_the_first_writer(tmp_path: Path) -> None:
    target = tmp_path / "extraction.json"
    assert write_json_atomic(target, {"first": 1}, exclusive=True)
    assert not write_json_atomic(target, {"second": 2}, exclusive=True)
    assert json.loads(target.read_text()) == {"first": 1}
    assert write_json_atomic(target, {"third": 3})  # not exclusive: replaces
    assert target.read_text() == json.dumps({"third": 3}, indent=1) and len(list(tmp_path.iterdir())) == 1
    with pytest.raises(ValueError):  # NaN is refused before anything is written
        write_json_atomic(target, {"x": float("nan")})
    assert json.loads(target.read_text()) == {"third": 3} and len(list(tmp_path.iterdir())) == 1


def _torch_wrapped() -> RuntimeError:
    """What ``torch.save`` raises on a full disk: its writer's RuntimeError, raised while handling the OSError."""
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 73984 vs 73876")  # noqa: B904
    except RuntimeError as exn:
        return exn


@pytest.mark.parametrize(
    ("error", "path"),
    [
        (OSError(errno.ENOSPC, "No space left on device", "/d/a.bin"), "/d/a.bin"),
        (OSError(errno.EDQUOT, "Disk quota exceeded", "/d/q.bin"), "/d/q.bin"),
        (_torch_wrapped(), None),
        (
            RuntimeError(
                "Can't decrement id ref count (file write failed: time = x, filename = '/d/codes.h5.tmp', file "
                "descriptor = 3, errno = 28, error message = 'No space left on device', buf = 0x5)"
            ),
            "/d/codes.h5.tmp",
        ),
        (Exception("Error while serializing: I/O error: No space left on device (os error 28)"), None),
    ],
)
def test_out_of_space_is_recognised_however_it_is_wrapped(error: BaseException, path: str | None) -> None:
    assert out_of_space(error)
    line = disk_full_line(error, "what the command keeps")
    assert line == (
        f"error: no space left on device writing {path or 'the output'}; kept: what the command keeps; "
        "free space and rerun the same command"
    )


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.EACCES, "Permission denied"),
        RuntimeError("unexpected pos 1 vs 2"),
        ValueError("--out: No space left on device is not a folder"),
    ],
)
def test_other_errors_are_not_a_full_disk(error: BaseException) -> None:
    assert not out_of_space(error) and disk_full_line(error) is None


@pytest.mark.parametrize("previous", [True, False])
def test_a_full_disk_in_atomic_path_names_the_file_and_what_was_kept(tmp_path: Path, previous: bool) -> None:
    target = tmp_path / "w.bin"
    if previous:
        target.write_bytes(b"old")
    with pytest.raises(DiskFullError) as caught, atomic_path(target) as tmp:
        tmp.write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")
    kept = f"the previous {target}, unchanged" if previous else "the files written before this one"
    assert (
        str(caught.value) == f"no space left on device writing {target}; kept: {kept}; free space and rerun the "
        "same command"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == (["w.bin"] if previous else [])
    assert not previous or target.read_bytes() == b"old"


def test_check_free_space_refuses_what_does_not_fit(tmp_path: Path) -> None:
    check_free_space(tmp_path / "x", 1)
    with pytest.raises(DiskFullError, match=r"writing .*x \(.* MiB free, .* MiB needed\); kept: k;"):
        check_free_space(tmp_path / "x", free_bytes(tmp_path) + (1 << 40), "k")


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_the_file_gets_the_users_umask_not_the_writers_mode(tmp_path: Path, umask: int) -> None:
    """safetensors creates its file 0600; an atomic file gets what open() would give it."""
    script = (
        "import os, sys; from pathlib import Path; from feature_extraction.atomic_files import atomic_path\n"
        "with atomic_path(Path(sys.argv[1])) as tmp:\n"
        "    os.close(os.open(tmp, os.O_CREAT | os.O_WRONLY, 0o600))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "f")], check=True, env=env, preexec_fn=lambda: os.umask(umask)
    )
    assert (tmp_path / "f").stat().st_mode & 0o777 == 0o666 & ~umask
