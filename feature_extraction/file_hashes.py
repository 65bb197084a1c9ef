"""Digests of whole files, read once in chunks: sha256 for records others check, xxh3-64 where speed counts.

Beside :mod:`feature_extraction.atomic_files`: what one writes whole, the other checks whole. A shard's
sidecar records both digests of its tar (``shards/integrity.py``), the manifest's ``verify`` and an
export's ``weights_sha256`` the sha256.

Weights are also compared by content, whatever file held them: `tensors_sha256` hashes named
tensors themselves, so a ``.safetensors`` file, a torch state dict and a download of the same numbers
agree (the manifest's ``backbone.weights_sha256``, a feature site's ``sae_sha256``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import xxhash

from feature_extraction.store import location

__all__ = ["file_digests", "file_sha256", "hash_file", "short_digest", "tensors_sha256"]

_CHUNK_BYTES = 1 << 22


def hash_file(fpath: Path | str, *hashers: Any) -> list[str]:
    """Hex digests of a whole file for each of ``hashers`` (``hashlib`` or ``xxhash`` objects), in one read.

    ``fpath`` may name an object in a store (a URL or a `RemotePath`): it is fetched whole, then hashed.
    """
    with location(fpath).open("rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            for hasher in hashers:
                hasher.update(chunk)
    return [hasher.hexdigest() for hasher in hashers]


def file_digests(fpath: Path | str) -> tuple[str, str]:
    """``(sha256, xxh3_64)`` hex digests of a whole file, in one read."""
    sha, xxh = hash_file(fpath, hashlib.sha256(), xxhash.xxh3_64())
    return sha, xxh


def file_sha256(fpath: Path | str) -> str:
    return hash_file(fpath, hashlib.sha256())[0]


def tensors_sha256(tensors: Mapping[str, Any]) -> str:
    """sha256 over named tensors in sorted name order: each name, dtype, shape and raw bytes.

    The numbers decide it, not the file they came from (format, key order, a download or a seed).
    """
    import torch

    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}\0{tensor.dtype}\0{list(tensor.shape)}\0".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def short_digest(digest: str) -> str:
    """The first 12 hex digits, as error lines name a digest (enough to tell two apart)."""
    return digest[:12]
