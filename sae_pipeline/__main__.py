"""``python -m sae_pipeline {fit,validate,test,predict,export} ...``.

``export`` is dispatched here (plain argparse, no Lightning needed); the other subcommands
go to :class:`sae_pipeline.cli.SAECLI`. Errors the product raises for bad input (a
ValueError naming the file, field or flag and the fix) end the run with that one line on
stderr and exit status 1; set ``SAE_PIPELINE_TRACEBACK=1`` to see the traceback instead.
"""
from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        if args[:1] == ["export"]:
            from sae_pipeline.export import main as export_main

            export_main(args[1:])
        else:
            from sae_pipeline.cli import cli_main

            cli_main(argv)  # None: LightningCLI reads sys.argv itself
    except ValueError as exn:  # includes FloatingPointError subclasses of ValueError, ShardFormatError, ...
        if os.environ.get("SAE_PIPELINE_TRACEBACK"):
            raise
        message = str(exn).strip().splitlines()[0] if str(exn).strip() else type(exn).__name__
        print(f"error: {type(exn).__name__}: {message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
