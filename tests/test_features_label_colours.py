"""The label parts' page defects of issue 34: one colour per label on every page, a legend on the index scatter,
numbers never split, ties for the top label stated."""

from __future__ import annotations

import re

import numpy as np
import torch

from sae_pipeline.features import label_pages
from sae_pipeline.features.assets import CSS
from sae_pipeline.features.label_assets import LABELS_CSS, LABELS_JS
from sae_pipeline.features.selectivity import label_stats


def stats_of(fire: np.ndarray, images: list[int]):
    state = {
        "label_fire": torch.from_numpy(np.asarray(fire, np.int64)),
        "label_images": torch.tensor(images),
        "label_fire_unlabelled": torch.zeros(len(fire), dtype=torch.int64),
        "label_images_unlabelled": torch.tensor(0),
        "image": torch.full((len(fire), 2), -1),
    }
    return label_stats(state, {"images": {}})


def bar_colours(section: str) -> dict[str, str]:
    """Label name -> fill colour of the first bar's rectangles."""
    first = section.split('<svg class="lbar"')[1]
    return {name: colour for colour, name in re.findall(r'fill="(#[0-9a-f]{6})"><title>([^:]+):', first)}


def test_one_colour_per_label_on_every_page_and_none_shared() -> None:
    for n in (2, 10, 20, 21, 1000):
        colours = label_pages.label_colours(n)
        assert len(colours) == n == len(set(colours)) and all(re.fullmatch("#[0-9a-f]{6}", c) for c in colours)
    fire = np.array([[5, 1, 0, 3], [0, 2, 6, 1], [1, 1, 1, 9]])  # each atom orders the labels differently
    stats = stats_of(fire, [10, 10, 10, 10])
    seen: dict[str, set[str]] = {}
    for atom in range(3):
        for name, colour in bar_colours(label_pages.atom_section(stats, atom, 2)).items():
            seen.setdefault(name, set()).add(colour)
    assert all(len(colours) == 1 for colours in seen.values()) and len(seen) == 4
    palette = label_pages.label_colours(4)
    assert {name: colours.pop() for name, colours in seen.items()} == {str(i): palette[i] for i in range(4)}
    data = label_pages.index_data(stats)  # the scatter's dots and its legend: the same colours
    assert data["colours"] == {str(i): palette[i] for i in range(4)} and "PALETTE" not in LABELS_JS
    legend = label_pages.index_section(stats)
    assert [c for c in re.findall(r"background:(#[0-9a-f]{6})", legend)][:4] == list(palette)
    assert "legend-note" in label_pages.scatter_legend(stats_of(np.ones((2, 30)), [3] * 30))  # 30 labels: a note


def test_ties_for_the_top_label_are_stated() -> None:
    stats = stats_of(np.array([[4, 4, 0], [4, 2, 0], [1, 1, 1]]), [10, 10, 10])
    pages = [label_pages.atom_section(stats, atom, 2) for atom in range(3)]
    assert "tied with" in pages[0] and ">1</a>: equal c / m" in pages[0] and "tied with" not in pages[1]
    assert "tied with" in pages[2] and ">1</a>, <a" in pages[2]
    column = label_pages.INDEX_COLUMNS.index("top_ties")
    assert [label_pages.index_columns(stats, atom)[column] for atom in range(3)] == [1, 0, 2]
    assert "tied</span>" in LABELS_JS


def test_numbers_are_never_split() -> None:
    assert "break-all" not in CSS + LABELS_CSS
    assert ".value, .num { white-space: nowrap; }" in CSS and "td { white-space: nowrap; }" in LABELS_CSS
