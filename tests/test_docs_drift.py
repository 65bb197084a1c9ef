"""The docs cannot drift from the code: generated tables, links, named files, machine paths.

- The tables the docs take from the code (variants, backbones, configs, commands, test markers) are
  what ``docs/gen_reference.py`` writes now.
- Every relative link and image of README.md, BENCHMARKS.md and docs/ resolves, anchors included.
- No prose (Markdown, comments, docstrings: ``tests/docs_text.py``) names a repository file that does
  not exist, a path of the machine it was written on, or the starting design file outside the
  repository.
"""

from __future__ import annotations

import importlib.util
import re
import unicodedata
from pathlib import Path

import pytest
from docs_text import (
    FILE_NAME,
    MACHINE_PATH,
    REPO_DPATH,
    REPO_PATH,
    WRITTEN_AT_RUN_TIME,
    all_prose,
    markdown_files,
    tracked_files,
)


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_reference", REPO_DPATH / "docs" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- generated tables ----------------------------------------------------------------------------------


def test_generated_blocks_are_what_the_code_gives() -> None:
    stale = [fpath.relative_to(REPO_DPATH).as_posix() for fpath in load_generator().stale()]
    assert stale == [], f"run: python docs/gen_reference.py (stale: {stale})"


def test_every_generator_has_a_block_in_the_docs() -> None:
    generator = load_generator()
    text = "".join(fpath.read_text(encoding="utf-8") for fpath in generator.documents())
    assert [name for name in generator.GENERATORS if f"<!-- generated: {name} -->" not in text] == []


def test_generator_rewrites_a_stale_block() -> None:
    generator = load_generator()
    stale = "before\n<!-- generated: variants -->\n| old | table |\n<!-- end generated -->\nafter\n"
    rendered = generator.render(stale)
    assert "| old | table |" not in rendered and rendered.startswith("before\n") and rendered.endswith("after\n")
    from sae_pipeline.sae import VARIANTS

    assert all(f"`{cls.__name__}`" in rendered for cls in VARIANTS)
    with pytest.raises(ValueError, match="unknown generated block"):
        generator.render("<!-- generated: nothing -->\n<!-- end generated -->")


def test_hand_written_variant_tables_list_the_registry() -> None:
    """The definitions table of docs/variants.md is prose, so it is checked: one row per variant, in order."""
    from sae_pipeline.sae import VARIANTS

    text = (REPO_DPATH / "docs" / "variants.md").read_text(encoding="utf-8")
    table = text.split("| name | codes | loss |", 1)[1].split("\n\n", 1)[0]
    keys = re.findall(r"^\| `(\w+)`", table, re.M)
    assert keys == [cls.key for cls in VARIANTS]


def test_readme_is_a_door() -> None:
    assert len((REPO_DPATH / "README.md").read_text(encoding="utf-8").splitlines()) <= 250


# -- links -----------------------------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def github_slug(heading: str) -> str:
    """The anchor GitHub (and MkDocs, for these headings) gives a heading."""
    kept = "".join(c for c in heading.strip().lower() if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return kept.replace(" ", "-")


def anchors(fpath: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", fpath.read_text(encoding="utf-8"), flags=re.S)
    return {github_slug(line.lstrip("#")) for line in text.splitlines() if re.match(r"#{1,6} ", line)}


def broken_links(fpath: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", fpath.read_text(encoding="utf-8"), flags=re.S)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        path, _, anchor = target.partition("#")
        resolved = (fpath.parent / path).resolve() if path else fpath
        if not resolved.exists() or REPO_DPATH not in resolved.parents:
            broken.append(f"{target}: no such file in the repository")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading with that anchor")
    return broken


@pytest.mark.parametrize("fpath", markdown_files(), ids=lambda p: p.relative_to(REPO_DPATH).as_posix())
def test_links_and_images_resolve(fpath: Path) -> None:
    assert broken_links(fpath) == []


def test_link_checker_finds_broken_links(tmp_path: Path) -> None:
    page = REPO_DPATH / "docs" / "_probe_links.md"  # inside the repository, so relative links resolve there
    try:
        page.write_text(
            "# Top\n\n[ok](index.md) [ok](#top) [bad](nowhere.md) ![bad](figures/none.png) "
            "[bad](training.md#no-such-heading) [out](../../x.md) [web](https://example.org)\n"
            "```bash\n[not a link](in-code.md)\n```\n",
            encoding="utf-8",
        )
        assert [entry.split(":")[0] for entry in broken_links(page)] == [
            "nowhere.md",
            "figures/none.png",
            "training.md#no-such-heading",
            "../../x.md",
        ]
    finally:
        page.unlink()


def test_slug_matches_the_anchors_used() -> None:
    assert github_slug("One GPU, or all GPUs of one machine") == "one-gpu-or-all-gpus-of-one-machine"
    assert github_slug("Docker (cloud GPUs)") == "docker-cloud-gpus"
    assert github_slug("Loading an artifact: trusted modules") == "loading-an-artifact-trusted-modules"


# -- named files and machine paths -------------------------------------------------------------------------


def test_prose_names_only_files_that_exist() -> None:
    """A path from the repository's root must exist; a bare file name must be the end of a tracked path."""
    tracked = [fpath.relative_to(REPO_DPATH).as_posix() for fpath in tracked_files()]
    missing = []
    for fpath, number, text in all_prose():
        where = f"{fpath.relative_to(REPO_DPATH)}:{number}"
        missing += [
            f"{where}: {m.group(1)}" for m in REPO_PATH.finditer(text) if not (REPO_DPATH / m.group(1)).exists()
        ]
        for match in FILE_NAME.finditer(text):
            name = match.group(1)
            written = name.rsplit("/", 1)[-1] in WRITTEN_AT_RUN_TIME  # also inside a run folder: version_N/config.yaml
            if not written and not any(p == name or p.endswith("/" + name) for p in tracked):
                missing.append(f"{where}: {name}")
    assert missing == []


def test_prose_names_no_path_of_the_machine_it_was_written_on() -> None:
    found = [
        f"{fpath.relative_to(REPO_DPATH)}:{number}: {match.group(0)}"
        for fpath, number, text in all_prose()
        for match in MACHINE_PATH.finditer(text)
    ]
    assert found == []


def test_path_patterns_catch_what_they_are_for() -> None:
    names = [
        m.group(1)
        for m in REPO_PATH.finditer(
            "see sae_pipeline/sae/mp.py, `configs/<variant>_mnist.yaml`, tests/test_x.py::name, "
            "configs/data/<name>.yaml and docs/design.md."
        )
    ]
    assert names == ["sae_pipeline/sae/mp.py", "tests/test_x.py", "docs/design.md"]
    bare = [m.group(1) for m in FILE_NAME.finditer("in export.py, `*_dinov2.yaml` and configs/<v>_x.yaml; sae/relu.py")]
    assert bare == ["export.py", "sae/relu.py"]
    found = [
        m.group(0)
        for m in MACHINE_PATH.finditer(
            "--out /work/eval --x /root/a /home/alice/b /tmp/run /data/imagenet/train /home/u/data"
        )
    ]
    assert found == ["/work/", "/root/", "/home/alice/", "/tmp/r"]


def test_nothing_points_outside_the_repository() -> None:
    """The starting design file and the shared folder exist only on the machine the project began on."""
    design, shared = "DESIGN" + ".md", "../" + "shared"
    found = []
    for fpath in tracked_files():
        try:
            text = fpath.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # figures, weights
        found += [fpath.relative_to(REPO_DPATH).as_posix()] if design in text or shared in text else []
    assert found == []


# -- Python snippets -------------------------------------------------------------------------------------


def snippet_imports() -> list[tuple[str, str]]:
    """``(where, import statement)`` of every ``python`` block of the docs."""
    found = []
    for fpath in markdown_files():
        for block in re.findall(r"^```python\n(.*?)^```", fpath.read_text(encoding="utf-8"), re.S | re.M):
            found += [
                (fpath.relative_to(REPO_DPATH).as_posix(), line.split("#")[0].strip())
                for line in block.splitlines()
                if re.match(r"(from \S+ )?import ", line)
            ]
    return found


def test_python_snippets_import_what_exists() -> None:
    """The public API the docs show is importable under the names they use (the code after it is a sketch
    on the reader's own tensors)."""
    imports = snippet_imports()
    assert len(imports) >= 3
    for _where, statement in imports:
        exec(statement, {})  # noqa: S102 (our own docs' import lines)


SECTION_REFERENCE = re.compile(r"README\W{0,3}\"([^\"]+)\"")


def test_readme_sections_named_in_prose_exist() -> None:
    """A README section named in a comment must name a heading the README still has (its content moved to docs/)."""
    headings = {
        line.lstrip("#").strip()
        for line in (REPO_DPATH / "README.md").read_text(encoding="utf-8").splitlines()
        if line.startswith("#")
    }
    stale = [
        f"{fpath.relative_to(REPO_DPATH)}:{number}: {match.group(1)}"
        for fpath, number, text in all_prose()
        for match in SECTION_REFERENCE.finditer(text)
        if match.group(1) not in headings
    ]
    assert stale == []
