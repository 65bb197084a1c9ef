"""``python -m sae_pipeline {fit,validate,test,predict,export,extract} ...``.

``export`` is dispatched here (plain argparse, no Lightning needed), ``extract`` goes to
``python -m feature_extraction`` (same flags; one entry point for the Docker image); the other subcommands
go to :class:`sae_pipeline.cli.SAECLI`. Errors the product raises for bad input (a
ValueError naming the file, field or flag and the fix) end the run with that one line on
stderr and exit status 1; set ``SAE_PIPELINE_TRACEBACK=1`` to see the traceback instead.

In a multi-process job (``srun``, torchrun) every rank usually hits the same bad input at the
same moment. Ranks other than 0 wait a few seconds before printing theirs: rank 0's exit
makes the launcher stop them (``srun --kill-on-bad-exit=1`` in ``slurm/train.sh``), so the
job log gets the line once; an error only one rank hits is still printed, a little later.
"""
from __future__ import annotations

import os
import sys
import time

PEER_ERROR_DELAY_S = 5.0


def _rank() -> int:
    """This process's global rank in a multi-process launch (0 when alone)."""
    for name in ("RANK", "SLURM_PROCID"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["extract"]:  # the Docker image's one entry point reaches extraction too
        from feature_extraction.__main__ import main as extract_main

        return extract_main(args[1:])
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
        if _rank() > 0:
            time.sleep(PEER_ERROR_DELAY_S)
        print(f"error: {type(exn).__name__}: {message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
