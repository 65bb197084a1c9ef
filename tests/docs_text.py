"""The prose of the repository: what the docs tests read for links, paths and commands.

Prose is every Markdown file (README.md, BENCHMARKS.md, docs/), and the comments and docstrings of
the code, configs and scripts (Python, YAML, shell, the Dockerfile, the Makefile). Code itself is
not prose: a test may well name ``/tmp`` or a file it is about to create.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from collections.abc import Iterator
from pathlib import Path

REPO_DPATH = Path(__file__).resolve().parents[1]
COMMENTED_SUFFIXES = {".yaml", ".yml", ".sh", ".txt", ".toml", ".Containerfile"}
COMMENTED_NAMES = {"Dockerfile", "Makefile"}


def tracked_files() -> list[Path]:
    """Files git tracks, plus the untracked ones it does not ignore (a new file counts before its commit)."""
    listing = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO_DPATH,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [REPO_DPATH / name for name in sorted(set(listing)) if (REPO_DPATH / name).is_file()]


def markdown_files() -> list[Path]:
    return [fpath for fpath in tracked_files() if fpath.suffix == ".md"]


def _python_prose(text: str) -> Iterator[tuple[int, str]]:
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                yield body[0].lineno, body[0].value.value


def prose(fpath: Path) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of the prose in one file (nothing for a file that has none)."""
    try:
        text = fpath.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return
    if fpath.suffix == ".md":
        yield from enumerate(text.splitlines(), 1)
    elif fpath.suffix == ".py":
        yield from _python_prose(text)
    elif fpath.suffix in COMMENTED_SUFFIXES or fpath.name in COMMENTED_NAMES:
        for number, line in enumerate(text.splitlines(), 1):
            if "#" in line:
                yield number, line[line.index("#") :]


def all_prose() -> Iterator[tuple[Path, int, str]]:
    for fpath in tracked_files():
        for number, text in prose(fpath):
            yield fpath, number, text


# A repository path as prose names it: a top-level folder of this repository, then a file with a suffix.
REPO_PATH = re.compile(
    r"(?<![\w./-])((?:sae_pipeline|feature_extraction|tests|configs|benchmarks|slurm|docker|docs|\.ci)"
    r"/[\w./-]*\w)(?![\w<{*]|/[\w./-]*[<{*])"
)  # a path with a placeholder (<name>, {a,b}, *) is a pattern
# A file named without its folder (``export.py``, ``mpsae_dinov2.yaml``): some tracked file must end with it.
FILE_NAME = re.compile(r"(?<![\w./*}>-])([\w][\w./-]*\.(?:py|yaml|yml|sh|md))(?![\w<{*/])")
# Files that runs and users write (not in the repository), named as examples.
WRITTEN_AT_RUN_TIME = {
    "config.yaml",
    "hparams.yaml",
    "CFG.yaml",
    "file.yaml",
    "evilmod.py",
    "group.yaml",
    "causal.md",
    "intervene.md",
}
# Paths of the machine a text was written on, never of a user's.
MACHINE_PATH = re.compile(r"(?<![\w.])(/work/|/root/|/home/(?!u/)[\w.-]+/|/tmp/[\w.-])")


NOT_RUN = "not run by the tests:"
FENCE = re.compile(r"^```(\w*)\s*$")


def bash_commands(fpath: Path) -> Iterator[tuple[int, str, str | None]]:
    """``(line number, command, reason it is not run or None)`` of every command in the ``bash`` blocks.

    Continuation lines (a trailing backslash) are joined; a trailing ``# comment`` is cut off the
    command. A comment ``# not run by the tests: REASON`` after a command marks that command; on a
    line of its own it marks every command after it in the same block.
    """
    language = None
    block_reason: str | None = None
    pending = ""
    start = 0
    for number, line in enumerate(fpath.read_text(encoding="utf-8").splitlines(), 1):
        fence = FENCE.match(line.strip())
        if fence:
            language = None if language is not None else fence.group(1)
            block_reason = None
            continue
        if language != "bash":
            continue
        stripped = line.strip()
        if not pending:
            start = number
            if not stripped:
                continue
            if stripped.startswith("#"):
                if NOT_RUN in stripped:
                    block_reason = stripped.split(NOT_RUN, 1)[1].strip()
                continue
        if stripped.endswith("\\"):
            pending += stripped[:-1].rstrip() + " "
            continue
        command, comment = split_comment(pending + stripped)
        pending = ""
        reason = comment.split(NOT_RUN, 1)[1].strip() if NOT_RUN in comment else block_reason
        yield start, command, reason


def split_comment(line: str) -> tuple[str, str]:
    """``(command, comment)``: the comment is what follows the first ``#`` outside quotes after a space."""
    quote = None
    for index, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or line[index - 1].isspace()):
            return line[:index].strip(), line[index + 1 :].strip()
    return line.strip(), ""


def documented_commands() -> Iterator[tuple[Path, int, str, str | None]]:
    for fpath in markdown_files():
        if fpath.name == "BENCHMARKS.md" or "figures" in fpath.parts:
            continue  # measurements, each with the command that produced it; not instructions to copy
        for number, command, reason in bash_commands(fpath):
            yield fpath, number, command, reason
