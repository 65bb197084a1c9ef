"""benchmarks/scaling/: the slope fit and its flags against a plain reference, one point per real process,
and a --quick run of the numerical-kernel parts end to end (in this process)."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.scaling.compute import PARTS as COMPUTE_PARTS
from benchmarks.scaling.fit import SLOPE_TOLERANCE, Curve, loglog_slope, run_point


def reference_slope(xs: np.ndarray, ys: np.ndarray) -> float:
    """Ordinary least squares written out: cov(log x, log y) / var(log x)."""
    lx, ly = np.log(xs), np.log(ys)
    return float(((lx - lx.mean()) * (ly - ly.mean())).sum() / ((lx - lx.mean()) ** 2).sum())


def test_loglog_slope_matches_the_reference_on_random_power_laws() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(2, 9))
        xs = np.sort(rng.uniform(1, 1e5, n))
        exponent, scale = rng.uniform(-2, 3), rng.uniform(1e-3, 1e3)
        exact = scale * xs**exponent
        assert loglog_slope(list(xs), list(exact)) == pytest.approx(exponent, abs=1e-9)
        noisy = exact * rng.lognormal(0, 0.3, n)
        assert loglog_slope(list(xs), list(noisy)) == pytest.approx(reference_slope(xs, noisy), abs=1e-9)
    with pytest.raises(ValueError, match="2 points"):
        loglog_slope([1.0], [1.0])


@pytest.mark.parametrize("exponent, flagged", [(1.0, False), (1.0 + SLOPE_TOLERANCE - 0.05, False), (2.0, True)])
def test_flags_fire_only_above_the_expected_slope_plus_tolerance(exponent: float, flagged: bool) -> None:
    xs = [4096.0, 8192.0, 16384.0, 65536.0]
    offset = 700.0  # the bare process: memory above it grows as x**exponent
    curve = Curve(
        stage="s",
        x_name="x",
        xs=xs,
        seconds=[1e-6 * x**exponent for x in xs],
        expected_time_slope=1,
        peak_mib=[offset + 1e-3 * x**exponent for x in xs],
        expected_memory_slope=1,
        memory_offset_mib=offset,
    )
    assert curve.time_slope == pytest.approx(exponent)
    assert curve.memory_slope == pytest.approx(exponent)
    assert curve.flags == (["time", "memory"] if flagged else [])
    # without the offset subtracted, memory that is small next to the process would look flat
    curve.memory_offset_mib = 0.0
    if not flagged:
        assert curve.memory_slope < exponent - 0.5


def test_run_point_measures_each_process_alone(tmp_path: Path) -> None:
    (tmp_path / "alloc_point.py").write_text(
        textwrap.dedent(
            """
            import json, sys
            block = bytearray(int(sys.argv[1]) * 2**20)
            block[::4096] = b"x" * len(block[::4096])  # touch every page
            if sys.argv[2:] == ["fail"]:
                sys.exit("error: asked to fail")
            print("noise line")
            print(json.dumps({"seconds": 0.5, "mib": len(block) / 2**20}))
            """
        )
    )
    env = {"PYTHONPATH": str(tmp_path)}
    big = run_point("alloc_point", ["300"], env=env)
    small = run_point("alloc_point", ["10"], env=env)  # after the big one: its own peak, not the big one's
    assert big["seconds"] == 0.5 and big["mib"] == 300
    assert 300 <= big["peak_rss_mib"] < 300 + 100
    assert small["peak_rss_mib"] < 100
    assert big["wall_s"] > 0
    with pytest.raises(RuntimeError, match="asked to fail"):
        run_point("alloc_point", ["1", "fail"], env=env)


@pytest.mark.slow
def test_quick_run_of_the_numerical_kernel_parts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """``python -m benchmarks.scaling --quick`` over every numerical-kernel part, its ``main`` in this process (its
    points run in-process in --quick anyway; a fresh interpreter paid the imports of torch, Lightning and
    matplotlib again). The run rewrites its outputs after each part; the figure, the most of that time (~3 s a
    drawing on a loaded 2-core box), is drawn here only for the last write, which the test reads."""
    import benchmarks.scaling.__main__ as scaling

    parts = sorted(COMPUTE_PARTS)
    drawn: list[int] = []
    draw = scaling.plot

    def last_drawing_only(curves: list, fpath: Path) -> None:
        drawn.append(len(curves))
        if len(drawn) == len(parts):
            draw(curves, fpath)

    monkeypatch.setattr(scaling, "plot", last_drawing_only)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a suite worker: at these sizes a second thread only adds hand-offs
    try:
        scaling.main(["--quick", "--parts", *parts, "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    assert len(drawn) == len(parts) and drawn == sorted(drawn)  # written after each part, the curves adding up
    assert "flagged:" in capsys.readouterr().out.splitlines()[-1]
    curves = json.loads((tmp_path / "scaling.json").read_text())
    assert len(curves) == drawn[-1]
    stages = {(c["stage"], c["x_name"]) for c in curves}
    variants = ("relu", "jumprelu", "topk", "batchtopk", "matryoshka", "mpsae", "ompsae")
    assert {(f"train step {v}", "d_sae") for v in variants} <= stages
    assert {(f"train step {v}", "k") for v in ("topk", "batchtopk", "mpsae", "ompsae")} <= stages
    assert {("babel", "p (atoms)"), ("predict", "tokens"), ("loader", "num_workers")} <= stages
    for c in curves:
        assert len(c["xs"]) >= 3 and len(c["seconds"]) == len(c["xs"])
        assert max(c["xs"]) / min(c["xs"]) >= 4
        assert all(s > 0 for s in c["seconds"])
        assert math.isfinite(c["time_slope"])
        assert c["memory_slope"] is None or math.isfinite(c["memory_slope"])
    assert "| predict | tokens |" in (tmp_path / "scaling.md").read_text()
    assert (tmp_path / "scaling.png").stat().st_size > 10_000
