"""The streaming top-N pass against a brute-force dense computation (values, order, ties, merge)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sae_pipeline.features.merge import merge_states
from sae_pipeline.features.topn import TopNTable


def brute_force(codes: np.ndarray, images: np.ndarray, n: int) -> list[list[tuple[float, int]]]:
    """Per atom: [(value, token)] of the top-n images by best token, the plain way."""
    result = []
    for j in range(codes.shape[1]):
        best: dict[int, tuple[float, int]] = {}
        for t in range(codes.shape[0]):
            v = float(codes[t, j])
            if v <= 0:
                continue
            g = int(images[t])
            if g not in best or (-v, t) < (-best[g][0], best[g][1]):
                best[g] = (v, t)
        result.append(sorted(best.values(), key=lambda e: (-e[0], e[1]))[:n])
    return result


def random_codes(seed: int, n_tokens: int = 600, d_sae: int = 24, tokens_per_image: int = 5) -> tuple:
    rng = np.random.default_rng(seed)
    # Coarse values (many exact ties), sparse, some negative.
    codes = rng.integers(-2, 6, size=(n_tokens, d_sae)).astype(np.float32) * (rng.random((n_tokens, d_sae)) < 0.3)
    codes[:, 0] = 0  # a dead atom
    codes[:3, 1] = 1  # an atom that fires on fewer images than n
    codes[3:, 1] = 0
    images = np.arange(n_tokens) // tokens_per_image
    return codes, images


def table_entries(table: TopNTable) -> list[list[tuple[float, int]]]:
    out = []
    for j in range(table.d_sae):
        row = [(float(v), int(t)) for v, t in zip(table.value[j], table.token[j]) if t >= 0]
        out.append(row)
    return out


def stream(codes: np.ndarray, images: np.ndarray, n: int, order: np.ndarray, batch: int) -> TopNTable:
    table = TopNTable(codes.shape[1], n)
    for start in range(0, len(order), batch):
        rows = torch.from_numpy(order[start : start + batch])
        table.update_codes(torch.from_numpy(codes)[rows], rows, torch.from_numpy(images)[rows], rows % 5)
    return table


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streaming_equals_brute_force_whatever_the_batching(seed: int) -> None:
    codes, images = random_codes(seed)
    expected = brute_force(codes, images, n=4)
    rng = np.random.default_rng(seed)
    for order, batch in ((np.arange(len(codes)), 64), (rng.permutation(len(codes)), 37), (np.arange(len(codes)), 1000)):
        table = stream(codes, images, 4, order, batch)
        assert table_entries(table) == expected
        assert table.fire_count.tolist() == (codes != 0).sum(0).tolist()
        np.testing.assert_allclose(table.value_sum.numpy(), codes.astype(np.float64).sum(0))
        # positions follow the tokens
        filled = table.token >= 0
        assert torch.equal(table.position[filled], table.token[filled] % 5)
        assert torch.equal(table.image[filled], torch.from_numpy(images)[table.token[filled]])


def test_merge_of_rank_tables_equals_one_table() -> None:
    codes, images = random_codes(5, tokens_per_image=7)  # images straddle the rank boundary
    whole = stream(codes, images, 3, np.arange(len(codes)), 50)
    cut = 301
    parts = [
        stream(codes[:cut], images[:cut], 3, np.arange(cut), 50).state(),
        stream(codes, images, 3, np.arange(cut, len(codes)), 50).state(),
    ]
    # the second part was fed global token indices cut.. of the whole arrays
    merged = merge_states(parts, n=3)
    for name, value in whole.state().items():
        if value.dtype.is_floating_point and name == "value_sum":
            torch.testing.assert_close(merged[name], value, rtol=1e-12, atol=0)
        else:
            assert torch.equal(merged[name], value), name


def test_mp_selection_steps_are_counted() -> None:
    table = TopNTable(4, 2)
    codes = torch.tensor([[1.0, 2.0, 0, 0], [0, 3.0, 0, 0]])
    steps = torch.tensor([[1, 0], [1, 1]]), torch.arange(1, 3)[None]  # token 1 picks atom 1 twice
    table.update_codes(codes, torch.arange(2), torch.arange(2), torch.zeros(2, dtype=torch.int64), steps)
    assert table.step_sum.tolist() == [2, 1 + 1 + 2, 0, 0]
    assert table.step_count.tolist() == [1, 3, 0, 0]


def test_packed_key_orders_by_atom_then_value_desc() -> None:
    from sae_pipeline.features.topn import _value_desc_key

    rng = np.random.default_rng(0)
    value = torch.from_numpy(
        np.concatenate(
            [rng.standard_normal(500) * 10.0 ** rng.integers(-40, 30, 500), [0.0, 1e-45, -1e-45, 3.4e38, -3.4e38]]
        ).astype(np.float32)
    )
    atom = torch.from_numpy(rng.integers(0, 3, len(value)))
    order = torch.sort(_value_desc_key(atom, value), stable=True).indices
    expected = sorted(range(len(value)), key=lambda i: (int(atom[i]), -float(value[i])))
    assert [(int(atom[i]), float(value[i])) for i in order] == [(int(atom[i]), float(value[i])) for i in expected]
