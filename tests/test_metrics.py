"""Metrics against plain reference implementations (numpy float64, python loops, itertools)."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
import torch

from sae_pipeline.evaluate.external import REFERENCE_NPZ_FPATH
from sae_pipeline.metrics import ActivationStats, ReconstructionR2, babel, babel_coactive, dead_fraction, l0

REFERENCE_FPATH = REFERENCE_NPZ_FPATH  # the paper authors' MNIST MP-SAE, shipped in the package


# ---------------------------------------------------------------- plain references


def r2_reference(x: np.ndarray, x_hat: np.ndarray) -> float:
    x = x.astype(np.float64)
    x_hat = x_hat.astype(np.float64)
    return 1.0 - ((x - x_hat) ** 2).sum() / ((x - x.mean(axis=0)) ** 2).sum()


def babel_reference(W: np.ndarray, r_max: int) -> np.ndarray:
    """Literal definition: for each j sort |<d_i, d_j>| over i != j, cumulative sums, max over j."""
    W = W.astype(np.float64)
    W = W / np.linalg.norm(W, axis=1, keepdims=True)
    gram = np.abs(W @ W.T)
    p = W.shape[0]
    best = np.zeros(r_max)
    for j in range(p):
        others = np.sort(np.delete(gram[j], j))[::-1]
        best = np.maximum(best, np.cumsum(others)[:r_max])
    return best


def babel_subsets(W: np.ndarray, r: int) -> float:
    """The paper's definition: max over |S| = r of max over j not in S of sum_{i in S} |<d_i, d_j>|."""
    W = W.astype(np.float64)
    W = W / np.linalg.norm(W, axis=1, keepdims=True)
    gram = np.abs(W @ W.T)
    p = W.shape[0]
    best = 0.0
    for subset in itertools.combinations(range(p), r):
        for j in set(range(p)) - set(subset):
            best = max(best, sum(gram[i, j] for i in subset))
    return best


def babel_coactive_reference(W: np.ndarray, codes: np.ndarray, r_max: int) -> np.ndarray:
    total = np.zeros(r_max)
    for token_codes in codes:
        active = np.flatnonzero(token_codes)
        if len(active) <= 1:
            continue
        sub = W[active]
        curve = babel_reference(sub, len(active) - 1)
        padded = np.concatenate([curve, np.full(max(0, r_max - len(curve)), curve[-1])])[:r_max]
        total += padded
    return total / codes.shape[0]


def sparse_codes(generator: torch.Generator, n: int, d_sae: int, max_active: int) -> torch.Tensor:
    """Codes with a varying number (0..max_active) of nonzero, signed entries per token."""
    codes = torch.zeros(n, d_sae, dtype=torch.float64)
    for row in range(n):
        k = int(torch.randint(0, max_active + 1, (1,), generator=generator))
        atoms = torch.randperm(d_sae, generator=generator)[:k]
        codes[row, atoms] = torch.randn(k, generator=generator, dtype=torch.float64)
    return codes


# ---------------------------------------------------------------- ReconstructionR2


def test_r2_matches_numpy_and_batch_split() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 16, generator=gen) * 3 + 5
    x_hat = x + 0.5 * torch.randn(300, 16, generator=gen)
    expected = r2_reference(x.numpy(), x_hat.numpy())

    one_pass = ReconstructionR2(d_in=16)
    one_pass.update(x, x_hat)
    split = ReconstructionR2(d_in=16)
    for lo, hi in [(0, 7), (7, 150), (150, 300)]:
        split.update(x[lo:hi], x_hat[lo:hi])

    for metric in (one_pass, split):
        value = metric.compute()
        assert value.dtype == torch.float64
        assert value.item() == pytest.approx(expected, abs=1e-12)


def test_r2_two_ranks_merge_equals_one_process() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 50, 8, generator=gen).to(torch.float16)  # leading dims flatten
    x_hat = (x.float() + 0.3 * torch.randn(2, 50, 8, generator=gen)).to(torch.float16)
    expected = r2_reference(x.reshape(-1, 8).numpy(), x_hat.reshape(-1, 8).numpy())

    rank0, rank1 = ReconstructionR2(d_in=8), ReconstructionR2(d_in=8)
    rank0.update(x[0], x_hat[0])
    rank1.update(x[1], x_hat[1])
    rank0.merge_state(rank1)
    assert rank0.compute().item() == pytest.approx(expected, abs=1e-12)


def test_r2_dist_sync_path_equals_one_process() -> None:
    """The DDP code path (gather, stack, sum) simulated with a fake all-gather over two ranks."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(80, 6, generator=gen)
    x_hat = x + torch.randn(80, 6, generator=gen)
    rank1 = ReconstructionR2(d_in=6)
    rank1.update(x[30:], x_hat[30:])
    names = ("sum_x", "sum_x2", "sum_sq_err", "n")
    rank1_state = {name: getattr(rank1, name) for name in names}
    gathered: list[str] = []

    def fake_all_gather(tensor: torch.Tensor, group: object = None) -> list[torch.Tensor]:
        name = next(n for n in names if getattr(rank0, n) is tensor)
        gathered.append(name)
        return [tensor, rank1_state[name]]

    rank0 = ReconstructionR2(d_in=6, dist_sync_fn=fake_all_gather, distributed_available_fn=lambda: True)
    rank0.update(x[:30], x_hat[:30])
    assert rank0.compute().item() == pytest.approx(r2_reference(x.numpy(), x_hat.numpy()), abs=1e-12)
    assert sorted(gathered) == sorted(names)


def test_r2_empty_rank_still_syncs() -> None:
    """A rank that saw no batch keeps fixed-shape zero states, so merging it changes nothing."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(40, 5, generator=gen)
    x_hat = x + torch.randn(40, 5, generator=gen)
    busy, idle = ReconstructionR2(d_in=5), ReconstructionR2(d_in=5)
    busy.update(x, x_hat)
    busy.merge_state(idle)
    assert busy.compute().item() == pytest.approx(r2_reference(x.numpy(), x_hat.numpy()), abs=1e-12)


def test_r2_bad_input() -> None:
    metric = ReconstructionR2(d_in=4)
    with pytest.raises(ValueError, match="x_hat"):
        metric.update(torch.zeros(3, 4), torch.zeros(3, 5))
    with pytest.raises(ValueError, match=r"\[\.\.\., 4\]"):
        metric.update(torch.zeros(3, 5), torch.zeros(3, 5))
    with pytest.raises(ValueError, match="before any update"):
        metric.compute()
    with pytest.raises(ValueError, match="d_in"):
        ReconstructionR2(d_in=0)


# ---------------------------------------------------------------- sparsity statistics


def test_activation_stats_and_l0_match_numpy() -> None:
    gen = torch.Generator().manual_seed(4)
    codes = sparse_codes(gen, 120, 30, max_active=6).to(torch.float32)
    reference = codes.double().numpy()

    stats = ActivationStats(d_sae=30)
    stats.update(codes[:50])
    other = ActivationStats(d_sae=30)
    other.update(codes[50:])
    stats.merge_state(other)
    result = stats.compute()

    np.testing.assert_allclose(result["frequency"].numpy(), (reference != 0).mean(axis=0), rtol=0, atol=1e-12)
    np.testing.assert_allclose(result["mean_value"].numpy(), reference.mean(axis=0), rtol=0, atol=1e-7)
    expected_l0 = (reference != 0).sum(axis=1).mean()
    assert result["l0"].item() == pytest.approx(expected_l0, abs=1e-12)
    assert l0(codes).item() == pytest.approx(expected_l0, abs=1e-12)
    assert l0(codes.reshape(4, 30, 30)).item() == pytest.approx(expected_l0, abs=1e-12)
    with pytest.raises(ValueError, match="codes"):
        stats.update(torch.zeros(2, 31))


def test_dead_fraction_matches_count() -> None:
    gen = torch.Generator().manual_seed(5)
    tokens_since_fired = torch.randint(0, 1000, (257,), generator=gen)
    expected = sum(int(t) >= 400 for t in tokens_since_fired) / 257
    assert dead_fraction(tokens_since_fired, 400).item() == pytest.approx(expected, abs=1e-15)
    assert dead_fraction(torch.tensor([0, 5, 9]), 5).item() == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="dead_after_tokens"):
        dead_fraction(tokens_since_fired, 0)


# ---------------------------------------------------------------- Babel


@pytest.mark.parametrize("block_size", [1, 7, 64])
def test_babel_matches_literal_definition(block_size: int) -> None:
    gen = torch.Generator().manual_seed(6)
    W = torch.randn(37, 9, generator=gen, dtype=torch.float64) * torch.rand(37, 1, generator=gen, dtype=torch.float64)
    result = babel(W, r_max=36, block_size=block_size)
    np.testing.assert_allclose(result.numpy(), babel_reference(W.numpy(), 36), rtol=0, atol=1e-12)


def test_babel_equals_max_over_subsets() -> None:
    gen = torch.Generator().manual_seed(7)
    W = torch.randn(7, 3, generator=gen, dtype=torch.float64)
    result = babel(W, r_max=6, block_size=3)
    subsets = [babel_subsets(W.numpy(), r) for r in range(1, 7)]
    np.testing.assert_allclose(result.numpy(), subsets, rtol=0, atol=1e-12)


def test_babel_float32_and_bad_input() -> None:
    gen = torch.Generator().manual_seed(8)
    W = torch.randn(50, 12, generator=gen)
    result = babel(W, r_max=10, block_size=16)
    assert result.dtype == torch.float32
    np.testing.assert_allclose(result.numpy(), babel_reference(W.numpy(), 10), rtol=1e-5, atol=1e-5)
    for r_max in (0, 50):
        with pytest.raises(ValueError, match="r_max"):
            babel(W, r_max=r_max)
    with pytest.raises(ValueError, match="block_size"):
        babel(W, r_max=3, block_size=0)
    with pytest.raises(ValueError, match="zero row"):
        babel(torch.cat([W, torch.zeros(1, 12)]), r_max=3)


def test_babel_of_reference_dictionary() -> None:
    assert REFERENCE_FPATH.exists(), f"missing {REFERENCE_FPATH}: part of the package"
    with np.load(REFERENCE_FPATH, allow_pickle=False) as archive:
        W_dec = archive["W_dec"]
    assert W_dec.shape == (1000, 784)
    W = torch.from_numpy(W_dec).to(torch.float64)
    result = babel(W, r_max=999, block_size=96).numpy()
    np.testing.assert_allclose(result, babel_reference(W_dec, 999), rtol=0, atol=1e-9)
    assert np.all(np.diff(result) >= 0)
    assert result[0] <= 1.0 + 1e-12
    assert np.all(result <= np.arange(1, 1000) + 1e-9)


# ---------------------------------------------------------------- Babel of co-active atoms


def test_babel_coactive_matches_per_token_loop() -> None:
    gen = torch.Generator().manual_seed(9)
    W = torch.randn(40, 10, generator=gen, dtype=torch.float64)
    codes = sparse_codes(gen, 64, 40, max_active=8)  # includes tokens with 0 and 1 active atom
    r_max = 12  # beyond every |S| - 1: exercises the saturated tail
    result = babel_coactive(W, codes, r_max=r_max)
    expected = babel_coactive_reference(W.numpy(), codes.numpy(), r_max)
    np.testing.assert_allclose(result.numpy(), expected, rtol=0, atol=1e-12)
    reshaped = babel_coactive(W, codes.reshape(8, 8, 40), r_max=r_max)
    np.testing.assert_allclose(reshaped.numpy(), expected, rtol=0, atol=1e-12)


def test_babel_coactive_small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny memory budget: many chunks of a few tokens each give the same mean."""
    import sae_pipeline.metrics.babel_function as metrics

    monkeypatch.setattr(metrics, "_COACTIVE_CHUNK_ELEMENTS", 200)
    gen = torch.Generator().manual_seed(10)
    W = torch.randn(25, 6, generator=gen, dtype=torch.float64)
    codes = sparse_codes(gen, 30, 25, max_active=9)
    result = metrics.babel_coactive(W, codes, r_max=4)
    expected = babel_coactive_reference(W.numpy(), codes.numpy(), 4)
    np.testing.assert_allclose(result.numpy(), expected, rtol=0, atol=1e-12)


def test_babel_coactive_edge_cases() -> None:
    W = torch.randn(10, 4, dtype=torch.float64)
    single = torch.zeros(5, 10, dtype=torch.float64)
    single[:, 3] = 1.0
    assert torch.equal(babel_coactive(W, single, r_max=3), torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="codes"):
        babel_coactive(W, torch.zeros(5, 11), r_max=3)
    with pytest.raises(ValueError, match="r_max"):
        babel_coactive(W, single, r_max=10)


# ---------------------------------------------------------------- benchmark script


def test_babel_benchmark_quick_run(capsys: pytest.CaptureFixture[str]) -> None:
    """Runs the benchmark script's main() on tiny sizes; it exits non-zero if blocked != naive."""
    from benchmarks import babel as module

    module.main(["--quick"])
    out = capsys.readouterr().out
    assert "blocked" in out and "naive" in out and "ratio blocked/naive" in out
    max_diff = re.search(r"max \|blocked - naive\| = (\S+)", out)
    assert max_diff is not None and float(max_diff.group(1)) < 1e-5
