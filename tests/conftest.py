"""Shared test settings and fixtures: small thread counts keep the suite stable on a 2-core machine."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import fork_server  # noqa: F401  (imported first: its BASE_ENV is the suite's starting environment)
import numpy as np
import pytest

# The S3 server fixtures (tests/s3_fixtures.py), for any test module; the two-worker rules (tests/parallel.py).
pytest_plugins = ["s3_fixtures", "parallel"]

REPO_DPATH = Path(__file__).resolve().parents[1]
TINY_TOKENS_PER_IMAGE = 5  # 1 prefix token + a 2x2 grid of patches

Sample = tuple[str, np.ndarray, dict]


@pytest.fixture(scope="session")
def reference_dictionary_fpath() -> Path:
    """The paper authors' released MNIST MP-SAE, shipped inside the package."""
    from sae_pipeline.evaluate.external import REFERENCE_NPZ_FPATH

    assert REFERENCE_NPZ_FPATH.is_file(), f"missing {REFERENCE_NPZ_FPATH}: it ships with the package"
    return REFERENCE_NPZ_FPATH


def write_token_shards(
    dpath: Path, counts: Sequence[int], d: int, *, scale: float = 1.0, offset: float = 0.0, seed: int = 0
) -> list[list[Sample]]:
    """A finished shard directory of random tokens, written and finalized by the real shard format.

    Shard ``i`` holds ``counts[i]`` images of 5 float16 tokens (1 prefix token + a 2x2 grid) drawn
    as ``scale * N(0, 1) + offset`` of dimension ``d``; image ids ``img{shard:03d}_{image:03d}``
    sort in writing order; meta ``{"label": image}``. Returns each shard's samples
    ``(id, tokens, meta)``, so a test can tell which token came from where.
    """
    from feature_extraction.shards import write_manifest, write_shard

    rng = np.random.default_rng(seed)
    per_shard = []
    for index, count in enumerate(counts):
        samples = [
            (
                f"img{index:03d}_{i:03d}",
                (scale * rng.standard_normal((TINY_TOKENS_PER_IMAGE, d)) + offset).astype(np.float16),
                {"label": i},
            )
            for i in range(count)
        ]
        write_shard(dpath, index, samples)
        per_shard.append(samples)
    write_manifest(
        dpath,
        n_shards=len(counts),
        spec={"name": "tiny"},
        layer=-1,
        tokens_per_image=TINY_TOKENS_PER_IMAGE,
        n_prefix_tokens=1,
        grid=(2, 2),
    )
    return per_shard


@pytest.fixture(scope="session")
def token_shards() -> Callable[..., list[list[Sample]]]:
    """:func:`write_token_shards`, for tests and fixtures of any scope (call it with their own directory)."""
    return write_token_shards
