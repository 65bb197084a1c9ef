"""External dictionaries: the authors' MP-SAE loads into MatchingPursuitSAE and gets its concept figures."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from sae_pipeline.evaluate.__main__ import main
from sae_pipeline.evaluate.external import digits_as_mnist, load_npz_dictionary


def plain_matching_pursuit(x: np.ndarray, W: np.ndarray, b_pre: np.ndarray, k: int) -> np.ndarray:
    """The paper's Algorithm 1, one input at a time, in float64."""
    codes = np.zeros((x.shape[0], W.shape[0]))
    for row, value in enumerate(x):
        residual = value - b_pre
        for _ in range(k):
            correlations = W @ residual
            j = int(np.argmax(correlations))
            codes[row, j] += correlations[j]
            residual = residual - correlations[j] * W[j]
    return codes


def test_reference_dictionary_loads_and_encodes_like_plain_mp(reference_dictionary_fpath) -> None:
    with np.load(reference_dictionary_fpath, allow_pickle=False) as archive:
        W, b_pre = archive["W_dec"].astype(np.float64), archive["b_pre"].astype(np.float64)
    sae = load_npz_dictionary(reference_dictionary_fpath, k=10)
    assert (sae.d_sae, sae.d_in, sae.k) == (1000, 784, 10)
    np.testing.assert_allclose(sae.W_dec.detach().numpy(), W, atol=1e-6)
    np.testing.assert_array_equal(sae.b_pre.detach().numpy(), b_pre.astype(np.float32))
    x = digits_as_mnist()[:16]
    codes = sae.double().encode(x.double()).detach().numpy()
    np.testing.assert_allclose(
        codes,
        plain_matching_pursuit(x.double().numpy(), sae.W_dec.detach().numpy(), sae.b_pre.detach().numpy(), 10),
        atol=1e-9,
    )


def test_digits_as_mnist_layout() -> None:
    x = digits_as_mnist()
    assert x.shape == (1797, 784) and x.dtype == torch.float32
    assert float(x.min()) >= 0 and float(x.max()) <= 1
    images = x.reshape(-1, 28, 28)
    assert float(images[:, :4].abs().max()) == 0 and float(images[:, :, -4:].abs().max()) == 0  # MNIST's margin


@pytest.mark.parametrize(
    "arrays, expected",
    [
        ({"W_dec": np.eye(4, dtype=np.float32)}, "missing b_pre"),
        ({"W_dec": 2 * np.eye(4, dtype=np.float32), "b_pre": np.zeros(4, np.float32)}, "unit-norm atoms"),
        ({"W_dec": np.eye(4, 3, dtype=np.float32), "b_pre": np.zeros(5, np.float32)}, "does not match b_pre"),
    ],
)
def test_bad_npz_is_refused(tmp_path, arrays, expected) -> None:
    fpath = tmp_path / "bad.npz"
    np.savez(fpath, **arrays)
    with pytest.raises(ValueError, match=expected):
        load_npz_dictionary(fpath)


@pytest.mark.slow
def test_dictionary_command_on_the_authors_dictionary(tmp_path, reference_dictionary_fpath) -> None:
    out = tmp_path / "authors"
    assert (
        main(
            [
                "dictionary",
                "--npz",
                str(reference_dictionary_fpath),
                "--out",
                str(out),
                "--max_tokens",
                "300",
                "--k_infer",
                "1",
                "10",
                "40",
                "--r_max",
                "16",
            ]
        )
        == 0
    )
    results = json.loads((out / "results.json").read_text())["dictionary"]
    W = load_npz_dictionary(reference_dictionary_fpath).W_dec.detach().double().numpy()
    gram = np.abs(W @ W.T)
    np.fill_diagonal(gram, 0)
    assert results["babel_dict"][0] == pytest.approx(gram.max(), rel=1e-5)  # μ₁(1) is the mutual coherence
    assert "not MNIST" in results["data"] and results["n_tokens"] == 300
    r2 = results["inference"]["r2"]
    assert r2 == sorted(r2)  # MP: more steps never reconstruct worse
    for name in (
        "dictionary_atoms_by_frequency",
        "dictionary_atoms_by_mean",
        "dictionary_babel",
        "dictionary_frequency_vs_mean",
        "dictionary_selection_step_vs_mean",
        "dictionary_sequential_reconstruction",
    ):
        assert (out / "figures" / f"{name}.png").is_file()
        assert f"figures/{name}.png" in (out / "report.md").read_text()


def test_dictionary_without_data_draws_data_free_figures(tmp_path, reference_dictionary_fpath) -> None:
    out = tmp_path / "free"
    assert (
        main(
            [
                "dictionary",
                "--npz",
                str(reference_dictionary_fpath),
                "--out",
                str(out),
                "--data",
                "none",
                "--r_max",
                "4",
            ]
        )
        == 0
    )
    assert sorted(p.stem for p in (out / "figures").glob("*.png")) == ["dictionary_atoms_by_index", "dictionary_babel"]
    assert json.loads((out / "results.json").read_text())["dictionary"]["data"] is None


def test_missing_npz_is_one_line(tmp_path, capsys) -> None:
    assert main(["dictionary", "--npz", str(tmp_path / "none.npz"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --npz") and "\n" not in err and not (tmp_path / "o").exists()
