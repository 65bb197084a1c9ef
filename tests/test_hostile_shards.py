"""Hostile shards (issue 31, item 18): what a reader refuses, in one line, before allocating what a file declares.

Each case forges one thing in a finished shard directory (the tar rewritten with Python's
``tarfile``, the sidecar and manifest updated to vouch for it, as someone handing over forged
data would) or an HDF5 cache (``h5py``). Every reader of shards is run on it under
``tracemalloc``: it must raise one line naming the file, and its peak Python allocation (numpy
arrays and bytes included) stay far below what the file declares. Before the readers checked,
each case either read silently or asked for terabytes (a ``MemoryError``, or a virtual
allocation the peak shows). One case of each kind also runs through ``fit``: exit 2, one
``error:`` line, no traceback.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest
import xxhash
from in_process import QUIET, run

from feature_extraction import shards as S
from feature_extraction.h5cache import FORMAT_ATTR, TOKEN_CACHE_FORMAT, CacheFormatError, TokenCache
from feature_extraction.shards import read as R
from sae_pipeline.data.sources import ShardSource, open_source

D = 8
PEAK_LIMIT = 16 << 20  # bytes: the data is a few KB; what the forgeries declare is gigabytes to terabytes
TERA = 1 << 40


def npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def npy_header(shape: tuple[int, ...], descr: str = "<f2") -> bytes:
    """Only the header of a ``.npy`` declaring ``shape``: no data follows it."""
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": descr, "fortran_order": False, "shape": shape})
    return buffer.getvalue()


def header(name: str, size: int, kind: bytes = tarfile.REGTYPE, linkname: str = "") -> bytes:
    """A tar header for ``name`` declaring ``size`` bytes (GNU format: base-256 sizes above 8 GiB)."""
    info = tarfile.TarInfo(name)
    info.size, info.type, info.linkname, info.mtime = size, kind, linkname, 0
    return info.tobuf(format=tarfile.GNU_FORMAT)


def pad(data: bytes) -> bytes:
    return data + bytes(-len(data) % tarfile.BLOCKSIZE)


Member = tuple[bytes, bytes]  # (header blocks, data as stored)
Forgery = Callable[[list[tuple[str, bytes]]], list[Member]]


def regular(members: list[tuple[str, bytes]]) -> list[Member]:
    return [(header(name, len(data)), data) for name, data in members]


def forge(dpath: Path, index: int, forgery: Forgery) -> Path:
    """Rewrite shard ``index`` from ``forgery(its members)``; its sidecar and the manifest then vouch for it."""
    tar_fpath = dpath / S.shard_fname(index)
    with tarfile.open(tar_fpath) as tar:
        forged = forgery([(m.name, tar.extractfile(m).read()) for m in tar if m.isfile()])
    data = b"".join(head + pad(body) for head, body in forged) + bytes(2 * tarfile.BLOCKSIZE)
    tar_fpath.write_bytes(data)
    sha256, n_bytes = hashlib.sha256(data).hexdigest(), len(data)
    sidecar_fpath = dpath / S.sidecar_fname(index)
    sidecar = json.loads(sidecar_fpath.read_text())
    sidecar.update(sha256=sha256, bytes=n_bytes, xxh3_64=xxhash.xxh3_64_hexdigest(data))
    for suffix, digests in sidecar["sample_checksums"].items():  # the members' checksums, as a forger writes them
        if suffix != "algorithm":
            names = [head[:100].rstrip(b"\0").decode() for head, _ in forged]
            digests[:] = [
                xxhash.xxh3_64_hexdigest(body) for name, (_, body) in zip(names, forged) if name.endswith(suffix)
            ]
    sidecar_fpath.write_text(json.dumps(sidecar))
    manifest = json.loads((dpath / S.MANIFEST_FNAME).read_text())
    manifest["shards"][index].update(sha256=sha256, bytes=n_bytes)
    (dpath / S.MANIFEST_FNAME).write_text(json.dumps(manifest))
    return tar_fpath


def renamed(prefix: str) -> Forgery:
    """The first sample's members under ``prefix`` + their name: a path outside the shard."""

    def forgery(members: list[tuple[str, bytes]]) -> list[Member]:
        first = members[0][0].split(".")[0]
        return regular([(prefix + name if name.startswith(first + ".") else name, data) for name, data in members])

    return forgery


def with_extra(kind: bytes, linkname: str) -> Forgery:
    """An extra member of ``kind`` before the first sample's: skipped unseen, it once was."""

    def forgery(members: list[tuple[str, bytes]]) -> list[Member]:
        key = members[0][0].split(".")[0]
        return [(header(f"{key}.extra.npy", 0, kind, linkname), b""), *regular(members)]

    return forgery


def tokens_declaring(shape: tuple[int, int], member_size: int | None = None) -> Forgery:
    """The first sample's tokens.npy: a header declaring ``shape``, 64 bytes of data, ``member_size`` in the tar."""

    def forgery(members: list[tuple[str, bytes]]) -> list[Member]:
        out = regular(members)
        at = next(i for i, (name, _) in enumerate(members) if name.endswith(".tokens.npy"))
        body = npy_header(shape) + bytes(64)
        out[at] = (header(members[at][0], member_size or len(body)), body)
        return out

    return forgery


def pax_declaring(size: int) -> Forgery:
    """A pax extended header declaring ``size`` bytes before the first member (tarfile reads it whole)."""

    def forgery(members: list[tuple[str, bytes]]) -> list[Member]:
        return [(header("././@PaxHeader", size, tarfile.XHDTYPE), b"x" * 64), *regular(members)]

    return forgery


CASES = {
    "path outside the shard": (renamed("../"), r"member '\.\./img000_000\.meta\.json' has an empty, '\.' or '\.\.'"),
    "absolute path": (renamed("/tmp/"), r"member '/tmp/img000_000\.meta\.json' is an absolute path"),
    "symlink": (with_extra(tarfile.SYMTYPE, "/etc/passwd"), r"is a symbolic link to '/etc/passwd', not a regular"),
    "hard link": (with_extra(tarfile.LNKTYPE, "img000_000.tokens.npy"), r"is a hard link to .*, not a regular file"),
    "device": (with_extra(tarfile.CHRTYPE, ""), r"member 'img000_000\.extra\.npy' is a character device"),
    "member declaring a terabyte": (
        tokens_declaring((TERA // 2 // 1024, 1024), TERA + 128),
        rf"member 'img000_000\.tokens\.npy' declares {TERA + 128} bytes, more than the \d+ left in the shard file",
    ),
    ".npy header declaring 10^12 elements": (
        tokens_declaring((10**6, 10**6)),
        r"img000_000.*tokens\.npy'.*(declares tokens \[1000000, 1000000\], the manifest says \[5, 8\]|"
        r"declares float16 \[1000000, 1000000\] = 2000000000000 bytes, the member holds 64)",
    ),
    "pax header declaring a terabyte": (pax_declaring(TERA), rf"declares {TERA} bytes of extended header"),
}


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory, token_shards) -> Path:
    dpath = tmp_path_factory.mktemp("hostile") / "shards"
    token_shards(dpath, [3, 3], D)
    return dpath


@pytest.fixture()
def shards(clean: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(clean, tmp_path / "shards"))


def stream(dpath: Path) -> None:
    """The training stream and the feature browser's labels (``ShardUnit``: tokens, positions, meta.json)."""
    for unit in ShardSource(dpath).units("all", 0.0):
        for _ in unit.read(0, unit.n_tokens, with_ids=True):
            pass


def webdataset(dpath: Path) -> None:
    """webdataset's reader (the evaluation's probing labels)."""
    for _ in R.iter_shard_samples(S.shard_fpaths(dpath, S.load_manifest(dpath)), with_positions=True):
        pass


def browser(dpath: Path) -> None:
    """The feature browser's re-read of a few samples (heatmaps, TensorBoard tiles)."""
    for _ in R.read_shard_samples(dpath / S.shard_fname(0), [0, 2]):
        pass


def refused_within_bounded_memory(read: Callable[[], None], error: type[Exception], message: str) -> str:
    """``read()`` raises ``error`` with one line matching ``message``; its peak allocation stays below PEAK_LIMIT."""
    tracemalloc.start()
    try:
        with pytest.raises(error) as info:
            read()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert re.search(message, str(info.value)), str(info.value)
    assert "\n" not in str(info.value)
    assert peak < PEAK_LIMIT, f"peak allocation {peak} bytes"
    return str(info.value)


@pytest.mark.parametrize("reader", [stream, webdataset, browser], ids=lambda f: f.__name__)
@pytest.mark.parametrize("case", list(CASES))
def test_a_reader_refuses_a_hostile_shard_in_one_line_within_bounded_memory(
    shards: Path, case: str, reader: Callable[[Path], None]
) -> None:
    forgery, message = CASES[case]
    tar_fpath = forge(shards, 0, forgery)
    line = refused_within_bounded_memory(lambda: reader(shards), S.ShardFormatError, message)
    assert line.startswith(f"{tar_fpath}: ") and "re-extract" in line, line


def test_a_sidecar_declaring_more_than_its_shard_is_refused_unparsed(shards: Path) -> None:
    """A 64 MiB sidecar beside a 10 KB shard (valid JSON, padded): refused by its size, never parsed."""
    sidecar_fpath = shards / S.sidecar_fname(1)
    text = sidecar_fpath.read_text()
    sidecar_fpath.write_text("{" + " " * (64 << 20) + text[1:])
    message = r"shard-000001\.json: sidecar is \d+ bytes, more than the \d+ it can take beside its shard"
    refused_within_bounded_memory(lambda: stream(shards), S.ShardFormatError, message)
    with pytest.raises(S.ShardFormatError, match=message):
        S.read_sidecar(shards, 1)  # what finalize and a rerun read


def test_a_sidecar_or_manifest_declaring_more_samples_than_the_shard_holds_is_refused(shards: Path) -> None:
    sidecar_fpath = shards / S.sidecar_fname(1)
    sidecar = json.loads(sidecar_fpath.read_text())
    sidecar_fpath.write_text(json.dumps({**sidecar, "count": 10**9, "n_tokens": 5 * 10**9}))
    with pytest.raises(S.ShardFormatError, match=r"shard-000001\.json: declares 1000000000 samples .* more than"):
        S.read_sidecar(shards, 1)
    manifest = json.loads((shards / S.MANIFEST_FNAME).read_text())
    manifest["shards"][1].update(count=10**9, n_tokens=5 * 10**9)
    manifest.update(n_images=3 + 10**9, n_tokens=15 + 5 * 10**9)
    (shards / S.MANIFEST_FNAME).write_text(json.dumps(manifest))
    with pytest.raises(S.ShardFormatError, match=r"shard 'shard-000001\.tar' declares 1000000000 samples of \[5, 8\]"):
        S.load_manifest(shards)


@pytest.mark.parametrize("reader", [stream, webdataset, browser], ids=lambda f: f.__name__)
def test_a_positions_header_declaring_10_12_elements_is_refused(tmp_path: Path, reader: Callable) -> None:
    rng = np.random.default_rng(0)
    samples = [
        (f"img{i}", rng.standard_normal((3, D)).astype(np.float16), {}, np.array([0, 2, 4], np.int16)) for i in range(3)
    ]
    S.write_shard(tmp_path, 0, samples)
    selection = {"patches_per_image": 2, "keep_prefix_tokens": True, "seed": 0}
    S.write_manifest(
        tmp_path,
        n_shards=1,
        spec={"name": "tiny"},
        layer=0,
        tokens_per_image=3,
        n_prefix_tokens=1,
        grid=(2, 2),
        token_selection=selection,
    )

    def forgery(members: list[tuple[str, bytes]]) -> list[Member]:
        forged = npy_header((10**12,), "<i4") + bytes(64)
        return regular([(name, forged if name == "img0.positions.npy" else data) for name, data in members])

    tar_fpath = forge(tmp_path, 0, forgery)
    message = r"img0.*positions\.npy'.*declares int32 \[1000000000000\] = 4000000000000 bytes, the member holds 64"
    line = refused_within_bounded_memory(lambda: reader(tmp_path), S.ShardFormatError, message)
    assert line.startswith(f"{tar_fpath}: "), line


def absurd_cache(fpath: Path, rows: int = 10**12, **extra: tuple[int, ...]) -> Path:
    """A token cache declaring ``rows`` x D float16 tokens (chunked, nothing written: a few KB on disk)."""
    with h5py.File(fpath, "w") as h5:
        h5.attrs[FORMAT_ATTR] = TOKEN_CACHE_FORMAT
        h5.create_dataset("tokens", shape=(rows, D), dtype=np.float16, chunks=(min(rows, 1024), D))
        for name, shape in extra.items():
            h5.create_dataset(name, shape=shape, dtype=np.int32, chunks=True)
    return fpath


def test_an_hdf5_cache_with_absurd_dimensions_is_refused_before_a_row_is_read(tmp_path: Path) -> None:
    fpath = absurd_cache(tmp_path / "absurd.h5")
    message = r"absurd\.h5: dataset 'tokens' declares \[1000000000000, 8\] float16 = 16000000000000 bytes in a file"
    refused_within_bounded_memory(lambda: open_source(str(fpath)), CacheFormatError, message)
    ids = absurd_cache(tmp_path / "ids.h5", rows=4, token_positions=(10**12,))
    with pytest.raises(CacheFormatError, match=r"dataset 'token_positions' is \[1000000000000\], expected \[4\]"):
        TokenCache(ids)


FIT = [
    "fit",
    "--data.batch_size",
    "5",
    "--data.val_fraction",
    "0.5",
    "--data.num_workers",
    "0",
    "--data.shuffle_buffer_tokens",
    "10",
    "--trainer.max_epochs",
    "1",
    "--trainer.accelerator",
    "cpu",
    "--trainer.logger",
    "false",
    "--model.sae.class_path",
    "TopKSAE",
    "--model.sae.init_args.d_sae",
    "16",
    "--model.sae.init_args.k",
    "2",
    *QUIET,
]


@pytest.mark.parametrize(
    "case",
    ["path outside the shard", "symlink", "member declaring a terabyte", ".npy header declaring 10^12 elements"],
)
def test_fit_on_a_hostile_shard_is_one_error_line_and_exit_2(
    shards: Path, tmp_path: Path, case: str, capsys, monkeypatch
) -> None:
    forgery, message = CASES[case]
    forge(shards, 0, forgery)
    monkeypatch.chdir(tmp_path)
    status, _, err = run([*FIT, "--data.source", str(shards), "--checkpoint.dirpath", str(tmp_path / "ckpt")], capsys)
    lines = [line for line in err.splitlines() if line.strip() and " INFO " not in line and " WARNING " not in line]
    assert status == 2 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert lines[0].startswith(f"error: ShardFormatError: {shards / S.shard_fname(0)}: "), lines[0]
    assert re.search(message, lines[0]), lines[0]


@pytest.mark.parametrize("what", ["sidecar", "hdf5"])
def test_fit_on_a_forged_sidecar_or_cache_is_one_error_line_and_exit_2(
    shards: Path, tmp_path: Path, what: str, capsys, monkeypatch
) -> None:
    if what == "sidecar":
        source, fpath = shards, shards / S.sidecar_fname(0)
        fpath.write_text("{" + " " * (64 << 20) + fpath.read_text()[1:])
    else:
        source = fpath = absurd_cache(tmp_path / "absurd.h5")
    monkeypatch.chdir(tmp_path)
    status, _, err = run([*FIT, "--data.source", str(source), "--checkpoint.dirpath", str(tmp_path / "ckpt")], capsys)
    lines = [line for line in err.splitlines() if line.strip() and " INFO " not in line and " WARNING " not in line]
    assert status == 2 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert lines[0].startswith("error: ") and f"{fpath}: " in lines[0] and "forged" in lines[0], lines[0]
