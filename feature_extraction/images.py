"""Image sources for feature extraction: an ImageNet-style folder, webdataset tars, samples.

`list_images` turns a source into a sorted list of `ImageRecord`s with stable ids (the
shard assignment depends on that order, so a rerun or another SLURM task sees the same
list). `ImageDataset` decodes one record per item inside DataLoader workers; an image
that cannot be decoded, or whose mode has no conversion to RGB (`image_modes`, which says
how each mode becomes 8-bit RGB), yields `None` and the reason instead of raising, so one
bad file among 1.28 M never stops an extraction, and `collate_images` hands the failures to
the caller to count and list in the manifest's `skipped`.

Each decoded image also yields `content_hash` of the bytes it was decoded from (xxh3-64 of
the file or tar member as read; of the pixel array for the bundled samples), which the
extraction stores in the sample's `meta.json` as `image_xxh3_64`: the feature browser
re-reads the image and draws it only when the hash still matches, so an image replaced
after extraction is never shown with another image's activations.

Tar members are indexed once here (data offset and size via `tarfile`); workers then
read a member with one positioned read (`os.pread`) on a per-process file descriptor,
without parsing the tar again.
"""

from __future__ import annotations

import io
import logging
import os
import re
import tarfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import xxhash
from PIL import Image
from torch import Tensor

from feature_extraction.image_modes import to_rgb

__all__ = [
    "CONTENT_HASH_KEY",
    "IMAGE_EXTENSIONS",
    "SAMPLE_NAMES",
    "ImageDataset",
    "ImageRecord",
    "collate_images",
    "content_hash",
    "list_images",
    "sample_array",
]

logger = logging.getLogger(__name__)

# The `meta.json` key of an image's content hash (`content_hash` of the bytes it was decoded from).
CONTENT_HASH_KEY = "image_xxh3_64"

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".ppm", ".pgm")
# Webdataset member extensions that hold an image, in order of preference for one key.
_TAR_IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
# Photographs bundled inside scikit-image (no download); grey ones are converted to RGB.
SAMPLE_NAMES = (
    "astronaut",
    "brick",
    "camera",
    "chelsea",
    "clock",
    "coffee",
    "coins",
    "grass",
    "gravel",
    "hubble_deep_field",
    "immunohistochemistry",
    "moon",
    "retina",
    "rocket",
)


@dataclass
class ImageRecord:
    """One image: a stable id, where to read it, and its class label if the source has one."""

    image_id: str
    source: str  # file path, tar path, or "samples"
    label: int | None
    kind: Literal["file", "tar", "samples"] = "file"
    member: str | None = None  # tar member name, or the skimage.data function for samples
    offset: int | None = None  # byte offset of a tar member's data
    size: int | None = None  # byte size of a tar member's data
    class_name: str | None = None  # the class sub-folder name behind `label`


def list_images(source: str) -> list[ImageRecord]:
    """All images of `source`, sorted by id.

    `source` is "samples" (scikit-image's bundled photos; pass "./samples" for a folder
    of that name), a directory holding `*.tar` webdataset shards (or one `.tar` file),
    or an image folder: class sub-folders (sorted) give labels 0..C-1, a flat folder
    gives label None; ids are posix paths relative to the folder.
    """
    if source == "samples":
        return [ImageRecord(name, "samples", None, kind="samples", member=name) for name in sorted(SAMPLE_NAMES)]
    path = Path(source)
    if path.is_file() and path.suffix == ".tar":
        records = _list_tar(path)
    elif path.is_file():
        kind = "an image" if path.suffix.lower() in IMAGE_EXTENSIONS else f"a {path.suffix or 'extension-less'} file"
        raise ValueError(
            f"--images {source}: is {kind}, not an image folder; give the folder that holds the "
            "images (class sub-folders give labels), a directory of .tar shards, a .tar, or 'samples'"
        )
    elif path.exists() and not path.is_dir():
        raise ValueError(
            f"--images {source}: is neither a folder nor a file; give an image folder, a directory "
            "of .tar shards, or 'samples'"
        )
    elif not path.is_dir():
        raise ValueError(
            f"--images {source}: does not exist; give an image folder, a directory of .tar shards, or 'samples'"
        )
    elif tars := sorted(p for p in path.glob("*.tar") if p.is_file()):
        records = [record for tar in tars for record in _list_tar(tar)]
    else:
        records = _list_folder(path)
    if not records:
        raise ValueError(
            f"images source {source!r} holds no images; expected files ending in "
            f"{', '.join(IMAGE_EXTENSIONS)} (optionally in class sub-folders) or "
            f".tar shards with {'/'.join(_TAR_IMAGE_EXTENSIONS)} members"
        )
    records.sort(key=lambda r: r.image_id)
    return records


def _is_image(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_EXTENSIONS and not path.name.startswith(".")


def _files_under(root: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        files += [Path(dirpath, f) for f in filenames if _is_image(Path(f))]
    return files


def _list_folder(root: Path) -> list[ImageRecord]:
    """ImageNet-style layout, as torchvision's ImageFolder reads it."""
    class_dirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    top_images = [p for p in root.iterdir() if p.is_file() and _is_image(p)]
    if not class_dirs:
        return [ImageRecord(p.relative_to(root).as_posix(), str(p), None) for p in top_images]
    if top_images:
        warnings.warn(
            f"{root}: {len(top_images)} images beside the class sub-folders are ignored; move them into a class folder",
            stacklevel=3,
        )
    return [
        ImageRecord(p.relative_to(root).as_posix(), str(p), label, class_name=class_dir.name)
        for label, class_dir in enumerate(class_dirs)
        for p in _files_under(class_dir)
    ]


_ADDRESS = re.compile(r" ?<[^<>]* at 0x[0-9a-fA-F]+>")
# webdataset's key/extension split: the key is the path up to the first dot of the basename.
_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")


def _list_tar(tar_path: Path) -> list[ImageRecord]:
    """Index a webdataset tar: one record per key with an image member; `.cls` gives the label."""
    images: dict[str, tarfile.TarInfo] = {}
    labels: dict[str, int] = {}
    try:
        with tarfile.open(tar_path, "r:") as tar:
            for member in tar:
                match = _KEY_EXT.match(member.name)
                if not member.isfile() or match is None:
                    continue
                key, ext = match.group(1), match.group(2).lower()
                if ext == "cls":
                    labels[key] = _read_label(tar, member, tar_path)
                elif ext in _TAR_IMAGE_EXTENSIONS:
                    kept = images.get(key)
                    rank = _TAR_IMAGE_EXTENSIONS.index
                    if kept is None or rank(ext) < rank(_KEY_EXT.match(kept.name).group(2).lower()):
                        images[key] = member
    except (tarfile.TarError, OSError) as error:
        raise ValueError(f"images tar {str(tar_path)!r} cannot be read ({error}); re-create or remove it") from error
    return [
        ImageRecord(
            f"{tar_path.stem}/{key}",
            str(tar_path),
            labels.get(key),
            kind="tar",
            member=info.name,
            offset=info.offset_data,
            size=info.size,
        )
        for key, info in images.items()
    ]


def _read_label(tar: tarfile.TarFile, member: tarfile.TarInfo, tar_path: Path) -> int:
    text = tar.extractfile(member).read().decode("utf-8", errors="replace").strip()
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"images tar {str(tar_path)!r}: member {member.name!r} must hold an integer class label, got {text[:20]!r}"
        ) from None


def content_hash(data: bytes) -> str:
    """xxh3-64 of an image's bytes as 16 hex digits (fast: the hash costs nothing beside the decode)."""
    return xxhash.xxh3_64_hexdigest(data)


def sample_array(name: str) -> np.ndarray:
    """One of scikit-image's bundled photos (`SAMPLE_NAMES`) as a C-contiguous array."""
    import skimage.data

    return np.ascontiguousarray(getattr(skimage.data, name)())


class ImageDataset(torch.utils.data.Dataset):
    """Map-style dataset over records.

    Item i is `(i, pixels, content hash)`, or `(i, None, why)` when the image cannot be read, logged as a
    warning unless `log_skips` is False (a caller that reports the skipped images itself: one line each).
    """

    def __init__(
        self, records: list[ImageRecord], preprocess: Callable[[Image.Image], Tensor], log_skips: bool = True
    ) -> None:
        self.records = records
        self.preprocess = preprocess
        self.log_skips = log_skips
        self._fds: dict[str, int] = {}  # open tar files of this process
        self._fds_pid = os.getpid()

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> tuple[int, Tensor | None, str]:
        record = self.records[i]
        try:
            image, digest = self._decode(record)
        except Exception as error:  # PIL raises OSError, SyntaxError, ValueError, EOFError, ...
            # Without object addresses ("<_io.BytesIO object at 0x...>"): reruns and task splits list the same reason.
            why = f"{type(error).__name__}: {_ADDRESS.sub('', str(error))}".strip()
            if self.log_skips:
                logger.warning("skipping unreadable image %s (%s)", record.image_id, why)
            return i, None, why
        return i, self.preprocess(image), digest

    def _decode(self, record: ImageRecord) -> tuple[Image.Image, str]:
        if record.kind == "samples":
            array = sample_array(record.member)
            return to_rgb(Image.fromarray(array)), content_hash(array.tobytes())
        if record.kind == "tar":
            data = self._read_member(record)
        else:
            data = Path(record.source).read_bytes()
        with Image.open(io.BytesIO(data)) as image:
            image.load()  # decode now: truncated data raises here, not later in a transform
            return to_rgb(image), content_hash(data)

    def _read_member(self, record: ImageRecord) -> bytes:
        if self._fds_pid != os.getpid():  # a forked worker: open its own descriptors
            self._fds, self._fds_pid = {}, os.getpid()
        fd = self._fds.get(record.source)
        if fd is None:
            fd = self._fds[record.source] = os.open(record.source, os.O_RDONLY)
        data = os.pread(fd, record.size, record.offset)
        if len(data) != record.size:
            raise OSError(f"tar member {record.member} is truncated")
        return data

    def __getstate__(self) -> dict[str, Any]:  # spawn-started workers open their own files
        return {**self.__dict__, "_fds": {}, "_fds_pid": -1}

    def __del__(self) -> None:
        try:
            if self._fds_pid == os.getpid():
                for fd in self._fds.values():
                    os.close(fd)
        except Exception:  # interpreter shutdown or a half-built object: nothing to release
            pass


def collate_images(
    batch: list[tuple[int, Tensor | None, str]],
) -> tuple[list[int], Tensor | None, list[int], list[str], list[str]]:
    """Split a batch: decoded indices, their stacked pixels, failed indices, hashes of `ok`, reasons of `failed`."""
    ok = [i for i, pixels, _ in batch if pixels is not None]
    failed = [i for i, pixels, _ in batch if pixels is None]
    pixels = torch.stack([p for _, p, _ in batch if p is not None]) if ok else None
    hashes = [note for _, p, note in batch if p is not None]
    reasons = [note for _, p, note in batch if p is None]
    return ok, pixels, failed, hashes, reasons
