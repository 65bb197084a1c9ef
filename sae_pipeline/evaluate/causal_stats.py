"""The statistics of `evaluate causal` that have power: a continuous outcome, a removal-versus-removal baseline,
Benjamini-Hochberg over atoms, and set ablations.

Why not the accuracy drop alone: an atom fires on a few validation images (a median of 2 on MNIST), and removing
it rarely flips a prediction, so most atoms' accuracy drop is exactly 0 and a test on it finds nothing, whatever the
atoms do. The true class's log-probability moves on every image an atom fires on, so its drop is measured there,
paired (the same image before and after).

Why the matched baseline: a drop says little alone (removing any code moves the logits). On each image the atom fires
on, the baseline removes *another* atom that is active on the same image, the one whose |code| is closest (ties: the
nearest in (|code|, atom) order, the one below first), so both arms remove something present, of the same size. The
verdict is the paired difference atom − baseline over the atom's images: a one-sided t test (H1: the atom costs
more), Benjamini-Hochberg over every tested atom.

Set ablations (SAEBench's TPP, with the multi-class probe's per-class accuracy standing in for its binary probes):
for each class, the m atoms whose mean code on the training images of that class most exceeds their mean on the
others are removed together on the validation images; the class's own accuracy drop (targeted) is set against the
mean drop of the other classes' accuracies (untargeted).
"""

from __future__ import annotations

import numpy as np
from scipy import stats

from sae_pipeline.features.chance import benjamini_hochberg

FDR = 0.05  # the false-discovery rate of the matched-baseline verdict
CONFIDENCE = 0.95  # the intervals' level


def log_softmax(logits: np.ndarray) -> np.ndarray:
    top = logits.max(1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(1, keepdims=True))


def true_log_p(logits: np.ndarray, y: np.ndarray) -> np.ndarray:
    """log p(true class) per row (``y`` >= 0: rows without a probe class are left out before)."""
    return np.take_along_axis(log_softmax(logits), y[:, None], 1)[:, 0]


def matched_entries(i: np.ndarray, j: np.ndarray, z: np.ndarray) -> np.ndarray:
    """For each image code ``(i, j, z)``, the index of another code of the same image with the closest |z| (ties:
    the nearest in (|z|, atom) order, the one below first), -1 where the image has no other active atom."""
    order = np.lexsort((j, np.abs(z), i))
    a, image = np.abs(z)[order], i[order]
    n = len(order)
    below = np.r_[-1, np.arange(n - 1)]
    above = np.r_[np.arange(1, n), -1]
    has_below = (below >= 0) & (image[below.clip(0)] == image)
    has_above = (above >= 0) & (image[above.clip(0, n - 1)] == image)
    gap_below = np.where(has_below, a - a[below.clip(0)], np.inf)
    gap_above = np.where(has_above, a[above.clip(0, n - 1)] - a, np.inf)
    pick = np.where(gap_below <= gap_above, below, above)
    pick = np.where(has_below | has_above, pick, -1)
    matched = np.full(n, -1)
    matched[order] = np.where(pick >= 0, order[pick.clip(0)], -1)
    return matched


def per_atom_t(values: np.ndarray, atom: np.ndarray, d_sae: int) -> dict[str, np.ndarray]:
    """Per atom, the mean of ``values`` over its entries, its two-sided t interval and the one-sided p of mean > 0
    (NaN where fewer than two entries)."""
    n = np.bincount(atom, minlength=d_sae).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.bincount(atom, values, minlength=d_sae) / n
        centred = values - mean[atom]
        sd = np.sqrt(np.bincount(atom, centred * centred, minlength=d_sae) / (n - 1))
        se = sd / np.sqrt(n)
        half = stats.t.ppf(0.5 + CONFIDENCE / 2, np.maximum(n - 1, 1)) * se
        t = np.where(se > 0, mean / se, np.where(mean > 0, np.inf, np.where(mean < 0, -np.inf, 0.0)))
        p = np.where(t == 0, 1.0, stats.t.sf(t, np.maximum(n - 1, 1)))
    few = n < 2
    mean = np.where(n > 0, mean, np.nan)
    return {
        "n": n.astype(np.int64),
        "mean": mean,
        "low": np.where(few, np.nan, mean - half),
        "high": np.where(few, np.nan, mean + half),
        "p": np.where(few, np.nan, p),
    }


def atom_log_p(
    logits: np.ndarray, V: np.ndarray, y: np.ndarray, entries: tuple[np.ndarray, np.ndarray, np.ndarray]
) -> dict[str, np.ndarray]:
    """Every atom's drop of log p(true) over the images it fires on, the matched baseline's, and the verdict.

    ``logits [n, C]`` of the validation reconstructions, ``V = D Wᵀ``, ``y`` the class index (-1: not a probe
    class: left out), ``entries`` the image codes ``(image, atom, z̄)`` of every atom.
    """
    d_sae = V.shape[0]
    i, j, z = entries
    matched = matched_entries(i, j, z)
    scored = y[i] >= 0
    i, j, z, matched = i[scored], j[scored], z[scored], matched[scored]
    before = true_log_p(logits[i], y[i]) if len(i) else np.zeros(0)
    drop = before - true_log_p(logits[i] - z[:, None] * V[j], y[i]) if len(i) else np.zeros(0)
    has = matched >= 0
    other_j, other_z = entries[1][matched[has]], entries[2][matched[has]]
    rows = i[has]
    base = before[has] - true_log_p(logits[rows] - other_z[:, None] * V[other_j], y[rows]) if has.any() else drop[has]
    own = per_atom_t(drop, j, d_sae)
    excess = per_atom_t(drop[has] - base, j[has], d_sae)
    q = benjamini_hochberg(excess["p"])
    return {
        "logp_drop": own["mean"],
        "logp_drop_low": own["low"],
        "logp_drop_high": own["high"],
        "n_scored": own["n"],
        "matched_logp_drop": np.where(
            excess["n"] > 0, np.bincount(j[has], base, minlength=d_sae) / np.maximum(excess["n"], 1), np.nan
        ),
        "excess": excess["mean"],
        "excess_low": excess["low"],
        "excess_high": excess["high"],
        "n_matched": excess["n"],
        "p": excess["p"],
        "q": q,
        "beats_matched": np.nan_to_num(q, nan=1.0) < FDR,
    }


def label_sets(
    train: tuple[np.ndarray, np.ndarray, np.ndarray], y_train: np.ndarray, n_classes: int, d_sae: int, m: int
) -> list[np.ndarray]:
    """Per class, the (at most) ``m`` atoms whose mean code on its training images most exceeds their mean on the
    others' (only atoms with a positive difference; ties: the lower atom)."""
    i, j, z = train
    keep = y_train[i] >= 0
    i, j, z = i[keep], j[keep], z[keep]
    counts = np.bincount(y_train[y_train >= 0], minlength=n_classes).astype(np.float64)
    sums = np.bincount(j * n_classes + y_train[i], z, minlength=d_sae * n_classes).reshape(d_sae, n_classes)
    total, n_all = sums.sum(1, keepdims=True), counts.sum()
    with np.errstate(invalid="ignore", divide="ignore"):
        diff = sums / counts - (total - sums) / (n_all - counts)
    diff = np.nan_to_num(diff, nan=-np.inf)
    sets = []
    for c in range(n_classes):
        order = np.lexsort((np.arange(d_sae), -diff[:, c]))[:m]
        sets.append(order[diff[order, c] > 0])
    return sets


def set_ablations(
    logits: np.ndarray,
    V: np.ndarray,
    y: np.ndarray,
    entries: tuple[np.ndarray, np.ndarray, np.ndarray],
    sets: list[np.ndarray],
) -> list[dict]:
    """Per class c, its set removed together: the drop of class c's accuracy (targeted), the mean drop of the other
    classes' accuracies (untargeted), and the same for log p(true) over class c's images and over the others'."""
    i, j, z = entries
    n_classes = logits.shape[1]
    scored = y >= 0
    per_class = np.bincount(y[scored], minlength=n_classes)
    correct0 = logits.argmax(1) == y
    logp0 = np.where(scored, true_log_p(logits, y.clip(0)), 0.0)
    out = []
    for c, atoms in enumerate(sets):
        chosen = np.isin(j, atoms)
        moved = logits.copy()
        np.add.at(moved, i[chosen], -z[chosen, None] * V[j[chosen]])
        correct = moved.argmax(1) == y
        acc_drop = np.bincount(y[scored], (correct0 & ~correct)[scored] * 1.0 - (~correct0 & correct)[scored] * 1.0)
        acc_drop = np.pad(acc_drop, (0, n_classes - len(acc_drop))) / np.maximum(per_class, 1)
        logp_drop = logp0 - np.where(scored, true_log_p(moved, y.clip(0)), 0.0)
        others = [k for k in range(n_classes) if k != c and per_class[k] > 0]
        mine, rest = scored & (y == c), scored & (y != c)
        targeted = float(acc_drop[c]) if per_class[c] else None
        untargeted = float(np.mean(acc_drop[others])) if others else None
        out.append(
            {
                "atoms": atoms.tolist(),
                "images": int(per_class[c]),
                "targeted_accuracy_drop": targeted,
                "untargeted_accuracy_drop": untargeted,
                "tpp": None if targeted is None or untargeted is None else targeted - untargeted,
                "targeted_logp_drop": float(logp_drop[mine].mean()) if mine.any() else None,
                "untargeted_logp_drop": float(logp_drop[rest].mean()) if rest.any() else None,
            }
        )
    return out
