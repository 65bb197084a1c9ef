"""`python -m feature_extraction`: extract tokens into shards; `... finalize --out DIR` writes the manifest.

`--out` may be a URL (`s3://bucket/prefix`): the shards are uploaded as they are written (`remote_out`).

The flags are `extract`'s (and `finalize`'s) signature, read by jsonargparse, so every
option is a flag, `--config file.yaml` sets any of them and `--print_config` shows the
result. Errors, a bad flag included, are one line on stderr (``exit_status``): exit 2 for bad input, 1 for
anything else the command anticipates (disk full, a held finalize lock), 130 / 143 for Ctrl-C /
SIGTERM (finished shards are kept; a rerun resumes).
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from jsonargparse import ActionConfigFile, ArgumentParser

from feature_extraction.exit_status import run_cli
from feature_extraction.extract import extract
from feature_extraction.shards.finalize import finalize
from feature_extraction.store import display

PROG = "python -m feature_extraction"


def build_parser(command: str = "extract") -> ArgumentParser:
    """The parser of `extract` (default) or `finalize`; also used by tests to parse configs/*.yaml."""
    function: Callable = {"extract": extract, "finalize": finalize}[command]
    prog = PROG if command == "extract" else f"{PROG} finalize"
    description = (function.__doc__ or "").split("\n\n")[0]
    if command == "extract":
        description += f" Subcommand: `{PROG} finalize --out DIR` assembles manifest.json when all shards exist."
    parser = ArgumentParser(prog=prog, description=description, exit_on_error=False)
    parser.add_argument("--config", action=ActionConfigFile, help="YAML file setting any of the options below.")
    parser.add_function_arguments(function, as_positional=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status (``exit_status``: 2 bad input, 1 runtime, 130/143 interrupted)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = "finalize" if argv[:1] == ["finalize"] else "extract"
    if command == "finalize":
        argv = argv[1:]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def run(parsed: Any) -> dict:
        config = parsed.as_dict()
        config.pop("config", None)
        if command == "finalize":
            manifest = finalize(**config)
            summary = {k: manifest[k] for k in ("n_images", "n_tokens", "d", "tokens_per_image")}
            summary["skipped"] = len(manifest["skipped"])
            return summary
        summary = extract(**config)
        summary["shards_written"] = len(summary["shards_written"])
        return summary

    kept = (
        "finished shards are kept; rerun the same command to resume"
        if command == "extract"
        else "manifest.json was not written; rerun finalize"
    )
    status, summary = run_cli(
        build_parser(command),
        argv,
        run,
        interrupted=kept,
        kept=lambda parsed: f"the complete shards in {display(str(parsed.out))}",
    )
    if status == 0:
        print(json.dumps(summary, default=str))
    return status


if __name__ == "__main__":
    sys.exit(main())
