"""The one whole-or-absent file writer (feature_extraction/atomic_files.py): what every artifact relies on."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from feature_extraction.atomic_files import atomic_path, write_json_atomic, write_text_atomic


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
