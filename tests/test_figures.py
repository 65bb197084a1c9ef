"""Figure functions: the plotted data equal the inputs, PNGs render, bad input raises one-line errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure
from PIL import Image

from sae_pipeline.figures import atom_grid_figure, babel_curve_figure, frequency_vs_mean_figure, r2_vs_k_figure


def _image_axes(fig: Figure) -> list:
    return [ax for ax in fig.axes if ax.images]


def test_atom_grid_of_reference_dictionary_renders(reference_dictionary_fpath: Path, tmp_path: Path) -> None:
    """The paper authors' MNIST MP-SAE atoms: 25 images equal to the reshaped rows, symmetric scales."""
    with np.load(reference_dictionary_fpath, allow_pickle=False) as archive:
        W_dec = archive["W_dec"]  # [1000, 784]
    fig = atom_grid_figure(torch.from_numpy(W_dec), (28, 28), n_atoms=25, title="reference MP-SAE")
    axes = _image_axes(fig)
    assert len(axes) == 25
    for index, ax in enumerate(axes):
        shown = np.asarray(ax.images[0].get_array())
        np.testing.assert_allclose(shown, W_dec[index].reshape(28, 28).astype(np.float64), rtol=0, atol=1e-7)
        low, high = ax.images[0].get_clim()
        assert low == pytest.approx(-high)
        assert high == pytest.approx(float(np.abs(W_dec[index]).max()))

    png_fpath = tmp_path / "atoms.png"
    fig.savefig(png_fpath, dpi=80)
    with Image.open(png_fpath) as image:
        pixels = np.asarray(image.convert("RGB"))
        width, height = image.size
    expected_width, expected_height = (fig.get_size_inches() * 80).round().astype(int)
    assert (width, height) == (expected_width, expected_height)
    assert pixels.std() > 10  # not a blank canvas
    # Diverging map: both the red (positive) and blue (negative) ends appear.
    red = (pixels[..., 0].astype(int) - pixels[..., 2]) > 60
    blue = (pixels[..., 2].astype(int) - pixels[..., 0]) > 60
    assert red.sum() > 100 and blue.sum() > 100


def test_atom_grid_fewer_atoms_than_requested_and_labels() -> None:
    W_dec = np.random.default_rng(0).standard_normal((7, 12))
    fig = atom_grid_figure(W_dec, (3, 4), n_atoms=25, labels=[f"#{i}" for i in range(7)])
    axes = _image_axes(fig)
    assert len(axes) == 7
    assert [ax.get_title() for ax in axes] == [f"#{i}" for i in range(7)]
    np.testing.assert_allclose(np.asarray(axes[6].images[0].get_array()), W_dec[6].reshape(3, 4))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"W_dec": np.zeros((4, 10)), "image_shape": (3, 3)}, "image_shape 3x3"),
        ({"W_dec": np.zeros(9), "image_shape": (3, 3)}, "W_dec must be"),
        ({"W_dec": np.zeros((4, 9)), "image_shape": (3, 3), "n_atoms": 0}, "n_atoms"),
        ({"W_dec": np.zeros((4, 9)), "image_shape": (3, 3), "labels": ["a"]}, "labels"),
    ],
)
def test_atom_grid_bad_input(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        atom_grid_figure(**kwargs)


def test_babel_curve_figure_plots_each_curve() -> None:
    generator = torch.Generator().manual_seed(0)
    curves = {"dictionary": torch.rand(40, generator=generator).cumsum(0), "co-active": np.linspace(0.1, 0.9, 40)}
    fig = babel_curve_figure(curves, title="t")
    lines = fig.axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["dictionary", "co-active"]
    for line, values in zip(lines, curves.values()):
        np.testing.assert_array_equal(line.get_xdata(), np.arange(1, 41))
        np.testing.assert_allclose(line.get_ydata(), np.asarray(values, dtype=np.float64), rtol=1e-7)
    with pytest.raises(ValueError, match="curves"):
        babel_curve_figure({})
    with pytest.raises(ValueError, match="curves\\['bad'\\]"):
        babel_curve_figure({"bad": np.zeros((2, 2))})


def test_r2_vs_k_figure_data_and_trained_k_marker() -> None:
    ks = [1, 2, 4, 8, 10, 16, 32, 40]
    r2s = {"MatchingPursuitSAE": list(np.linspace(0.2, 0.95, 8)), "TopKSAE": list(np.linspace(0.1, 0.7, 8))}
    fig = r2_vs_k_figure(ks, r2s, trained_k=10)
    ax = fig.axes[0]
    lines = ax.get_lines()
    np.testing.assert_array_equal(lines[0].get_xdata(), ks)
    np.testing.assert_allclose(lines[1].get_ydata(), r2s["TopKSAE"])
    marker = lines[2]
    assert list(marker.get_xdata()) == [10, 10] and "trained k = 10" in marker.get_label()
    assert ax.get_xscale() == "log"
    assert r2_vs_k_figure([8, 10, 16], {"a": [0.1, 0.2, 0.3]}).axes[0].get_xscale() == "linear"
    with pytest.raises(ValueError, match="one value per k"):
        r2_vs_k_figure(ks, {"a": [0.5]})
    with pytest.raises(ValueError, match="ks must be integers"):
        r2_vs_k_figure([0, 1], {"a": [0.5, 0.6]})


def test_frequency_vs_mean_figure_hides_and_counts_never_fired_atoms() -> None:
    rng = np.random.default_rng(1)
    frequency = rng.uniform(1e-4, 0.5, size=50)
    frequency[[3, 17]] = 0.0
    mean = rng.standard_normal(50)
    fig = frequency_vs_mean_figure(torch.from_numpy(frequency), mean)
    ax = fig.axes[0]
    offsets = np.asarray(ax.collections[0].get_offsets())
    fired = frequency > 0
    np.testing.assert_allclose(offsets[:, 0], frequency[fired])
    np.testing.assert_allclose(offsets[:, 1], mean[fired])
    assert "2 of 50 atoms never fired" in ax.get_title()
    assert ax.get_xscale() == "log"
    with pytest.raises(ValueError, match="same length"):
        frequency_vs_mean_figure(frequency, mean[:10])
