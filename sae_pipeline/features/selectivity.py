"""Label selectivity of each atom, from the pass's label counts: what the site shows and ``features.npz`` keeps.

With ``c[j, l]`` the images of label ``l`` on which atom ``j`` fires and ``m[l]`` the images of
label ``l`` (the prior ``p[l] = m[l] / M``, over the ``L`` labels that have images):

- ``share[j, l] = c[j, l] / sum_l c[j, l]``: the labels of the images the atom fires on;
- ``rate[j, l] = c[j, l] / m[l]``: the fraction of label ``l``'s images it fires on;
- ``q[j, l] = rate[j, l] / sum_l rate[j, l]`` (= share / prior, renormalised): the share with the
  label prior divided out, i.e. as if every label had as many images;
- top label ``argmax_l q[j, l]`` and its share ``q[j, top]`` (1/L: no preference, 1: one label only);
- selectivity ``S[j] = 1 - H(q[j]) / log L`` with ``H(q) = -sum_l q log q``: 0 when the atom fires on
  every label's images at the same rate, 1 when it fires on one label only.

Atoms that never fire on a labelled image, or data with fewer than two labels, have no
selectivity (NaN). Computed in blocks of atoms, so the float work stays O(block · L).

``S`` alone favours atoms that fire on few images (one image: ``S = 1`` whatever it shows), so each
atom is also set against an atom firing on as many random images (`sae_pipeline.features.chance`:
the expected ``S`` and its spread, the excess over it, the p-value of ``S`` itself and
Benjamini-Hochberg over the atoms), and given a 95 % posterior interval for ``S`` and ``q[top]``
(`sae_pipeline.features.label_intervals`: three images of one label do not show ``S = 1`` as surely
as 67 do). The same statistics weighted by each image's activation beside them:
`sae_pipeline.features.label_weights`.

A label's page lists the atoms that match it best, by ``F1[j, l] = 2 c[j, l] / (n[j] + m[l])``
(``n[j]`` the labelled images atom ``j`` fires on): the harmonic mean of the share of its images
that have the label (precision) and of the label's images it fires on (recall). Ranking by ``q``
alone would put first the atoms that fired on one image of the label and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from torch import Tensor

from sae_pipeline.features.chance import FDR, Chance, chance
from sae_pipeline.features.label_intervals import intervals
from sae_pipeline.features.label_weights import WeightedStats, weighted_stats

BLOCK = 2048  # atoms per block
PER_LABEL = 24  # atoms listed on each label's page

FORMULA = (
    "q[l] = (c[l] / m[l]) / Σ_l' (c[l'] / m[l']), with c[l] the images of label l the atom fires on and m[l] the "
    "images of label l (the share with the label prior divided out); top label = argmax q, its share q[top]; "
    "selectivity S = 1 − H(q) / log L, H(q) = −Σ q log q over the L labels (0: fires on every label alike, "
    "1: on one label only)"
)


@dataclass
class LabelStats:
    """Per-atom label statistics (``labels``: the label ids with images; every ``[.., L]`` array follows it)."""

    labels: np.ndarray  # int64 [L]
    names: list[str]
    images: np.ndarray  # int64 [L]: m, the prior's counts
    n_unlabelled: int  # images without a label
    fire: np.ndarray  # int64 [d_sae, L]: c
    fire_unlabelled: np.ndarray  # int64 [d_sae]
    top_images: np.ndarray  # int64 [d_sae, N]: label of each top-N image (-1: none or unlabelled)
    top_label: np.ndarray  # int64 [d_sae]: a label id, -1 when the atom never fired on a labelled image
    top_share: np.ndarray  # float64 [d_sae]: q[top]
    selectivity: np.ndarray  # float64 [d_sae]
    per_label: dict[int, list[int]]  # label id -> atoms ranked by F1[j, l] (then q[j, l]), at most PER_LABEL
    chance: Chance  # each atom against as many random images
    interval: tuple[np.ndarray, ...]  # float64 [d_sae] each: S low, S high, q[top] low, q[top] high (95 %)
    weighted: WeightedStats | None = None  # the same weighted by activation (None: the pass kept no sums)

    @property
    def prior(self) -> np.ndarray:
        return self.images / max(int(self.images.sum()), 1)

    def column(self, label: int) -> int:
        return int(np.searchsorted(self.labels, label))

    def name(self, label: int) -> str:
        return self.names[self.column(label)] if label >= 0 else "–"

    def q(self, atom: int) -> np.ndarray:
        """The atom's prior-corrected label distribution ``[L]`` (zeros when it never fired on a labelled image)."""
        return _q(self.fire[atom : atom + 1].astype(np.float64), self.images)[0]

    def f1(self, atom: int, column: int) -> float:
        """How well the atom's firing matches label column ``column``: 2 c / (n + m)."""
        return 2 * self.fire[atom, column] / (self.fire[atom].sum() + self.images[column])

    def top_counts(self, atom: int) -> np.ndarray:
        """How many of the atom's top-N images have each label ``[L]``."""
        labels = self.top_images[atom]
        labels = labels[labels >= 0]
        return np.bincount(np.searchsorted(self.labels, labels), minlength=len(self.labels))

    def arrays(self) -> dict[str, np.ndarray]:
        """What ``features.npz`` adds (the pass's raw counts ``label_fire``, ``label_images`` are by label id)."""
        return {
            "label_ids": self.labels,
            "label_top_images": self.top_images,
            "label_top": self.top_label,
            "label_top_share": self.top_share,
            "label_selectivity": self.selectivity,
            "label_chance_selectivity": self.chance.mean,
            "label_chance_selectivity_sd": self.chance.sd,
            "label_selectivity_excess": self.chance.excess,
            "label_selectivity_p": self.chance.p,
            "label_selectivity_p_method": self.chance.method,
            "label_top_p": self.chance.top_p,
            "label_selectivity_low": self.interval[0],
            "label_selectivity_high": self.interval[1],
            "label_top_share_low": self.interval[2],
            "label_top_share_high": self.interval[3],
            "label_selectivity_p_adjusted": self.chance.p_adjusted,
            "label_beats_chance": self.chance.beats,
            "label_too_few": self.chance.too_few,
            "label_chance_by_n": self.chance.by_n_mean,
            "label_chance_sd_by_n": self.chance.by_n_sd,
            **(self.weighted.arrays() if self.weighted is not None else {}),
        }

    def summary(self) -> dict[str, Any]:
        """What ``features.json`` records."""
        return {
            "labels": [
                {"id": int(label), "name": name, "images": int(count)}
                for label, name, count in zip(self.labels, self.names, self.images)
            ],
            "images_unlabelled": self.n_unlabelled,
            "selectivity": FORMULA,
            "chance": self.chance.summary(),
            "weighted": self.weighted.summary() if self.weighted is not None else None,
        }


def prior_corrected_shares(fire: np.ndarray, images: np.ndarray) -> np.ndarray:
    """``q [d_sae, L]`` from the counts ``c [d_sae, L]`` and ``m [L]``; its argmax is the top label (public: so
    `evaluate causal` names an atom's top label as the browser does)."""
    return _q(np.asarray(fire, np.float64), np.asarray(images))


def _q(fire: np.ndarray, images: np.ndarray) -> np.ndarray:
    rate = fire / np.maximum(images, 1)[None, :]
    total = rate.sum(1, keepdims=True)
    return np.divide(rate, total, out=np.zeros_like(rate), where=total > 0)


def label_stats(state: dict[str, Tensor], collection: dict[str, Any], fdr: float = FDR) -> LabelStats | None:
    """The statistics of a merged state (None when no image carries a label); ``fdr``: the false-discovery
    rate at which an atom beats chance."""
    if "label_images" not in state:
        return None
    all_images = state["label_images"].numpy()
    labels = np.flatnonzero(all_images > 0).astype(np.int64)
    if len(labels) == 0:
        return None
    fire = state["label_fire"].numpy()[:, labels]
    images = all_images[labels]
    d_sae = fire.shape[0]
    names = {int(label): str(label) for label in labels}
    key_label = {}
    for key, meta in collection["images"].items():
        label = meta.get("label")
        if isinstance(label, int) and label >= 0:
            key_label[int(key)] = label
            if meta.get("class_name") and label in names:
                names[label] = str(meta["class_name"])
    top_keys = state["image"].numpy()
    top_images = np.vectorize(lambda key: key_label.get(int(key), -1), otypes=[np.int64])(top_keys)
    top_images = top_images.reshape(top_keys.shape)
    top_label = np.full(d_sae, -1, np.int64)
    top_share = np.full(d_sae, np.nan)
    selectivity = np.full(d_sae, np.nan)
    best = tuple(np.zeros((0, len(labels)), dtype) for dtype in (np.float64, np.int64, np.float64))
    for start in range(0, d_sae, BLOCK):
        block = fire[start : start + BLOCK].astype(np.float64)
        q = _q(block, images)
        fired = q.sum(1) > 0
        top = q.argmax(1)
        rows = np.arange(len(q))
        top_label[start : start + len(q)] = np.where(fired, labels[top], -1)
        top_share[start : start + len(q)] = np.where(fired, q[rows, top], np.nan)
        if len(labels) > 1:
            with np.errstate(divide="ignore", invalid="ignore"):
                entropy = -np.where(q > 0, q * np.log(q), 0.0).sum(1)
            selectivity[start : start + len(q)] = np.where(fired, 1 - entropy / np.log(len(labels)), np.nan)
        f1 = 2 * block / (block.sum(1, keepdims=True) + images[None, :])
        best = _best_per_label(best, f1, q, start)
    order_f1, order_atoms, _ = best
    per_label = {
        int(label): [int(a) for a, value in zip(order_atoms[:, i], order_f1[:, i]) if value > 0]
        for i, label in enumerate(labels)
    }
    against_chance = chance(fire, images, selectivity, fdr)
    return LabelStats(
        labels,
        [names[int(label)] for label in labels],
        images,
        int(state["label_images_unlabelled"]),
        fire,
        state["label_fire_unlabelled"].numpy(),
        top_images,
        top_label,
        top_share,
        selectivity,
        per_label,
        against_chance,
        intervals(fire, images, np.searchsorted(labels, np.maximum(top_label, 0))),
        weighted_stats(state, labels, images, against_chance.n_min, fdr, against_chance.draws),
    )


def _best_per_label(best: tuple, f1: np.ndarray, q: np.ndarray, start: int) -> tuple:
    """Each label's PER_LABEL atoms with the largest ``F1`` (ties: the larger ``q``, then the lower id), so far."""
    values = np.concatenate([best[0], f1])
    atoms = np.concatenate([best[1], np.arange(start, start + len(q))[:, None].repeat(q.shape[1], 1)])
    shares = np.concatenate([best[2], q])
    order = np.lexsort((atoms, -shares, -values), axis=0)[:PER_LABEL]
    return tuple(np.take_along_axis(a, order, 0) for a in (values, atoms, shares))


__all__ = ["FORMULA", "LabelStats", "label_stats", "prior_corrected_shares"]
