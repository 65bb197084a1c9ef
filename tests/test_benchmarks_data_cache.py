"""``python -m benchmarks.data_cache --quick``: both sizes, uncached and cached rows, and their ratio, in one run."""

from __future__ import annotations

import pytest


def test_quick_run_prints_each_size_with_its_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import data_cache

    results = data_cache.main(["--quick"])
    assert list(results) == ["digits", "40 images x 261 x 64, 0 workers", "40 images x 261 x 64, 1 worker"]
    for rows in results.values():
        assert rows["ratio"] > 0
        for cache in ("none", "ram"):
            assert [n for n, _, _ in rows[cache]["epochs"]] == [rows["none"]["epochs"][0][0]] * 2  # equal epochs
    out = capsys.readouterr().out
    table = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert [(cells[0].strip(), cells[2].strip()) for cells in table[1:]] == [
        ("digits", "none"),
        ("digits", "ram"),
        ("40 images x 261 x 64", "none"),
        ("40 images x 261 x 64", "ram"),
        ("40 images x 261 x 64", "none"),
        ("40 images x 261 x 64", "ram"),
    ]
    assert all(float(cells[-1]) > 0 for cells in table[1:]) and "ratio:" in out


def test_too_few_epochs_is_a_usage_error() -> None:
    from benchmarks import data_cache

    with pytest.raises(SystemExit) as info:
        data_cache.main(["--epochs", "1"])
    assert info.value.code == 2
