"""Benchmark: how each stage's time and peak memory grow with its size, against the slope its algorithm predicts.

    python -m benchmarks.scaling                      # every part at its full sizes (BENCHMARKS.md, "Cost curves")
    python -m benchmarks.scaling --parts train_d_sae  # one part
    python -m benchmarks.scaling --quick              # tiny sizes, every part (tests/test_benchmarks_scaling.py)

Each part measures one stage at >= 4 sizes spanning >= 16x (in --quick, fewer and smaller) and returns
``Curve`` objects; the fit, the flag (a slope above its expectation) and the table are in
``benchmarks/scaling/fit.py``. The parts live in ``benchmarks/scaling/compute.py`` (the
numerical kernels: training steps, Babel, predict, the loader) and ``benchmarks/scaling/pipeline.py``
(the commands around them: ``fit`` start-up vs shards, the feature browser, extraction, memory vs tokens).
Writes ``scaling.{json,md,png}`` (the curves, the table, the figure) to ``--out`` and prints the table, each
expected slope next to the fitted one.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.scaling import compute, pipeline
from benchmarks.scaling.fit import Curve, markdown_table, plot

PARTS = {**compute.PARTS, **pipeline.PARTS}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", choices=sorted(PARTS), default=sorted(PARTS))
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    parser.add_argument("--out", type=Path, default=Path("scaling_out"))
    compute.add_arguments(parser)
    pipeline.add_arguments(parser)
    return parser.parse_args(argv)


def write_outputs(curves: list[Curve], out: Path) -> None:
    (out / "scaling.md").write_text(markdown_table(curves) + "\n")
    (out / "scaling.json").write_text(json.dumps([c.to_json() for c in curves], indent=1) + "\n")
    plot(curves, out / "scaling.png")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    curves = []
    for name in args.parts:
        start = time.perf_counter()
        part = PARTS[name](args)
        print(f"# {name}: {time.perf_counter() - start:.0f} s", flush=True)
        print(markdown_table(part), flush=True)
        curves += part
        write_outputs(curves, args.out)  # after each part: a long run stopped later keeps what it measured
    print(markdown_table(curves))
    flagged = [c.stage for c in curves if c.flags]
    print(f"flagged: {', '.join(flagged) or 'none'}")


if __name__ == "__main__":
    main()
