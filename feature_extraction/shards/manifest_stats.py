"""The manifest's normalisation statistics, checked against the sidecars they were merged from.

``fit`` scales its inputs by ``sqrt(d / E‖x‖²)`` and starts ``b_pre`` at the mean, both read from
``manifest.json`` field ``stats``. A manifest edited by hand (or by a script) that leaves the
shards alone would otherwise train on the wrong scale without a word: a ``mean_sq_norm`` raised
from 1 to 5·10⁶ trains with input scale 0.00044 and leaves most latents dead, exit 0. So
:func:`check_manifest_stats` (run by ``load_manifest``, hence by every ``fit`` on shards and by
``finalize``'s is-the-manifest-current test) merges the sidecars' float64 running sums again, as
``write_manifest`` does: a few hundred small JSON files, no token is read. A difference beyond
the tolerance below is one ``ShardFormatError`` naming the field, both values and the fix
(``python -m feature_extraction finalize --out DIR`` rewrites the manifest from the sidecars).

Tolerance: the manifest and this check sum the same float64 numbers in the same order, so they
agree exactly; the bound only absorbs another summation order. ``n_tokens`` must be equal;
``mean_sq_norm`` within a relative :data:`RTOL`; each dimension of ``mean`` within :data:`RTOL`
times the tokens' root-mean-square per dimension, ``sqrt(E‖x‖² / d)`` (a relative test would
fail on a dimension whose mean is ~0).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from feature_extraction.running_stats import RunningStats
from feature_extraction.shards.layout import EXTRACTION_FNAME, MANIFEST_FNAME, ShardFormatError, sidecar_fpath
from feature_extraction.shards.sidecar import load_sidecar
from feature_extraction.store import location

__all__ = ["RTOL", "check_manifest_stats", "sidecar_stats"]

RTOL = 1e-6


def sidecar_stats(shards_dpath: Path, manifest: dict) -> RunningStats:
    """The statistics of the manifest's shards, merged from their sidecars (as ``write_manifest`` merges them)."""
    stats = RunningStats(0)
    for entry in manifest["shards"]:
        fpath = sidecar_fpath(location(shards_dpath) / entry["fname"])
        if not fpath.is_file():
            raise ShardFormatError(
                f"{fpath}: sidecar missing, so the statistics in {MANIFEST_FNAME} cannot be "
                f"checked; restore it or re-extract the shard"
            )
        sidecar = load_sidecar(fpath)  # its size checked before the parse
        try:
            stats = stats.merge(RunningStats.from_json(sidecar["stats"]))
        except (KeyError, ValueError) as exn:
            raise ShardFormatError(f"{fpath}: field 'stats' is unreadable ({exn}); re-extract the shard") from None
    return stats


def check_manifest_stats(shards_dpath: Path | str, manifest: dict) -> None:
    """Raise a one-line ``ShardFormatError`` where ``manifest["stats"]`` disagrees with the sidecars."""
    shards_dpath = location(shards_dpath)
    stats = sidecar_stats(shards_dpath, manifest)
    field = manifest["stats"]
    where = f"{shards_dpath / MANIFEST_FNAME}: field 'stats.%s' is %s but the shards' sidecars give %s"
    if stats.n_tokens == 0 or field["n_tokens"] != stats.n_tokens:
        raise ShardFormatError(f"{where % ('n_tokens', field['n_tokens'], stats.n_tokens)}; {_fix(shards_dpath)}")
    expected_sq = stats.mean_sq_norm()
    written_sq = _number(field["mean_sq_norm"])
    if not (math.isfinite(written_sq) and abs(written_sq - expected_sq) <= RTOL * abs(expected_sq)):
        raise ShardFormatError(f"{where % ('mean_sq_norm', field['mean_sq_norm'], expected_sq)}; {_fix(shards_dpath)}")
    expected_mean = stats.mean()
    try:
        written_mean = np.asarray(field["mean"], np.float64)
    except (TypeError, ValueError):
        written_mean = np.full(1, np.nan)
    if written_mean.shape != expected_mean.shape:
        raise ShardFormatError(
            f"{where % ('mean', f'{written_mean.size} numbers', f'{expected_mean.size}')}; {_fix(shards_dpath)}"
        )
    scale = RTOL * math.sqrt(expected_sq / max(1, expected_mean.size))
    off = np.abs(written_mean - expected_mean)
    off[~np.isfinite(off)] = np.inf
    if off.max() > scale:
        worst = int(np.argmax(off))
        values = (f"[{worst}] = {float(written_mean[worst])!r}", f"{float(expected_mean[worst])!r}")
        raise ShardFormatError(f"{where % ('mean', *values)}; {_fix(shards_dpath)}")


def _number(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    return float(value)


def _fix(shards_dpath: Path) -> str:
    """Rewrite the manifest from the sidecars: ``finalize`` where the directory has its extraction record."""
    if (shards_dpath / EXTRACTION_FNAME).is_file():
        return (
            f"the manifest was edited or is stale: run `python -m feature_extraction finalize --out "
            f"{shards_dpath}` to rewrite it from the sidecars"
        )
    return (
        f"the manifest was edited or is stale, and without {EXTRACTION_FNAME} `finalize` cannot rebuild it: "
        "rewrite it with feature_extraction.shards.write_manifest (as the code that wrote these shards did) or "
        "re-extract"
    )
