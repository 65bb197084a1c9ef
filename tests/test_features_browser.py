"""The feature browser in a real headless Chromium (Debian's ``chromium`` through playwright), from disk."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from features_fixtures import GRID, N_PREFIX, REPLACED, D, identity_sae, write_export, write_replicas, write_shards
from PIL import Image
from site_walk import chromium, walk_site

from sae_pipeline.__main__ import main


def thresholded_sae(tokens: np.ndarray):
    """The identity SAE with per-atom thresholds (codes = relu(x - t)) set from the tokens so that atom j fires on
    ``FIRES[j]`` of the 14 images: the index has atoms with too few images to say beside atoms tested."""
    best = np.sort(tokens.reshape(14, -1, D).max(1), axis=0)[::-1]  # [rank, atom]: each image's best token
    thresholds = [0.0 if k >= 14 else float(best[k - 1, j] + best[k, j]) / 2 for j, k in enumerate(FIRES)]
    sae = identity_sae()
    with torch.no_grad():
        sae.b_enc.copy_(-torch.tensor(thresholds))
    return sae


FIRES = (14, 14, 12, 10, 9, 8, 7, 6, 5, 3, 2, 1)  # atom 0 untouched (its page shows 5 cards)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("browser")
    tokens, _ = write_shards(root / "shards", root / "images")
    out = root / "site"
    assert (
        main(
            [
                "features",
                "--sae",
                str(write_export(thresholded_sae(tokens), root / "sae")),
                "--data.source",
                str(root / "shards"),
                "--out",
                str(out),
                "--top",
                "5",
                "--neighbours",
                "3",
                "--replicas",  # the identity's seeds: the thresholded SAE has the same dictionary
                *write_replicas(root),
                "--data.num_workers",
                "0",
                "--trainer.accelerator",
                "cpu",
            ]
        )
        == 0
    )
    return out


@pytest.fixture(scope="module")
def browser():
    with chromium() as instance:
        yield instance


def open_page(browser, url: str):
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda exn: errors.append(str(exn)))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.goto(url)
    page.wait_for_load_state("load")
    return page, errors


def all_images_loaded(page) -> list[str]:
    """The src of every <img> that did not load (complete with a natural width)."""
    return page.evaluate("""() => Array.from(document.images)
        .filter(img => !(img.complete && img.naturalWidth > 0)).map(img => img.src)""")


def non_blank(png: bytes) -> bool:
    pixels = np.asarray(Image.open(io.BytesIO(png)).convert("L"), np.float32)
    return pixels.std() > 5 and len(np.unique(pixels)) > 20


def test_index_lists_every_atom_sorts_and_searches(site, browser, tmp_path) -> None:
    page, errors = open_page(browser, (site / "index.html").as_uri())
    assert page.locator("#atoms tbody tr").count() == D
    assert page.locator("#count").inner_text() == f"{D} of {D} atoms"
    assert all_images_loaded(page) == [] and page.locator("#atoms tbody img").count() == D
    shot = page.screenshot(path=str(tmp_path / "index.png"), full_page=True)
    assert (tmp_path / "index.png").stat().st_size > 0 and non_blank(shot)
    # sort by frequency (descending on first click): the first row is the most frequent atom
    freq = np.load(site / "features.npz")["fire_count"]
    page.locator('th[data-key="frequency"]').click()
    assert page.locator("#atoms tbody tr").first.get_attribute("data-id") == str(int(np.argmax(freq)))
    # --replicas: the "found in" cell under its header (as many cells as headers), its tooltip the cosines, sortable
    headers = page.locator("#atoms thead th").all_inner_texts()
    assert set(page.locator("#atoms tbody tr").evaluate_all("rows => rows.map(r => r.cells.length)")) == {len(headers)}
    page.locator('th[data-key="found_in"]').click()  # descending first: the atoms found in every seed
    page.locator('th[data-key="found_in"]').click()
    row = page.locator("#atoms tbody tr").first
    cell = row.locator("td").nth(headers.index("found in (of 3 seeds)"))
    assert [row.get_attribute("data-id")] == [str(a) for a in range(D) if all(a in lost for lost in REPLACED)]
    assert cell.inner_text() == "1 of 3"  # lost by both replicas
    assert cell.get_attribute("title") == "partner |cos| per replica: 0.00, 0.00"
    page.locator("#search").fill("1")
    ids = [int(i) for i in page.locator("#atoms tbody tr").evaluate_all("rows => rows.map(r => r.dataset.id)")]
    assert sorted(ids) == [i for i in range(D) if str(i).startswith("1")]
    page.locator("#search").press("Enter")  # exact id 1 -> its page
    page.wait_for_url("**/atoms/01.html")
    assert page.locator("h1").inner_text() == "Atom #1"
    assert errors == []


def test_atom_pages_load_draw_and_link(site, browser, tmp_path) -> None:
    page, errors = open_page(browser, (site / "atoms" / "00.html").as_uri())
    assert all_images_loaded(page) == []
    n_cards = page.locator("section.top figure.card").count()
    assert n_cards == 5 and page.locator("section.top figure.card img").count() == 5
    # the activation histogram, and band example cards drawn like the top ones (every image loaded, above)
    assert page.locator("svg.histogram rect").count() > 0
    n_band = page.locator("section.distribution figure.card").count()
    assert n_band > 0 and page.locator("section.distribution figure.card img").count() == n_band
    # the heatmap canvases are drawn (not transparent) and the prefix tokens are chips apart from the grid
    drawn = page.evaluate("""() => Array.from(document.querySelectorAll("canvas")).map(c => {
        const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
        let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++; return n; })""")
    assert len(drawn) == 5 + n_band and min(drawn) > 0
    assert page.locator("figure.card .prefix .tok").count() == (5 + n_band) * 3  # CLS + 2 registers per card
    shot = page.screenshot(path=str(tmp_path / "atom.png"), full_page=True)
    assert non_blank(shot)
    # links to neighbours, prev/next, index and the images' pages (that they resolve: the site walk below)
    hrefs = page.locator("a").evaluate_all("links => links.map(a => a.href)")
    assert any("/atoms/" in h for h in hrefs) and any(h.endswith("index.html") for h in hrefs)
    assert any("/images/" in h for h in hrefs)
    assert errors == []
    # the index links every page, and the pages exist
    index, _ = open_page(browser, (site / "index.html").as_uri())
    links = index.locator("#atoms tbody a").evaluate_all("links => links.map(a => a.href)")
    assert len(links) == D and all(Path(link.removeprefix("file://")).is_file() for link in links)


def canvas_pixels(page, selector: str) -> int:
    """How many pixels of the canvas are drawn (not transparent)."""
    return page.evaluate(
        """(sel) => { const c = document.querySelector(sel); const d = c.getContext("2d")
        .getImageData(0, 0, c.width, c.height).data; let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++;
        return n; }""",
        selector,
    )


def by_excess(table) -> list[int]:
    """The atoms by their excess over chance as the index rounds it (4 digits), largest first, ties by id."""
    excess = [float(f"{x:.4g}") if np.isfinite(x) else None for x in table["label_selectivity_excess"]]
    return sorted(range(D), key=lambda a: (excess[a] is None, -(excess[a] or 0.0), a))


def check_chance_order_and_marks(page, table) -> None:
    """The index opens sorted by the excess over chance (largest first, atoms without one last), atoms with too
    few images greyed, atoms tested that do not beat chance tagged."""
    rows = page.locator("#atoms tbody tr")
    ids = [int(i) for i in rows.evaluate_all("rows => rows.map(r => r.dataset.id)")]
    assert ids == by_excess(table)
    assert page.locator('th[data-key="excess"]').get_attribute("class") == "sorted-desc"
    classes = dict(zip(ids, rows.evaluate_all("rows => rows.map(r => r.className)")))
    too_few = {a for a in range(D) if table["label_too_few"][a]}
    null = {
        a
        for a in range(D)
        if np.isfinite(table["label_selectivity_p_adjusted"][a]) and not table["label_beats_chance"][a]
    }
    assert too_few and null  # the thresholds give both kinds
    assert {a for a, c in classes.items() if c == "few"} == too_few
    assert {a for a, c in classes.items() if c == "chance"} == null
    assert page.locator("tr.chance .tag.chance").count() == len(null)
    assert page.locator("tr.few").first.evaluate("r => getComputedStyle(r.cells[0]).opacity") == "0.55"


def test_label_statistics_scatter_filter_and_label_pages(site, browser, tmp_path) -> None:
    table = np.load(site / "features.npz")
    page, errors = open_page(browser, (site / "index.html").as_uri())
    assert canvas_pixels(page, "#scatter") > 500  # axes and one dot per atom
    page.locator("#label-filter").select_option("1")  # the filter by top label
    ids = [int(i) for i in page.locator("#atoms tbody tr").evaluate_all("rows => rows.map(r => r.dataset.id)")]
    assert ids == [atom for atom in by_excess(table) if table["label_top"][atom] == 1]  # in the first sort
    page.locator("#label-filter").select_option("")
    check_chance_order_and_marks(page, table)
    page.locator('th[data-key="selectivity"]').click()  # sortable: descending first
    first = page.locator("#atoms tbody tr").first.get_attribute("data-id")
    assert table["label_selectivity"][int(first)] == np.nanmax(table["label_selectivity"])
    page.locator('th[data-key="weighted_selectivity"]').click()  # weighted by activation: sortable too
    first = page.locator("#atoms tbody tr").first
    weighted = table["label_weighted_selectivity"]
    assert weighted[int(first.get_attribute("data-id"))] == pytest.approx(np.nanmax(weighted), abs=1e-4)
    assert first.locator("td").last.inner_text().startswith(f"{np.nanmax(weighted):.3f}")
    assert errors == []  # (the index's screenshot, labels included, is the test above's)
    atom, atom_errors = open_page(browser, (site / "atoms" / "00.html").as_uri())
    bars = atom.locator("svg.lbar")
    assert bars.count() == 4 and atom.locator("svg.lbar rect").count() >= 4  # the counts, weighted, top-N, prior
    assert min(bars.nth(i).bounding_box()["width"] for i in range(4)) > 100  # visible, not collapsed
    assert non_blank(atom.screenshot(full_page=True)) and atom_errors == []
    for label in (1,):
        other, other_errors = open_page(browser, (site / "labels" / f"{label}.html").as_uri())
        assert other.locator("h1").inner_text() == f"Label class{label}"
        assert other.locator("article.label-atom").count() > 0 and all_images_loaded(other) == []
        listed = [int(t.lstrip("#")) for t in other.locator("article.label-atom h3 a").all_inner_texts()]
        mine = sum(int((table["label_top_images"][atom] == label).sum()) for atom in listed)
        assert other.locator("article.label-atom img.t.mine").count() == mine > 0  # this label's images outlined
        hrefs = other.locator("a").evaluate_all("links => links.map(a => a.href)")
        assert all(Path(h.removeprefix("file://")).is_file() for h in hrefs)
        shot = other.screenshot(path=str(tmp_path / f"label{label}.png"), full_page=True)
        assert (tmp_path / f"label{label}.png").stat().st_size > 0 and non_blank(shot) and other_errors == []
        other.close()


@pytest.mark.slow
def test_every_page_of_the_site_renders_with_no_broken_link(site, browser) -> None:
    """Walk the whole site from its index (any kind of page, following the links the pages and their scripts
    render): every page renders and screenshots non-blank, every href and src names a file of the site."""
    report = walk_site(browser, [site / "index.html"])
    assert set(report) == set(site.resolve().rglob("*.html"))  # no page unreachable from the index
    assert {"atoms", "images"} <= {page.parent.name for page in report}
    assert {page: problems for page, problems in report.items() if problems} == {}


def dense_codes() -> tuple[np.ndarray, np.ndarray]:
    """The fixture site's codes (``relu(x - t)``, the thresholded identity SAE) and positions, recomputed
    from the same deterministic shards."""
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        tokens, positions = write_shards(Path(scratch) / "shards", Path(scratch) / "images")
    sae = thresholded_sae(tokens)
    return np.maximum(tokens - (-sae.b_enc.detach().numpy()), 0), positions


def shown_list(page) -> list[tuple[int, str]]:
    items = page.locator("#patch-list li")
    texts = items.evaluate_all(
        "items => items.map(li => [li.querySelector('.atom').textContent, (li.querySelector('a') || {}).href || ''])"
    )
    return [(int(text.lstrip("#")), href) for text, href in texts]


def test_image_page_click_a_patch_lists_its_top_atoms(site, browser) -> None:
    """Click a patch (and a prefix chip) of an image page opened from disk: the list becomes that token's top atoms
    as a dense computation ranks them, each linking to an existing atom page."""
    codes, positions = dense_codes()
    tpi = len(positions) // 14
    key = 3
    page, errors = open_page(browser, (site / "images" / f"{key}.html").as_uri())
    grid = page.locator("#patch-grid")
    box = grid.bounding_box()
    seen = []
    mine = codes[key * tpi : (key + 1) * tpi]
    for token in range(tpi):
        p = int(positions[key * tpi + token])
        if p >= N_PREFIX:
            r, c = divmod(p - N_PREFIX, GRID[1])
            grid.click(position={"x": (c + 0.5) * box["width"] / GRID[1], "y": (r + 0.5) * box["height"] / GRID[0]})
        else:
            page.locator(f'#patch-prefix .tok[data-i="{p}"]').click()
        assert page.locator("#patch-list").get_attribute("data-position") == str(p)
        row = mine[token]
        want = sorted((a for a in range(D) if row[a] > 0), key=lambda a: (-row[a], a))[:5]
        shown = shown_list(page)
        assert [a for a, _ in shown] == want, (token, p)
        assert all(Path(href.removeprefix("file://")).is_file() and f"/atoms/{a:02d}.html" in href for a, href in shown)
        seen.append(tuple(a for a, _ in shown))
    assert len(set(seen)) > 1  # the list changes from token to token
    # a patch the extraction did not store says so, with no list
    stored = set(positions[key * tpi : (key + 1) * tpi].tolist())
    missing = next(p for p in range(N_PREFIX, N_PREFIX + GRID[0] * GRID[1]) if p not in stored)
    r, c = divmod(missing - N_PREFIX, GRID[1])
    grid.click(position={"x": (c + 0.5) * box["width"] / GRID[1], "y": (r + 0.5) * box["height"] / GRID[0]})
    assert "not stored" in page.locator("#patch-name").inner_text() and shown_list(page) == []
    assert errors == []
