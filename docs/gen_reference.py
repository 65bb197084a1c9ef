"""Writes the tables the docs take from the code, so that they cannot drift from it.

Each generated block in README.md and docs/ sits between ``<!-- generated: NAME -->`` and
``<!-- end generated -->``; this script rewrites the text between them from the code:

- ``variants``: the SAE registry (``sae_pipeline.sae.VARIANTS``), one row per variant;
- ``backbones``: the backbone registry (``feature_extraction/backbones/registry.py``);
- ``configs``: every file under ``configs/`` with the first line of its leading comment;
- ``commands``: the subcommands of ``python -m sae_pipeline`` (``COMMANDS``, ``LIGHTNING_COMMANDS``)
  and of ``python -m feature_extraction``;
- ``markers``: the pytest markers declared in ``pyproject.toml``.

``python docs/gen_reference.py`` rewrites the blocks; ``--check`` only reports the ones that differ
(exit 1). ``tests/test_docs_drift.py`` fails when a committed block is not what this script writes.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- generated: (?P<name>[a-z_]+) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S)


def variants_table() -> str:
    from sae_pipeline.sae import VARIANTS

    rows = ["| name | class | what it is | sparsity set by |", "| --- | --- | --- | --- |"]
    for cls in VARIANTS:
        summary = (cls.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
        name = f"`{cls.key}`" + "".join(f" (alias `{alias}`)" for alias in cls.aliases)
        rows.append(f"| {name} | `{cls.__name__}` | {summary} | `{cls.sparsity_knob}` |")
    return "\n".join(rows) + "\n"


def backbones_table() -> str:
    from feature_extraction.backbones.registry import BACKBONES

    rows = [
        "| name | library | model | pretrained tag | prefix tokens | patch grid | d | image size | configs |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for spec in BACKBONES.values():
        grid = "×".join(map(str, spec.grid))
        tag = f"`{spec.pretrained_tag}`" if spec.pretrained_tag else "none (random weights: tests)"
        rows.append(
            f"| `{spec.name}` | {spec.library} | `{spec.model_name}` | {tag} | {spec.n_prefix_tokens} | "
            f"{grid} | {spec.d} | {spec.image_size} | {'yes' if spec.has_configs else 'no'} |"
        )
    return "\n".join(rows) + "\n"


def _first_comment(fpath: Path) -> str:
    """The first sentence of the file's leading comment (up to '. ' or ': ' outside brackets)."""
    lines = []
    for line in fpath.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#") or line.startswith("#  ") or not line.strip("# "):
            break  # the comment ends, or an indented command example starts
        lines.append(line.lstrip("#").strip())
    text, depth = " ".join(lines), 0
    for index, char in enumerate(text):
        depth += {"(": 1, "[": 1, ")": -1, "]": -1}.get(char, 0)
        if depth == 0 and char in ".:" and text[index + 1 : index + 2] in (" ", ""):
            return text[: index + (char == ".")].replace("|", "\\|")
    return text.replace("|", "\\|")


def configs_table() -> str:
    rows = ["| file | what it is |", "| --- | --- |"]
    for fpath in sorted((ROOT / "configs").rglob("*")):
        if fpath.is_file() and fpath.suffix in (".yaml", ".yml", ".txt"):
            rows.append(f"| `{fpath.relative_to(ROOT).as_posix()}` | {_first_comment(fpath)} |")
    return "\n".join(rows) + "\n"


def commands_table() -> str:
    from sae_pipeline.__main__ import COMMANDS, LIGHTNING_COMMANDS, PROG

    rows = ["| command | what it does |", "| --- | --- |"]
    rows += [f"| `{PROG} {name}` | {text} |" for name, text in LIGHTNING_COMMANDS.items()]
    rows += [f"| `{PROG} {name}` | {text} |" for name, (_, text) in COMMANDS.items()]
    rows.append("| `python -m feature_extraction` | the same as `extract` |")
    rows.append("| `python -m feature_extraction finalize` | write `manifest.json` once every shard exists |")
    return "\n".join(rows) + "\n"


def markers_table() -> str:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    rows = ["| marker | meaning |", "| --- | --- |"]
    for marker in config["tool"]["pytest"]["ini_options"]["markers"]:
        name, _, text = marker.partition(":")
        rows.append(f"| `{name.strip()}` | {text.strip()} |")
    return "\n".join(rows) + "\n"


GENERATORS: dict[str, Callable[[], str]] = {
    "variants": variants_table,
    "backbones": backbones_table,
    "configs": configs_table,
    "commands": commands_table,
    "markers": markers_table,
}


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def render(text: str) -> str:
    """``text`` with every generated block rewritten; an unknown block name is an error."""

    def replace(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in GENERATORS:
            raise ValueError(f"unknown generated block {name!r}; known: {', '.join(GENERATORS)}")
        return match.group(1) + GENERATORS[name]() + match.group(4)

    return BLOCK.sub(replace, text)


def stale() -> list[Path]:
    """The documents whose generated blocks differ from what the code gives now."""
    return [
        fpath for fpath in documents() if render(fpath.read_text(encoding="utf-8")) != fpath.read_text(encoding="utf-8")
    ]


def main(argv: list[str]) -> int:
    if "--check" in argv:
        paths = stale()
        for fpath in paths:
            print(f"stale generated block in {fpath.relative_to(ROOT)}; run: python docs/gen_reference.py")
        return 1 if paths else 0
    for fpath in documents():
        text = fpath.read_text(encoding="utf-8")
        new = render(text)
        if new != text:
            fpath.write_text(new, encoding="utf-8")
            print(f"rewrote {fpath.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main(sys.argv[1:]))
