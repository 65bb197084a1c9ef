"""One command of ``benchmarks/scaling/pipeline.py``'s curves, run in this fresh process, with its stage times as JSON.

    python -m benchmarks.scaling.commands fit ARGS        # python -m sae_pipeline fit ARGS
    python -m benchmarks.scaling.commands features ARGS   # python -m sae_pipeline features ARGS
    python -m benchmarks.scaling.commands evaluate ARGS   # python -m sae_pipeline.evaluate ARGS
    python -m benchmarks.scaling.commands extract ARGS    # python -m feature_extraction ARGS

Why a wrapper and not the bare command: the libraries' imports (torch, Lightning, torchmetrics: 5-15 s
on a loaded 2-core box) are the same at every size and would flatten every curve, so they are done
first and timed apart (``imports_s``, with the RSS they leave, ``rss_after_imports_mib``: the memory
curves' offset); ``command_s`` is the command itself, called through the same ``main`` as
``python -m ...``. Stage marks are taken by wrapping one function of the product, nothing else changes:

- ``fit``: ``first_step_s``, from the command's start to the first call of ``SAEModule.training_step``
  (argument parsing, manifest, sidecars and integrity checks, the train/val split, the model's setup
  and the loader's first batch): the start-up.
- ``features``: ``site_s``, the call of ``build_site`` (pages, heatmaps, thumbnails, swap into
  ``--out``); ``pass_s`` is everything before it (SAE load, checks, the streaming pass).

The last stdout line is the JSON object ``benchmarks.scaling.fit.run_point`` reads.
"""

from __future__ import annotations

import time

START = time.perf_counter()

import json  # noqa: E402 (the clock starts first)
import resource  # noqa: E402
import sys  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from typing import Any  # noqa: E402


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _import(kind: str) -> None:
    import lightning  # noqa: F401
    import torch  # noqa: F401

    if kind == "extract":
        import timm  # noqa: F401

        import feature_extraction.__main__  # noqa: F401
    else:
        import sae_pipeline.__main__  # noqa: F401
        import sae_pipeline.cli  # noqa: F401
        import sae_pipeline.evaluate.__main__  # noqa: F401
        import sae_pipeline.features.cli  # noqa: F401
        import sae_pipeline.features.site  # noqa: F401
        import sae_pipeline.training.interrupts  # noqa: F401


@contextmanager
def _mark_first_call(owner: Any, name: str, marks: dict[str, float]) -> Iterator[None]:
    """Within the block, ``owner.name``'s first call and return are timed (``marks[name + "_start"/"_end"]``)."""
    original = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        marks.setdefault(f"{name}_start", time.perf_counter())
        try:
            return original(*args, **kwargs)
        finally:
            marks.setdefault(f"{name}_end", time.perf_counter())

    setattr(owner, name, timed)
    try:
        yield
    finally:
        setattr(owner, name, original)


def run(kind: str, argv: list[str]) -> dict[str, float]:
    """The command's stage times; in this process (``--quick`` calls it directly: one import for every point)."""
    _import(kind)
    result = {"imports_s": time.perf_counter() - START, "rss_after_imports_mib": _rss_mib()}
    marks: dict[str, float] = {}
    start = time.perf_counter()
    if kind == "extract":
        from feature_extraction.__main__ import main as extract_main

        status = extract_main(argv)
    elif kind == "evaluate":
        from sae_pipeline.evaluate.__main__ import main as evaluate_main

        status = evaluate_main(argv)
    else:
        from sae_pipeline.__main__ import main
        from sae_pipeline.features import site
        from sae_pipeline.training.module import SAEModule

        owner, name = (SAEModule, "training_step") if kind == "fit" else (site, "build_site")
        with _mark_first_call(owner, name, marks):
            status = main([kind, *argv])
    end = time.perf_counter()
    if status:
        raise SystemExit(status)
    result["command_s"] = end - start
    if kind == "fit":
        result["first_step_s"] = marks["training_step_start"] - start
    if kind == "features":
        result["pass_s"] = marks["build_site_start"] - start
        result["site_s"] = marks["build_site_end"] - marks["build_site_start"]
    return result


def main() -> None:
    result = run(sys.argv[1], sys.argv[2:])
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
