"""Command-line arguments that argparse / jsonargparse would misread, fixed before parsing.

- ``--model.lr -1e-3``: argparse takes ``-1e-3`` for an option (its negative-number rule
  knows ``-1`` and ``-0.5``, not exponents) and says "expected one argument"; joined as
  ``--model.lr=-1e-3`` the value reaches the model, which names what is wrong with it.
- A YAML syntax error in ``--config FILE``: jsonargparse reports it over several lines without
  the file's name; here it is one line naming the file, the line and the column.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from sae_pipeline.config_files import check_includes

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
        try:
            loaded = yaml.safe_load(fpath.read_text())
        except yaml.YAMLError as exn:
            mark = getattr(exn, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(exn, "problem", None) or str(exn).splitlines()[0]
            raise ValueError(f"config file {name}: YAML syntax error{where}: {problem}; fix the file") from None
        except UnicodeDecodeError:
            raise ValueError(f"config file {name}: not a text (YAML) file; pass a .yaml config") from None
        if isinstance(loaded, dict):
            check_includes(fpath)  # the pieces it names (configs/vision/, configs/data/)
