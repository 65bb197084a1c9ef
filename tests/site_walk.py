"""Walk a feature browser site in a real headless Chromium: every page it links, every ``href`` and ``src``.

Generic on purpose: it follows the links themselves (the ones the pages' scripts render too), so a kind of
page added later is walked without a change here.
"""

from __future__ import annotations

import contextlib
import io
import shutil
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlsplit

import numpy as np
from PIL import Image
from system_tools import require

CHROMIUM = "chromium"
# every link and source of the page as the browser resolved it, and the images that did not load
REFS = """() => [Array.from(document.querySelectorAll("[href], [src]")).map(e => e.href || e.src),
    Array.from(document.images).filter(img => !(img.complete && img.naturalWidth > 0)).map(img => img.src)]"""


@contextlib.contextmanager
def chromium() -> Iterator:
    """Debian's chromium through playwright (never a downloaded browser); skips with the install command."""
    require([CHROMIUM], "apt-get install -y chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        instance = p.chromium.launch(
            executable_path=shutil.which(CHROMIUM),
            headless=True,
            args=["--no-sandbox", "--allow-file-access-from-files"],
        )
        try:
            yield instance
        finally:
            instance.close()


def local_path(url: str) -> Path | None:
    """The file a ``file://`` URL names (fragment and query dropped), None for other schemes."""
    parts = urlsplit(url)
    return Path(unquote(parts.path)) if parts.scheme == "file" else None


def walk_site(
    browser, starts: list[Path], within: Path | None = None, every_screenshot: bool = False
) -> dict[Path, list[str]]:
    """Open every HTML page reachable from ``starts`` (and inside ``within``, when given: pages outside it are
    only checked to exist); returns ``{page: problems}`` for every page opened.

    A problem: a link or source that names a missing file or leaves the disk (no network in a site),
    a script error, an image that did not load, a blank screenshot. Screenshots cost most of the walk's
    time: one per kind of page (its folder and whether it is an index) unless ``every_screenshot``.
    """
    shot_kinds: set[tuple[Path, bool]] = set()
    within = None if within is None else within.resolve()
    todo, report = [start.resolve() for start in starts], {}
    while todo:
        fpath = todo.pop()
        if fpath in report:
            continue
        problems: list[str] = []
        page = browser.new_page(viewport={"width": 1000, "height": 700})
        page.on("pageerror", lambda exn, problems=problems: problems.append(f"script error: {exn}"))
        page.on("console", lambda msg, problems=problems: problems.append(msg.text) if msg.type == "error" else None)
        page.goto(fpath.as_uri())  # waits for "load": the scripts have rendered
        refs, not_loaded = page.evaluate(REFS)
        for url in refs:
            target = local_path(url)
            if target is None:
                problems.append(f"not a local file: {url}")
            elif not target.is_file():
                problems.append(f"broken link: {url}")
            elif target.suffix == ".html" and target.resolve() not in report:
                if within is None or target.resolve().is_relative_to(within):
                    todo.append(target.resolve())
        problems += [f"image not loaded: {src}" for src in not_loaded]
        kind = (fpath.parent, fpath.name == "index.html")
        if every_screenshot or kind not in shot_kinds:
            shot_kinds.add(kind)
            shot = np.asarray(Image.open(io.BytesIO(page.screenshot())).convert("L"))
            if shot.size == 0 or len(np.unique(shot)) < 3:
                problems.append("blank screenshot")
        report[fpath] = list(problems)
    page.close()
    return report
