"""Command-line arguments that argparse / jsonargparse would misread, fixed before parsing.

- ``--model.lr -1e-3``: argparse takes ``-1e-3`` for an option (its negative-number rule
  knows ``-1`` and ``-0.5``, not exponents) and says "expected one argument"; joined as
  ``--model.lr=-1e-3`` the value reaches the model, which names what is wrong with it.
- ``--model.members.NAME.lr 0.01``: ``model.members`` is a plain mapping to jsonargparse, so a flag below a
  member replaced the whole member (``{lr: 0.01}``: "must hold sae"); these flags are taken out
  (`member_flags`) and merged into the config's members (`merge_member_flags`), over every
  config file, as other flags are (``SAECLI.parse_arguments``).
- A YAML syntax error in ``--config FILE``: jsonargparse reports it over several lines without
  the file's name; here it is one line naming the file, the line and the column.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from sae_pipeline.config_files import check_includes, read_yaml
from sae_pipeline.training.group import plain_config

MEMBER_FLAG = "--model.members."
EXPONENT_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
NEGATIVE_NUMBER = re.compile(r"-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|-inf|-nan", re.IGNORECASE)


def normalize_args(args: list[str]) -> list[str]:
    """``[..., "--flag", "-1e-3", ...]`` -> ``[..., "--flag=-1e-3", ...]`` (other arguments unchanged)."""
    out: list[str] = []
    for arg in args:
        previous = out[-1] if out else ""
        if NEGATIVE_NUMBER.fullmatch(arg) and previous.startswith("--") and "=" not in previous and previous != "--":
            out[-1] = f"{previous}={arg}"
        else:
            out.append(arg)
    return out


def member_flags(args: list[str]) -> tuple[list[str], list[tuple[str, list[str], str]]]:
    """Take ``--model.members.NAME.KEY[.KEY...] VALUE`` (or ``=VALUE``) out of ``args``: (the other arguments,
    ``[(NAME, [KEY, ...], VALUE), ...]``). A flag naming a whole member (``--model.members.NAME '{...}'``)
    stays, for the parser."""
    rest: list[str] = []
    flags: list[tuple[str, list[str], str]] = []
    index = 0
    while index < len(args):
        arg = args[index]
        flag, joined, value = arg.partition("=")
        path = flag[len(MEMBER_FLAG) :].split(".") if flag.startswith(MEMBER_FLAG) else []
        if len(path) >= 2 and all(path) and (joined or index + 1 < len(args)):
            if not joined:
                index += 1
                value = args[index]
            flags.append((path[0], path[1:], value))
        else:
            rest.append(arg)
        index += 1
    return rest, flags


def merge_member_flags(members: object, flags: list[tuple[str, list[str], str]]) -> object:
    """``members`` with each flag's value (read as YAML, as the parser reads a value of any type) set at its
    place, the dicts on the way created where missing."""
    if not flags:
        return members
    merged = plain_config(members) if members is not None else {}
    if not isinstance(merged, dict):
        return members  # not a mapping: the group's own check says so
    for name, keys, text in flags:
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        if isinstance(value, str) and EXPONENT_NUMBER.fullmatch(value):
            value = float(value)  # YAML 1.1 reads 1e-3 as a string; the parser (and a typed flag) as a float
        node = merged.setdefault(name, {})
        for key in keys[:-1]:
            if not isinstance(node, dict):
                break
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        if isinstance(node, dict):
            node[keys[-1]] = value
    return merged


def config_files(args: list[str], option: str = "--config") -> list[str]:
    """The values of ``--config FILE``, ``--config=FILE`` and ``-c FILE`` (or of another ``option``)."""
    names = ("--config", "-c") if option == "--config" else (option,)
    found = []
    for index, arg in enumerate(args):
        if arg in names and index + 1 < len(args):
            found.append(args[index + 1])
        elif arg.startswith(f"{option}="):
            found.append(arg.split("=", 1)[1])
    return found


def check_config_files(args: list[str]) -> None:
    """A one-line ``ValueError`` for a ``--config`` file, or a piece it includes, with a YAML syntax error or
    (a piece) missing; other problems: the parser's."""
    for name in config_files(args):
        fpath = Path(name)
        if not fpath.is_file():
            continue  # jsonargparse names a missing file itself
        loaded = read_yaml(fpath)  # bounded (size, nesting, aliases), before the parser reads it
        if isinstance(loaded, dict):
            check_includes(fpath)  # the pieces it names (configs/vision/, configs/data/)


def names_group(args: list[str]) -> bool:
    """Whether the command trains or uses a group of SAEs (:mod:`sae_pipeline.training.group`): a ``--config``
    file (or a piece it includes) whose ``model`` holds ``members``, a ``--model.members*`` flag, or a
    ``--ckpt_path FILE`` written by a group. LightningCLI takes one model class, chosen before parsing."""
    if any(arg.startswith("--model.members") for arg in args):
        return True
    if any(_config_names_group(Path(name), set()) for name in config_files(args)):
        return True
    return any(_checkpoint_is_group(Path(name)) for name in config_files(args, "--ckpt_path"))


def _config_names_group(fpath: Path, seen: set[Path]) -> bool:
    """Whether ``fpath`` or a piece it includes gives ``model.members``; a name given twice there is a one-line
    ValueError (YAML keeps the last of two equal keys, so one SAE would silently be lost)."""
    if fpath in seen or not fpath.is_file():
        return False
    seen.add(fpath)
    try:
        root = yaml.compose(fpath.read_text())
    except (yaml.YAMLError, UnicodeDecodeError, OSError, RecursionError):
        return False  # check_config_files says what is wrong
    if not isinstance(root, yaml.MappingNode):
        return False
    model = _mapping_value(root, "model")
    members = _mapping_value(model, "members") if isinstance(model, yaml.MappingNode) else None
    if members is not None:
        names: set[str] = set()
        for key, _ in members.value if isinstance(members, yaml.MappingNode) else []:
            if key.value in names:
                raise ValueError(
                    f"config file {fpath}: model.members names {key.value!r} twice (line {key.start_mark.line + 1}); "
                    "give each SAE its own name"
                )
            names.add(key.value)
        return True
    includes = _mapping_value(root, "config")
    if isinstance(includes, yaml.ScalarNode):
        pieces = [includes.value]
    elif isinstance(includes, yaml.SequenceNode):
        pieces = [node.value for node in includes.value if isinstance(node, yaml.ScalarNode)]
    else:
        pieces = []
    return any(_config_names_group(fpath.parent / str(name), seen) for name in pieces)


def _mapping_value(node: yaml.MappingNode, key: str) -> yaml.Node | None:
    for key_node, value_node in node.value:
        if isinstance(key_node, yaml.ScalarNode) and key_node.value == key:
            return value_node
    return None


def _checkpoint_is_group(fpath: Path) -> bool:
    if not fpath.is_file():
        return False  # `last`, or a path the checkpoint reader names as missing
    import torch

    try:
        checkpoint = torch.load(fpath, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 -- the checkpoint reader says what is wrong with it
        return False
    return isinstance(checkpoint, dict) and "sae_group" in checkpoint
