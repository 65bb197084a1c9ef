"""Every file of the shard side that a user or another program may have written, fuzzed (issue 43, item 2).

The readers: a shard directory's `manifest.json` (`load_manifest`, and `peek_manifest` / `extraction_record`
that exports and checkpoints use), each shard's sidecar, a sample's `meta.json` (the training stream's
reader, the feature browser's re-read and webdataset's decoding, all through `shards.meta.parse_meta`),
the extraction's `extraction.json` and `skipped-N.json` (through `python -m feature_extraction finalize`),
and an output's lock file (`output_lock`). Each gets a valid file made by the real code, which Hypothesis
then damages with the structure in mind: one field given a wrong type, nested 50 000 deep, a number too
large for a float or an integer of 5000 digits, control characters (a terminal's clear-screen and title
escapes, a bidi override, NUL), deleted; the text cut short; the file replaced whole (empty, not UTF-8,
another JSON kind) or padded past what the reader takes. The reader runs through its command
(`main(["finalize", ...])`) or the function behind one under the commands' one error path
(`exit_status.run_command`), and must accept the file (the damage left it valid) or refuse it: exit 2,
exactly one `error:` line naming the file, no traceback, no raw control character from the file in the
output, and a peak allocation far below the file's limits. Every reader must refuse some mutations.

`finalize` also refuses the tar members every reader refuses (`..`, absolute, links, devices), even when the
shard's sidecar was forged to vouch for them.

`EXAMPLES` per reader in the suite (about 15 s in all); `pytest -m slow` runs `SLOW_EXAMPLES`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import socket
import tarfile
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fuzz_common import RAW_CONTROL, fuzzed
from fuzz_common import json_mutations as common_json_mutations
from hypothesis import given
from hypothesis import strategies as st
from test_hostile_shards import forge, renamed, with_extra

from feature_extraction import shards as S
from feature_extraction.__main__ import main
from feature_extraction.exit_status import run_command
from feature_extraction.output_lock import lock_fpath, output_lock
from feature_extraction.shards import read as R
from feature_extraction.shards.record import seal

D = 8
EXAMPLES = 30
SLOW_EXAMPLES = 300
COUNTS = [EXAMPLES, pytest.param(SLOW_EXAMPLES, marks=pytest.mark.slow, id="slow")]
PEAK_LIMIT = 24 << 20  # bytes; the files are a few KB, the deep ones 100 KB (finalize's parser is most of it)
CONTROL = "\x1b[2J\x1b]0;owned\x07\x08\u202e\x00\x9b"  # clear screen, set title, backspace, bidi override, NUL, CSI
#: What a field may be replaced by: every JSON kind, empty ones, huge and negative numbers, control characters.
WRONG = [None, True, 0, -1, 2**64, 10**30, 1e300, -1e300, "", CONTROL, "x" * 5000, [], {}, [CONTROL], {CONTROL: 1}]
#: Text spliced in for a field, which `json.dumps` would not write: deep nesting, numbers too large, NaN.
RAW = {
    "deep list": "[" * 50_000 + "]" * 50_000,
    "deep object": '{"a":' * 50_000 + "1" + "}" * 50_000,
    "nested 40": "[" * 40 + "]" * 40,
    "huge integer": "9" * 5000,
    "huge float": "1e999",
    "nan": "NaN",
    "lone surrogate": '"\\ud800\\u001b[2J"',
}
WHOLE = [b"", b"null", b"[]", b"7", b'"x"', b"\xff\xfe\x00\x01", RAW["deep list"].encode(), CONTROL.encode()]


# -- the outcome --------------------------------------------------------------------------------------------------


class Outcomes:
    """Per reader: how many mutations were refused (exit 2) and accepted (0)."""

    def __init__(self) -> None:
        self.refused = self.accepted = 0

    def check(self, outcome: tuple[int, str, str, int], fpath: Path, also: str = "") -> None:
        """Accepted, or refused in one `error:` line naming ``fpath`` (and ``also``); never a traceback, a raw
        control character, or a large allocation."""
        status, out, err, peak = outcome
        assert "Traceback" not in err, err[-3000:]
        assert not RAW_CONTROL.search(out + err), repr((out + err)[-2000:])
        assert peak < PEAK_LIMIT, f"peak allocation {peak} bytes"
        if status == 0:
            self.accepted += 1
            return
        assert status == 2, err[-3000:]
        assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err[-3000:]
        line = err.strip()
        assert str(fpath) in line or (str(fpath.parent) in line and fpath.name in line), line
        assert also in line, line
        assert len(line) < 2000, line[:300]
        self.refused += 1

    def done(self) -> None:
        assert self.refused, "no mutation was refused: the fuzz did not reach the reader"


def traced(run: Callable[[], int]) -> tuple[int, str, str, int]:
    """(exit status, stdout, stderr, peak bytes allocated) of ``run()``, which returns an exit status."""
    out, err = io.StringIO(), io.StringIO()
    tracemalloc.start()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = run()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return status, out.getvalue(), err.getvalue(), peak


def captured(function: Callable[[], Any]) -> tuple[int, str, str, int]:
    """``function`` run as every command runs it (`exit_status.run_command`)."""
    return traced(lambda: run_command(function, interrupted="")[0])


def finalize(out: Path) -> tuple[int, str, str, int]:
    """`python -m feature_extraction finalize --out OUT`, in this process."""
    return traced(lambda: main(["finalize", "--out", str(out)]))


# -- mutations ----------------------------------------------------------------------------------------------------


def json_mutations(doc: Any, limit: int | None = None) -> st.SearchStrategy[bytes]:  # noqa: ANN401 (JSON)
    """`fuzz_common.json_mutations` with this file's values."""
    return common_json_mutations(doc, WRONG, RAW, WHOLE, limit)


# -- a finished extraction, made once ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def extraction(tmp_path_factory: pytest.TempPathFactory, token_shards) -> Path:
    """Two shards of three images (the real shard writer), the record an extraction writes beside them, one
    shard's skipped list; `finalize` reads them all."""
    dpath = tmp_path_factory.mktemp("fuzz") / "shards"
    token_shards(dpath, [3, 3], D)
    record = {
        "backbone": "tiny",
        "layer": -1,
        "shard_size": 3,
        "n_images": 6,
        "n_shards": 2,
        "ids_sha256": "0" * 64,
        "weights": {"pretrained": False, "checkpoint_path": None, "seed": 0},
        "images": "samples",
        "key_scheme": "percent-escaped image id (feature_extraction.extract.image_key)",
        "backbone_record": {"name": "tiny", "library": "timm", "n_prefix_tokens": 1, "grid": [2, 2], "layer": -1},
        "package_version": "0",
        "token_selection": None,
    }
    (dpath / S.EXTRACTION_FNAME).write_text(json.dumps(seal(record)))  # sealed: an edited value is named too
    skipped = [{"image_id": "bad.png", "source": "/images/bad.png", "shard": 0, "reason": "cannot identify image"}]
    (dpath / S.skipped_fname(0)).write_text(json.dumps(skipped))
    status, _, err, _ = finalize(dpath)
    assert status == 0, err
    return dpath


@pytest.fixture()
def out(extraction: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(extraction, tmp_path / "shards"))


# -- the readers --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("examples", COUNTS)
@pytest.mark.parametrize(
    "fname", [S.EXTRACTION_FNAME, S.skipped_fname(0), S.sidecar_fname(0)], ids=["extraction", "skipped", "sidecar"]
)
def test_finalize_reads_each_file_it_is_handed_as_data(out: Path, fname: str, examples: int) -> None:
    """`finalize --out DIR` on a damaged `extraction.json`, `skipped-N.json` or sidecar."""
    fpath = out / fname
    valid = json.loads(fpath.read_text())
    limit = 1 << 20 if fname == S.EXTRACTION_FNAME else None
    outcomes = Outcomes()

    @fuzzed(examples)
    @given(json_mutations(valid, limit))
    def run(data: bytes) -> None:
        fpath.write_bytes(data)
        outcomes.check(finalize(out), fpath)

    run()
    outcomes.done()
    fpath.write_text(json.dumps(valid))
    assert finalize(out)[0] == 0  # the valid file still reads


@pytest.mark.parametrize("examples", COUNTS)
def test_manifest(out: Path, examples: int) -> None:
    """`load_manifest` (every reader of a shard directory: `fit`, `features`, `evaluate`), and `peek_manifest` /
    `extraction_record` (exports and checkpoints), which must not fail on any of it."""
    fpath = out / S.MANIFEST_FNAME
    valid = json.loads(fpath.read_text())
    outcomes = Outcomes()

    @fuzzed(examples)
    @given(json_mutations(valid))
    def run(data: bytes) -> None:
        fpath.write_bytes(data)
        outcomes.check(captured(lambda: S.load_manifest(out)), fpath)
        peeked = S.peek_manifest(out)
        assert peeked is None or isinstance(peeked, dict)
        record = S.extraction_record(peeked) if peeked is not None else None
        assert record is None or isinstance(record["layer"], int)

    run()
    outcomes.done()


def with_member(tar_fpath: Path, name: str, data: bytes, into: Path) -> Path:
    """A copy of the shard ``tar_fpath`` (at ``into``) whose member ``name`` holds ``data``."""
    with tarfile.open(tar_fpath) as tar, tarfile.open(into, "w", format=tarfile.USTAR_FORMAT) as copy_:
        for member in tar:
            body = data if member.name == name else tar.extractfile(member).read()
            member.size = len(body)
            copy_.addfile(member, io.BytesIO(body))
    return into


SHARD_READERS = {
    "stream": lambda fpath: list(R.iter_shard_tokens(fpath, with_positions=True, with_meta=True)),
    "browser": lambda fpath: list(R.read_shard_samples(fpath, [0, 2])),
    "webdataset": lambda fpath: list(R.iter_shard_samples([fpath], with_positions=True)),
}


@pytest.mark.parametrize("examples", COUNTS)
def test_meta_json_in_every_shard_reader(out: Path, tmp_path: Path, examples: int) -> None:
    """A sample's `meta.json` (written by the extraction: id, label, class, source, content hash) read by the
    training stream's reader, the feature browser's and webdataset's: one line naming the shard and member."""
    valid = {
        "image_id": "img000_000",
        "label": 0,
        "class_name": "zero",
        "source": "/images/img000_000.png",
        "image_xxh3_64": "0123456789abcdef",
    }
    name = "img000_000.meta.json"
    forged = tmp_path / "forged.tar"
    R.iter_shard_samples  # noqa: B018 (webdataset is imported on first use: before the allocation is traced)
    list(SHARD_READERS["webdataset"](with_member(out / S.shard_fname(0), name, json.dumps(valid).encode(), forged)))
    outcomes = Outcomes()

    @fuzzed(examples)
    @given(json_mutations(valid, limit=1 << 20))
    def run(data: bytes) -> None:
        with_member(out / S.shard_fname(0), name, data, forged)
        for read in SHARD_READERS.values():
            outcomes.check(captured(lambda read=read: read(forged)), forged, also="meta.json")

    run()
    outcomes.done()


@pytest.mark.parametrize("examples", COUNTS)
def test_lock_file(tmp_path: Path, examples: int) -> None:
    """An output's lock file (`OUT/.lock`): a live holder is refused, naming it; a damaged record (a pid that is
    no number, a host with escape codes) is a broken lock, refused naming the file to delete, its text escaped."""
    target = tmp_path / "out"
    target.mkdir()
    fpath = lock_fpath(target)
    valid = {
        "pid": os.getpid(),  # alive: refused
        "host": socket.gethostname(),
        "started": "2025-01-01 00:00:00 UTC",
        "command": "extract",
        "slurm_job_id": None,
        "slurm_restart_count": 0,
        "token": "0" * 32,
    }

    def hold() -> None:
        with output_lock(target, "fuzz"):
            pass

    outcomes = Outcomes()

    @fuzzed(examples)
    @given(json_mutations(valid, limit=64 << 10))
    def run(data: bytes) -> None:
        fpath.write_bytes(data)
        outcomes.check(captured(hold), fpath)

    run()
    outcomes.done()


@pytest.mark.parametrize(
    "text, reason",
    [
        ('{"pid": "abc", "host": "h"}', "field 'pid' must be a process id"),
        ('{"pid": 12, "host": "\\u001b[2Jh\\u0007"}', None),  # another host: a live holder, its name escaped
        ('{"host": "h"}', "lacks field 'pid'"),
        ('{"pid": 4194305, "host": "h", "command": ["x"]}', "field 'command' must be a string"),
    ],
)
def test_a_broken_lock_is_refused_naming_the_file_to_delete(tmp_path: Path, text: str, reason: str | None) -> None:
    target = tmp_path / "out"
    target.mkdir()
    fpath = lock_fpath(target)
    fpath.write_text(text)

    def hold() -> None:
        with output_lock(target, "extract"):
            pass

    status, _, err, _ = captured(hold)
    assert status == 2 and err.count("\n") == 1, err
    if reason is None:
        assert "on host \\x1b[2Jh\\x07 (another host" in err and f"delete {fpath} if that process is gone" in err, err
    else:
        assert f"is locked by {fpath}, which is broken ({reason}" in err, err
        assert f"delete {fpath} if no other process writes {target}" in err, err
    assert fpath.read_text() == text  # not taken over


@pytest.mark.parametrize(
    "forgery, message",
    [
        (renamed("../"), r"member '\.\./img000_000\.meta\.json' has an empty, '\.' or '\.\.'"),
        (renamed("/tmp/"), r"member '/tmp/img000_000\.meta\.json' is an absolute path"),
        (with_extra(tarfile.SYMTYPE, "/etc/passwd"), r"is a symbolic link to '/etc/passwd', not a regular file"),
        (with_extra(tarfile.LNKTYPE, "img000_000.tokens.npy"), r"is a hard link to .*, not a regular file"),
        (with_extra(tarfile.CHRTYPE, ""), r"member 'img000_000\.extra\.npy' is a character device"),
    ],
    ids=["dotdot", "absolute", "symlink", "hardlink", "device"],
)
def test_finalize_refuses_the_members_every_reader_refuses(out: Path, forgery: Any, message: str) -> None:
    """A shard whose sidecar was forged to vouch for a member no reader reads: `finalize` does not list it."""
    forge(out, 0, forgery)  # the tar rewritten, its sidecar (and the old manifest) updated to match it
    manifest = (out / S.MANIFEST_FNAME).read_bytes()
    status, _, err, _ = finalize(out)
    assert status == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: {out / S.shard_fname(0)}: ") and re.search(message, err), err
    assert "re-extract the shard" in err, err
    assert (out / S.MANIFEST_FNAME).read_bytes() == manifest
    assert not S.shard_is_intact(out, 0)  # so an extraction's rerun writes it again
