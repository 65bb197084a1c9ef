"""``evaluate sae`` reads the validation split block by block: the same numbers, without holding the split.

``python -m benchmarks.scaling``'s ``memory_tokens`` curve showed ``python -m sae_pipeline.evaluate sae``'s peak
memory growing with the number of tokens: the whole split was read into one tensor first.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch

from feature_extraction import shards as S
from sae_pipeline.data.sample import iter_sample, read_sample
from sae_pipeline.data.sources import open_source
from sae_pipeline.data.validation import validation_split, validation_tokens
from sae_pipeline.evaluate import sae_dir, studies
from sae_pipeline.evaluate.studies import reconstruction_r2
from sae_pipeline.metrics import measure
from sae_pipeline.metrics.measure import evaluate_sae
from tests.features_fixtures import write_export

D, TOKENS_PER_IMAGE = 128, 32


@pytest.fixture(scope="module")
def shards(tmp_path_factory):  # noqa: ANN201
    """20 shards x 16 images x 32 tokens, d 128: a validation split (half) of 2.5 MiB in float32."""
    dpath = tmp_path_factory.mktemp("split") / "shards"
    rng = np.random.default_rng(0)
    for index in range(20):
        samples = [
            (f"img{index:03d}_{i:02d}", rng.standard_normal((TOKENS_PER_IMAGE, D)).astype(np.float16), {})
            for i in range(16)
        ]
        S.write_shard(dpath, index, samples)
    S.write_manifest(
        dpath,
        n_shards=20,
        spec={"name": "test"},
        layer=0,
        tokens_per_image=TOKENS_PER_IMAGE,
        n_prefix_tokens=0,
        grid=(4, 8),
    )
    return dpath


@pytest.fixture(scope="module")
def sae(tmp_path_factory):  # noqa: ANN201
    from sae_pipeline.sae import TopKSAE

    torch.manual_seed(0)
    model = TopKSAE(d_in=D, d_sae=96, k=4).eval()
    return model, write_export(model, tmp_path_factory.mktemp("sae") / "sae")


@pytest.mark.parametrize("max_tokens", [None, 3000])
def test_blocks_are_the_tensors_blocks(shards, max_tokens) -> None:
    x = validation_tokens(str(shards), 0.5, max_tokens)
    split = validation_split(str(shards), 0.5, max_tokens)
    assert split.shape == x.shape and split.ndim == 2
    for rows in (1000, 2048, len(x) + 5):
        got, expected = list(split.split(rows)), list(x.split(rows))
        assert len(split.split(rows)) == len(expected) == len(got)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        assert [len(b) for b in got] == [len(b) for b in split.split(rows)]  # a second pass reads it again


@pytest.mark.slow
def test_evaluate_sae_dir_gives_the_in_memory_numbers(shards, sae, monkeypatch) -> None:
    model, dpath = sae
    monkeypatch.setattr(measure, "_CHUNK_ELEMENTS", 2**16)  # several blocks: 682 rows each
    results, _ = sae_dir.evaluate_sae_dir(dpath, str(shards), 0.5, k_infer=[2, 4], r_max=8, max_tokens=1500)
    x = validation_tokens(str(shards), 0.5, 1500)  # an even sample over the split's shards
    report = evaluate_sae(model, x, 8, ks=[2, 4])
    assert results["n_eval_tokens"] == len(x) == 1500
    assert results["r2"] == reconstruction_r2(model, x)
    assert results["l0"] == report["l0"] and results["inference"]["r2"] == report["r2_by_k"]
    assert results["babel_coactive"] == report["babel_coactive"].tolist()
    assert results["dead_fraction_eval"] == float((report["frequency"] == 0).double().mean())


@pytest.mark.slow
def test_evaluate_sae_dir_never_holds_the_split(shards, sae, monkeypatch) -> None:
    _, dpath = sae
    monkeypatch.setattr(measure, "_CHUNK_ELEMENTS", 2**14)  # blocks of 170 rows
    monkeypatch.setattr(studies, "_CHUNK", 256)
    split_bytes = 10 * 16 * TOKENS_PER_IMAGE * D * 4  # 2.5 MiB
    tracemalloc.start()  # numpy's buffers are traced (the tokens read); torch's own allocations are not
    try:
        sae_dir.evaluate_sae_dir(dpath, str(shards), 0.5, k_infer=[4], r_max=8)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < split_bytes / 2, f"peak {peak / 2**20:.2f} MiB traced for a 2.5 MiB split"


def test_an_empty_split_is_refused_with_one_message_naming_no_function(shards) -> None:
    units = open_source(str(shards)).units("val", 0.0)  # val_fraction 0: training keeps every shard
    assert units == []
    for sample in (lambda: read_sample(units, 8), lambda: list(iter_sample(units, 8))):
        with pytest.raises(ValueError, match=r"^the split to sample holds no tokens .*set --data.val_fraction above 0"):
            sample()
