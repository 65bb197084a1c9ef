"""``python -m benchmarks.scaling --quick`` over the command-level parts (``benchmarks/scaling/pipeline.py``).

One run in this process (``--quick`` runs each command in-process: the imports once), read by every test.
"""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.scaling import pipeline
from benchmarks.scaling.__main__ import main as scaling_main

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def curves(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("scaling")
    scaling_main(["--quick", "--parts", *pipeline.PARTS, "--out", str(out)])
    assert (out / "scaling.png").stat().st_size > 0
    assert "fit start-up" in (out / "scaling.md").read_text()
    return {c["stage"]: c for c in json.loads((out / "scaling.json").read_text())}


def test_every_part_has_its_curves(curves) -> None:
    assert set(curves) == {
        "fit start-up (to step 1)",
        "features pass vs d_sae",
        "features site vs d_sae",
        "features pass vs N",
        "features site vs N",
        "extract (vit_tiny)",
        "fit vs tokens",
        "features vs tokens",
        "evaluate vs tokens",
    }


def test_points_and_slopes_are_finite(curves) -> None:
    for stage, curve in curves.items():
        assert len(curve["xs"]) >= 2 and len(curve["seconds"]) == len(curve["xs"]), stage
        assert curve["xs"] == sorted(curve["xs"]) and len(set(curve["xs"])) == len(curve["xs"]), stage
        assert all(s > 0 for s in curve["seconds"]), stage
        assert math.isfinite(curve["time_slope"]), stage
        if curve["peak_mib"] is not None:
            assert len(curve["peak_mib"]) == len(curve["xs"]) and math.isfinite(curve["memory_slope"]), stage


def test_sizes_are_what_each_part_says(curves) -> None:
    assert curves["fit start-up (to step 1)"]["xs"] == [10, 40]
    tokens = curves["evaluate vs tokens"]["xs"]
    assert tokens[1] == 2 * tokens[0]  # twice the shards of the same size
    assert curves["fit vs tokens"]["xs"] == tokens == curves["features vs tokens"]["xs"]
