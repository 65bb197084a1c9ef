"""Causal effects of single atoms: what a linear probe and the reconstruction lose when one atom is removed.

``python -m sae_pipeline.evaluate causal --sae DIR --data SOURCE --out OUT`` (docs/evaluation.md, "Causal
effects"). Selectivity says which images an atom fires on; this says whether the reconstruction *uses* it
for what a class probe reads, which a frequent, unselective atom may do more than a selective one.

- The data are split as training splits them (``--val_fraction``: the same rows or shards); a shard
  directory's tokens are mean-pooled per image, as sparse probing pools them.
- The probe (scikit-learn ``LogisticRegression``, multi-class, L2, C = 1, ``max_iter`` 1000, no rescaling:
  sparse probing's settings) is fitted on the SAE's reconstructions x̂ = z D + b_pre of the training split,
  not on x: the effect of removing an atom is measured on the representation the probe reads, so a probe
  fitted on x would mix the atom's effect with the gap between x and x̂.
- On the validation split atom j is removed: x̂₋ⱼ = x̂ − z_j d_j, every other code unchanged. For MP-SAE and
  OMP-SAE, z is the pursuit's output (an atom picked twice: its summed coefficient) without atom j's
  coefficient; the pursuit is not re-run without atom j (that would ask what *another* code would do).

What is tested (:mod:`.causal_stats`): the drop of the true class's log-probability over the images an atom fires
on, against removing a matched other atom of the same image (removal versus removal), Benjamini-Hochberg over the
atoms; and set ablations per class (SAEBench's TPP). The accuracy drop is kept as a figure, not as the test: most
atoms fire on too few images for it to move.

Cost: removing atom j changes only the images it fires on, and linearly: image i's logits move by
−z̄_ij (W d_j) (z̄: the code pooled over the image's tokens), so with ``V = D Wᵀ`` (``[d_sae, classes]``, once)
every atom's probe figures together cost O(nnz · classes), and the error rise, 2 z_tj ⟨r_t, d_j⟩ + z_tj² ‖d_j‖²
per nonzero code (r = x − x̂), O(nnz · d). Nothing is per atom, so every atom is measured by default.
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Any

import numpy as np
import torch
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression
from tqdm import tqdm

from sae_pipeline.evaluate.probing import pooled

TOP_IMAGES = 5  # images listed per atom
RANDOM_ATOMS = 19  # random directions per atom in `benchmarks/causal.py`'s cost figures (the command uses none)
SET_SIZE = 10  # atoms per class in the set ablations (--set_size)
RANDOM_SEED = 0
_BLOCK = 1024  # tokens encoded at a time (dense codes [block, d_sae] while encoding)
_ENTRIES = 8192  # nonzero codes per vectorised step ([entries, d] while dotting residuals)


def fit_probe(xhat: np.ndarray, labels: np.ndarray) -> LogisticRegression:
    """Sparse probing's classifier, multi-class, on the training reconstructions (float64)."""
    if len(np.unique(labels)) < 2:
        raise ValueError("causal effects need two classes or more in the training split; pass labelled data")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        return LogisticRegression(C=1.0, max_iter=1000).fit(xhat, labels)


def probe_weights(probe: LogisticRegression) -> tuple[np.ndarray, np.ndarray]:
    """``(W [C, d], b [C])`` whose ``argmax`` and softmax are ``predict`` and ``predict_proba`` (two classes:
    scikit-learn's one score s becomes the logits [0, s], whose argmax at s = 0 is class 0, as ``predict``)."""
    coef, intercept = probe.coef_.astype(np.float64), probe.intercept_.astype(np.float64)
    if len(probe.classes_) == 2:
        return np.vstack([np.zeros_like(coef), coef]), np.concatenate([[0.0], intercept])
    return coef, intercept


@torch.no_grad()
def token_codes(sae: torch.nn.Module, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The nonzero codes ``encode`` computes: ``(token, atom, value float64)``, in token order."""
    z = sae.encode(torch.from_numpy(np.ascontiguousarray(x, np.float32)))
    t, j = torch.nonzero(z, as_tuple=True)
    return t.numpy(), j.numpy(), z[t, j].double().numpy()


def reconstruct(D: torch.Tensor, b: torch.Tensor, n: int, t: np.ndarray, j: np.ndarray, v: np.ndarray) -> np.ndarray:
    """x̂ = z D + b_pre in float64 from the nonzero codes (a sparse product: O(nnz · d), not O(n · d_sae · d))."""
    indices = torch.from_numpy(np.stack([t, j]))
    z = torch.sparse_coo_tensor(indices, torch.from_numpy(v), (n, D.shape[0]), check_invariants=True, is_coalesced=True)
    return (torch.sparse.mm(z, D) + b).numpy()


def pooled_entries(
    i: np.ndarray, j: np.ndarray, v: np.ndarray, per_image: int, d_sae: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token codes ``(token, atom, value)`` as image codes ``(image, atom, z̄)``: the mean over the image's tokens."""
    if per_image == 1:
        return i, j, v
    key, inverse = np.unique((i // per_image) * d_sae + j, return_inverse=True)
    return key // d_sae, key % d_sae, np.bincount(inverse, v) / per_image


def read_split(source: Any, split: str, val_fraction: float) -> Any:
    """Blocks ``(tokens float32 [n, d], labels [images], image ids)`` of ``split``, whole images per block."""
    units = source.units(split, val_fraction)
    per_image = units[0].tokens_per_image if source.unit_kind == "shards" and units else 1
    held: list = []
    for unit in units:
        # a row source's chunk holds up to 8192 rows: read _BLOCK at a time (dense codes [rows, d_sae] while encoding)
        step = unit.n_tokens if per_image > 1 else _BLOCK
        for lo in range(0, unit.n_tokens, step):
            for chunk in unit.read(lo, min(lo + step, unit.n_tokens), with_ids=True):
                held.append(chunk)
                if sum(len(c.tokens) for c in held) >= _BLOCK:
                    yield _block(held, per_image)
                    held = []
    if held:
        yield _block(held, per_image)


def _block(chunks: list, per_image: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    tokens = np.concatenate([c.tokens for c in chunks]).astype(np.float32)
    labels = np.concatenate([c.labels for c in chunks])[::per_image]
    if (labels < 0).any():
        raise ValueError("causal effects: an image has no integer 'label' (meta.json); every image needs one")
    return tokens, labels, [i for c in chunks for i in c.image_ids][::per_image]


def error_rise(
    x: np.ndarray,
    xhat: np.ndarray,
    codes: tuple[np.ndarray, np.ndarray, np.ndarray],
    D: np.ndarray,
    sq_norms: np.ndarray,
) -> tuple[np.ndarray, float]:
    """Per atom, Σ_t 2 z_tj ⟨r_t, d_j⟩ + z_tj² ‖d_j‖² over the tokens it codes (r = x − x̂), and Σ_t ‖r_t‖²."""
    t, j, v = codes
    r = x.astype(np.float64) - xhat
    rise = np.zeros(len(D))
    for s in range(0, len(t), _ENTRIES):
        ts, js, vs = t[s : s + _ENTRIES], j[s : s + _ENTRIES], v[s : s + _ENTRIES]
        dots = np.einsum("nd,nd->n", r[ts], D[js])
        rise += np.bincount(js, 2 * vs * dots + vs * vs * sq_norms[js], minlength=len(D))
    return rise, float(np.einsum("nd,nd->", r, r))


def encode_split(sae: Any, source: Any, split: str, val_fraction: float, errors: bool) -> dict[str, Any]:
    """Pooled reconstructions, labels, ids and image codes ``(i, j, z̄)`` of a split; with ``errors`` also, per atom,
    the summed error rise 2 z ⟨r, d⟩ + z² ‖d‖² over its tokens, and the summed baseline error ‖r‖²."""
    D, b = sae.W_dec.detach().double(), sae.b_pre.detach().double()
    sq_norms = (D * D).sum(1).numpy()
    per_image = source.units(split, val_fraction)[0].tokens_per_image if source.unit_kind == "shards" else 1
    found: dict[str, Any] = {"xhat": [], "labels": [], "ids": [], "i": [], "j": [], "z": [], "n_tokens": 0}
    rise, base = np.zeros(sae.d_sae), 0.0
    total = sum(unit.n_tokens for unit in source.units(split, val_fraction))
    bar = tqdm(total=total, desc=f"encoding {split}", unit="token", delay=2, dynamic_ncols=True, leave=False)
    for x, labels, ids in read_split(source, split, val_fraction):
        bar.update(len(x))
        if x.shape[1] != sae.d_in:
            raise ValueError(
                f"--data: tokens are {x.shape[1]}-d but the SAE takes d_in = {sae.d_in}; "
                "pass the data it was trained on"
            )
        t, j, v = token_codes(sae, x)
        xhat = reconstruct(D, b, len(x), t, j, v)
        if errors:
            block_rise, block_base = error_rise(x, xhat, (t, j, v), D.numpy(), sq_norms)
            rise, base = rise + block_rise, base + block_base
        i, j, z = pooled_entries(t, j, v, per_image, sae.d_sae)
        found["i"].append(i + len(found["ids"])), found["j"].append(j), found["z"].append(z)
        found["xhat"].append(pooled(xhat, per_image))
        found["labels"].append(labels)
        found["ids"] += ids
        found["n_tokens"] += len(x)
    bar.close()
    out = {key: np.concatenate(found[key]) for key in ("xhat", "labels", "i", "j", "z")}
    out.update(ids=found["ids"], n_tokens=found["n_tokens"], per_image=per_image, rise=rise, base=base)
    return out


def class_index(classes: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Each label's index among the probe's (sorted) ``classes``, -1 for a label the training split lacks."""
    position = np.searchsorted(classes, labels).clip(0, len(classes) - 1)
    return np.where(classes[position] == labels, position, -1)


def _softmax_true(logits: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The probability of the true class (0 where the class was not in the probe's training split)."""
    top = logits.max(1, keepdims=True)
    weights = np.exp(logits - top)
    chosen = np.take_along_axis(weights, np.maximum(y, 0)[:, None], 1)[:, 0]
    return np.where(y >= 0, chosen / weights.sum(1), 0.0)


def random_atoms(d_sae: int, n_random: int = RANDOM_ATOMS) -> np.ndarray:
    """``[d_sae, n_random]``: for each atom, other atoms drawn at random (fixed seed) whose directions stand in
    for its own on its images; none for a dictionary of one atom."""
    if d_sae < 2:
        return np.zeros((d_sae, 0), np.int64)
    others = np.random.default_rng(RANDOM_SEED).integers(0, d_sae - 1, size=(d_sae, n_random))
    return others + (others >= np.arange(d_sae)[:, None])  # any atom but j itself


def atom_effects(
    logits: np.ndarray,
    V: np.ndarray,
    y: np.ndarray,
    entries: tuple[np.ndarray, np.ndarray, np.ndarray],
    atoms: np.ndarray,
    top_label: np.ndarray,
    n_random: int = 0,
) -> dict[str, np.ndarray]:
    """Per atom of ``atoms`` (sorted), the probe's figures when it is removed, by the linear update.

    ``logits [n, C]`` of the validation images, ``V = D Wᵀ [d_sae, C]``, ``y`` the class index (-1: not a probe
    class), ``entries`` the image codes ``(image, atom, z̄)``, ``top_label`` a class index per atom (-1: none).
    """
    d_sae, n = V.shape[0], len(y)
    pred0 = logits.argmax(1)
    correct0 = (pred0 == y).astype(np.int64)
    p0 = _softmax_true(logits, y)
    i, j, z = (a[np.isin(entries[1], atoms)] for a in entries)
    others = random_atoms(d_sae, n_random)
    n_random = others.shape[1]
    sums = {key: np.zeros(d_sae) for key in ("lost", "gained", "top_delta", "changed")}
    null = np.zeros((d_sae, n_random))
    changed, p_drop, pred = np.zeros(len(i), bool), np.zeros(len(i)), np.zeros(len(i), np.int64)
    steps = range(0, len(i), _ENTRIES)
    for s in tqdm(steps, desc="causal", unit="block", delay=2, dynamic_ncols=True, leave=False):
        ii, jj, zz = i[s : s + _ENTRIES], j[s : s + _ENTRIES], z[s : s + _ENTRIES, None]
        moved = logits[ii] - zz * V[jj]
        after = moved.argmax(1)
        delta = correct0[ii] - (after == y[ii])
        sums["lost"] += np.bincount(jj, delta > 0, minlength=d_sae)
        sums["gained"] += np.bincount(jj, delta < 0, minlength=d_sae)
        sums["top_delta"] += np.bincount(jj, delta * (y[ii] == top_label[jj]), minlength=d_sae)
        sums["changed"] += np.bincount(jj, after != pred0[ii], minlength=d_sae)
        changed[s : s + _ENTRIES], pred[s : s + _ENTRIES] = after != pred0[ii], after
        p_drop[s : s + _ENTRIES] = p0[ii] - _softmax_true(moved, y[ii])
        for r in range(n_random):  # the same images and coefficients, a random atom's direction
            random_delta = correct0[ii] - ((logits[ii] - zz * V[others[jj, r]]).argmax(1) == y[ii])
            null[:, r] += np.bincount(jj, random_delta, minlength=d_sae)
    drop = (sums["lost"] - sums["gained"]) / n
    variance = np.maximum((sums["lost"] + sums["gained"]) / n - drop**2, 0.0) * n / max(n - 1, 1)
    result = {
        "accuracy_drop": drop[atoms],
        "accuracy_drop_se": np.sqrt(variance / n)[atoms],
        "random_drop_mean": (null.mean(1) / n)[atoms] if n_random else np.full(len(atoms), np.nan),
        "random_drop_max": (null.max(1) / n)[atoms] if n_random else np.full(len(atoms), np.nan),
        "changed": sums["changed"][atoms].astype(np.int64),
        "top_delta": sums["top_delta"][atoms],
    }
    result["beats_random"] = (drop[atoms] > result["random_drop_max"]) if n_random else np.zeros(len(atoms), bool)
    order = np.lexsort((-p_drop, ~changed, j))  # per atom: changed predictions first, then the largest drop
    starts = np.searchsorted(j[order], atoms)
    ends = np.searchsorted(j[order], atoms, side="right")
    result["images"] = [order[a : min(e, a + TOP_IMAGES)] for a, e in zip(starts, ends)]
    result.update(entry_image=i, entry_pred=pred, entry_p_drop=p_drop, entry_changed=changed, pred0=pred0, p0=p0)
    return result


def top_labels(i: np.ndarray, j: np.ndarray, labels: np.ndarray, d_sae: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Per atom the label (index into ``labels``' sorted unique values) of largest prior-corrected share q, by the
    feature browser's own function over the images given (an atom fires on an image when one of its tokens has a
    nonzero code, as the browser counts), -1 where it never fires, and whether that maximum is tied."""
    from sae_pipeline.features.selectivity import prior_corrected_shares

    values, y_index = np.unique(labels, return_inverse=True)
    counts = np.bincount(j * len(values) + y_index[i], minlength=d_sae * len(values)).reshape(d_sae, len(values))
    q = prior_corrected_shares(counts, np.bincount(y_index, minlength=len(values)))
    top = q.argmax(1)
    fired = counts.sum(1) > 0
    tied = fired & ((q == q.max(1, keepdims=True)).sum(1) > 1)
    return np.where(fired, top, -1), tied, len(values)


def causal_effects(
    sae: Any, source: Any, data: str, val_fraction: float, atoms: list[int] | None, set_size: int = SET_SIZE
) -> dict[str, Any]:
    """Every figure of ``causal.json`` (see the module docstring); ``atoms`` None: all of them."""
    from sae_pipeline.evaluate.causal_stats import CONFIDENCE, FDR, atom_log_p, label_sets, set_ablations

    start = time.perf_counter()
    train = encode_split(sae, source, "train", val_fraction, errors=False)
    val = encode_split(sae, source, "val", val_fraction, errors=True)
    probe = fit_probe(train["xhat"], train["labels"])
    W, bias = probe_weights(probe)
    classes = probe.classes_
    y = class_index(classes, val["labels"])
    logits = val["xhat"] @ W.T + bias
    V = sae.W_dec.detach().double().numpy() @ W.T
    chosen = np.arange(sae.d_sae) if atoms is None else np.unique(np.asarray(atoms, np.int64))
    n_train = len(train["labels"])
    every = np.concatenate([train["labels"], val["labels"]])  # the browser counts every image of the data
    values = np.unique(every)
    top, tied, _ = top_labels(
        np.concatenate([train["i"], val["i"] + n_train]), np.concatenate([train["j"], val["j"]]), every, sae.d_sae
    )
    top_class = np.where(top >= 0, class_index(classes, values[top.clip(0)]), -1)
    entries = (val["i"], val["j"], val["z"])
    effects = atom_effects(logits, V, y, entries, chosen, top_class)
    log_p = atom_log_p(logits, V, y, entries)
    sets = label_sets(
        (train["i"], train["j"], train["z"]), class_index(classes, train["labels"]), len(classes), sae.d_sae, set_size
    )
    n_val, n_tokens = len(y), val["n_tokens"]
    fired = np.bincount(val["j"], minlength=sae.d_sae)[chosen]
    in_top = np.array([(val["labels"] == values[t]).sum() if t >= 0 else 0 for t in top[chosen]])
    base = val["base"] / n_tokens
    rise = val["rise"][chosen] / n_tokens

    def image(e: int) -> dict[str, Any]:
        row = int(effects["entry_image"][e])
        return {
            "index": row,
            "id": val["ids"][row],
            "label": val["labels"][row].item(),
            "before": classes[effects["pred0"][row]].item(),
            "after": classes[effects["entry_pred"][e]].item(),
            "p_true_before": float(effects["p0"][row]),
            "p_true_after": float(effects["p0"][row] - effects["entry_p_drop"][e]),
        }

    tested = np.isfinite(log_p["p"])
    ablations = set_ablations(logits, V, y, entries, sets)
    tpp = [a["tpp"] for a in ablations if a["tpp"] is not None]
    return {
        "class": type(sae).__name__,
        "d_in": sae.d_in,
        "d_sae": sae.d_sae,
        "k": sae.k,
        "data": data,
        "val_fraction": val_fraction,
        "tokens_per_image": val["per_image"],
        "n_train_images": n_train,
        "n_val_images": n_val,
        "n_val_tokens": n_tokens,
        "classes": [c.item() for c in classes],
        "probe_accuracy": float((logits.argmax(1) == y).mean()),
        "baseline_error": base,
        "atoms_firing": int((np.bincount(val["j"], minlength=sae.d_sae) > 0).sum()),
        "atoms_tested": int(tested.sum()),
        "atoms_beating_matched": int(log_p["beats_matched"].sum()),
        "fdr": FDR,
        "confidence": CONFIDENCE,
        "top_label_images": "train and validation",
        "set_size": set_size,
        "set_ablations": {c.item(): a for c, a in zip(classes, ablations)},
        "tpp_mean": float(np.mean(tpp)) if tpp else None,
        "seconds": time.perf_counter() - start,
        "atoms": {
            "atom": chosen.tolist(),
            "n_images": fired.tolist(),
            "top_label": [values[t].item() if t >= 0 else None for t in top[chosen]],
            "top_label_tied": tied[chosen].tolist(),
            "accuracy_drop": effects["accuracy_drop"].tolist(),
            "accuracy_drop_se": effects["accuracy_drop_se"].tolist(),
            "top_label_drop": [d / m if m else None for d, m in zip(effects["top_delta"].tolist(), in_top)],
            **{key: _figures(log_p[key][chosen]) for key in LOG_P_KEYS},
            "error_rise": rise.tolist(),
            "error_rise_relative": _plain(rise / base if base > 0 else np.full(len(rise), np.nan)),
            "changed": effects["changed"].tolist(),
            "images": [[image(e) for e in rows] for rows in effects["images"]],
        },
    }


LOG_P_KEYS = (
    "logp_drop",
    "logp_drop_low",
    "logp_drop_high",
    "n_scored",
    "matched_logp_drop",
    "excess",
    "excess_low",
    "excess_high",
    "n_matched",
    "p",
    "q",
    "beats_matched",
)


def _figures(values: np.ndarray) -> list:
    return _plain(values) if values.dtype.kind == "f" else values.tolist()


def _plain(values: np.ndarray) -> list[float | None]:
    return [None if math.isnan(v) else v for v in values.tolist()]
