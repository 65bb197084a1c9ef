"""Training configs made of pieces, read as one YAML document without the CLI's parser.

The backbone configs are composed, so that each setting is written once:

- ``configs/vision/recipe.yaml``: the paper's vision recipe shared by every variant (trainer,
  checkpointing, the data settings but the source);
- ``configs/vision/<variant>.yaml``: the variant's model section, then ``config: recipe.yaml``;
- ``configs/data/<backbone>.yaml``: the data section of one backbone (its shard folder);
- ``configs/<variant>_<backbone>.yaml``: a shortcut holding no setting, only
  ``data: data/<backbone>.yaml`` and ``config: vision/<variant>.yaml``.

These are the parser's (jsonargparse's) own nested files: a key ``config: FILE`` reads a whole
config, a section given as a file name (``data: FILE``) reads that section, both relative to the
including file. What the including file sets wins over what it includes, but a section written
*after* ``config:`` would replace the included section whole, so ``config:`` comes last.
``python -m sae_pipeline fit --config configs/mpsae_dinov2.yaml`` therefore parses exactly as the
one-file config it replaced did. A backbone without a shortcut of its own trains with
``--config configs/vision/<variant>.yaml --data configs/data/<backbone>.yaml`` (run
``runs/<variant>_<backbone>``, :mod:`sae_pipeline.cli`).

Code that reads a config as data (the study's runs, ``features``, the tests) uses
:func:`load_config`, which follows the same references; :func:`setting_sources` says which file
sets each setting, for the check that none is set twice.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import yaml

INCLUDE_KEY = "config"
MAX_BYTES = 16 << 20
MAX_DEPTH = 32  # a config nests 5 deep (model.members.NAME.sae.init_args)
MAX_NODES = 100_000
YAML_SUFFIXES = (".yaml", ".yml")


def read_yaml(fpath: Path) -> Any:
    """The YAML document in ``fpath``, read bounded: at most `MAX_BYTES`, UTF-8, nesting at most `MAX_DEPTH` and at
    most `MAX_NODES` values once its aliases are expanded (a config is a few hundred; ``&a [*b, *b]`` chains make a
    file of a few lines stand for 2^30, which every reader that walks it would expand). Any other file is one
    ValueError naming it and the fix."""
    if fpath.stat().st_size > MAX_BYTES:
        raise ValueError(f"config file {fpath}: larger than {MAX_BYTES >> 20} MiB, not a training config; fix the file")
    try:
        text = fpath.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"config file {fpath}: not UTF-8 text (YAML); fix the file") from None
    if _flow_depth(text) > MAX_DEPTH:  # PyYAML's scanner takes time quadratic in this depth, its composer recurses
        raise ValueError(f"config file {fpath}: nests more than {MAX_DEPTH} deep; fix the file")
    try:
        config = yaml.safe_load(text)
    except RecursionError:
        raise ValueError(f"config file {fpath}: nests more than {MAX_DEPTH} deep; fix the file") from None
    except yaml.YAMLError as exn:
        mark = getattr(exn, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exn, "problem", None) or str(exn).splitlines()[0]
        raise ValueError(f"config file {fpath}: YAML syntax error{where}: {problem}; fix the file") from None
    problem = _size_problem(config)
    if problem:
        raise ValueError(f"config file {fpath}: {problem}; fix the file")
    return config


def _flow_depth(text: str) -> int:
    """How deeply ``[`` / ``{`` nest in ``text`` outside quotes and comments (YAML's flow style), read in one pass."""
    depth = deepest = 0
    quote, previous, comment = "", "\n", False
    for char in text:
        if comment:
            comment = char != "\n"
        elif quote:
            quote = "" if char == quote and previous != "\\" else quote
        elif char in "\"'":
            quote = char
        elif char == "#" and previous in " \t\n":
            comment = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth = max(depth - 1, 0)
        previous = char
    return deepest


def _size_problem(value: Any) -> str | None:
    """Too deep or too many values (aliases expanded), counted without recursion and stopped at the limit."""
    nodes, stack = 0, [(value, 0)]
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if nodes > MAX_NODES:
            return f"holds more than {MAX_NODES} values once its aliases are expanded"
        if isinstance(node, (dict, list)):
            if depth >= MAX_DEPTH:
                return f"nests more than {MAX_DEPTH} deep"
            children = [*node.keys(), *node.values()] if isinstance(node, dict) else node
            stack.extend((child, depth + 1) for child in children)
    return None


def _read(fpath: Path) -> dict:
    if not fpath.is_file():
        raise ValueError(f"config file {fpath}: not found; fix the reference to it")
    config = read_yaml(fpath) or {}
    if not isinstance(config, dict):
        raise ValueError(f"config file {fpath}: not a mapping of settings; fix the file")
    return config


def _is_file_ref(value: Any) -> bool:
    return isinstance(value, str) and value.endswith(YAML_SUFFIXES)


def _leaves(section: dict, prefix: str) -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (a list or a scalar is a leaf)."""
    out: dict[str, Any] = {}
    for key, value in section.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_leaves(value, name + "."))
        else:
            out[name] = value
    return out


def _settings(fpath: Path, seen: tuple[Path, ...] = ()) -> list[tuple[str, Any, Path]]:
    """Every (dotted key, value, file setting it), included files first (the includer wins)."""
    fpath = Path(fpath).resolve()
    if fpath in seen:
        raise ValueError(f"config file {fpath}: includes itself (through {' -> '.join(map(str, seen))})")
    raw = _read(fpath)
    keys = list(raw)
    if INCLUDE_KEY in raw and keys[-1] != INCLUDE_KEY:
        raise ValueError(
            f"config file {fpath}: '{INCLUDE_KEY}:' must be its last key (a section after it would "
            "replace the included one whole); move it to the end"
        )
    included: list[tuple[str, Any, Path]] = []
    own: list[tuple[str, Any, Path]] = []
    for key, value in raw.items():
        if key == INCLUDE_KEY:
            included = _settings(fpath.parent / str(value), (*seen, fpath))
        elif _is_file_ref(value):
            section_fpath = (fpath.parent / value).resolve()
            own += [(name, leaf, section_fpath) for name, leaf in _leaves(_read(section_fpath), f"{key}.").items()]
        elif isinstance(value, dict) and value:
            own += [(name, leaf, fpath) for name, leaf in _leaves(value, f"{key}.").items()]
        else:
            own.append((key, value, fpath))
    return included + own


def check_includes(fpath: str | Path) -> None:
    """A one-line ValueError for a file the config includes that is missing or not valid YAML."""
    fpath = Path(fpath)
    raw = _read(fpath)
    for key, value in raw.items():
        if key == INCLUDE_KEY and isinstance(value, str):
            check_includes(fpath.parent / value)
        elif _is_file_ref(value):
            _read(fpath.parent / value)


def setting_sources(fpath: str | Path) -> dict[str, list[Path]]:
    """Dotted setting -> the files that set it (more than one: a setting written twice)."""
    sources: dict[str, list[Path]] = {}
    for name, _, source in _settings(Path(fpath)):
        sources.setdefault(name, []).append(source)
    return sources


def source_files(fpath: str | Path) -> list[Path]:
    """The config file and every file it includes, in the order they are read."""
    files = [Path(fpath).resolve()]
    for _, _, source in _settings(Path(fpath)):
        if source not in files:
            files.append(source)
    return files


def config_sha256(fpath: str | Path) -> str:
    """A fingerprint of every file the config reads (for a one-file config: the file's own sha256)."""
    digest = hashlib.sha256()
    for source in source_files(fpath):
        digest.update(source.read_bytes())
    return digest.hexdigest()


def load_config(fpath: str | Path) -> dict:
    """The config as one nested dict, includes resolved (later settings win, as in the parser)."""
    config: dict = {}
    for name, value, _ in _settings(Path(fpath)):
        *parents, leaf = name.split(".")
        node = config
        for parent in parents:
            if not isinstance(node.get(parent), dict):
                node[parent] = {}
            node = node[parent]
        node[leaf] = value
    return config
