"""``python -m benchmarks.ddp --dry-run``: 2 gloo ranks on the CPU step every side and print their ratio to 1 rank.
Marked slow: about 14 s of CPU (one interpreter; the ranks are forked from it)."""

from __future__ import annotations

import pytest

from tests.test_benchmarks_peers import run, table_rows


@pytest.mark.slow
def test_ddp_dry_run_times_every_side_against_one_rank() -> None:
    result = run("ddp", "--dry-run")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {row[1]: row for row in table_rows(result.stdout) if row[0] != "---"}
    assert list(rows) == ["1 rank", "1 rank + DDP", "2 ranks", "2 ranks bf16"], result.stdout
    assert rows["1 rank"][4] == "1.00"
    for variant, _, step_ms, tokens, ratio in rows.values():
        assert variant == "topk" and float(step_ms) > 0 and float(tokens.replace(",", "")) > 0 and float(ratio) > 0
    assert "synchronisation adds" in result.stdout.splitlines()[-1]


def test_ddp_bad_argument_is_one_line_exit_2() -> None:
    result = run("ddp", "--ranks", "0")
    assert result.returncode == 2 and "--ranks must be >= 1, got 0" in result.stderr
