"""``python -m benchmarks.gpu_suite``, the script a lent GPU runs first: every part's outcome reaches the table and
the output folder, a failing or overrunning part included, within the device tool's limits on what comes back
(at most 8 files). The fast tests drive the runner with stand-in parts (tiny Python commands); the dry run of
the real parts on the CPU is marked slow (the suite with its pytest part, whose collection of the GPU tests takes
most of it; the other parts' commands in this process)."""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_suite
from benchmarks.gpu_suite_parts import (
    PARTS,
    Part,
    failure_peers,
    key_fit_pace,
    key_multi_sae,
    key_peers,
    key_pytest,
    key_sparse_kernels,
    key_train_step,
)

REPO_DPATH = Path(__file__).resolve().parents[1]


def stand_in(name: str, code: str, timeout_s: float = 30, key=None) -> Part:  # noqa: ANN001
    args = ["-c", code]
    return Part(name, args, args, timeout_s, **({"key": key} if key else {}))


def table_rows(stdout: str) -> dict[str, list[str]]:
    """The summary table, which must be the last thing printed, by part."""
    lines = stdout.rstrip().splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("| part |"))
    rows = lines[start + 2 :]
    assert rows and all(line.startswith("| ") for line in rows), stdout[-2000:]
    return {cells[0]: cells for cells in ([c.strip() for c in line.strip("|").split("|")] for line in rows)}


def test_every_outcome_reaches_the_table_and_the_files(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    parts = [
        stand_in("good", "print('| topk | 1.25 ms |')", key=lambda text: text.split("|")[2].strip()),
        stand_in("broken", "import sys; print('step 1'); sys.exit('CUDA error: out of memory')"),
        stand_in("slow", "import time; print('started', flush=True); time.sleep(60)", timeout_s=1),
        stand_in("unparsed", "print('a table nobody knows')", key=lambda text: text.split("|")[5]),
        stand_in("after", "print('fine')"),
    ]
    status = gpu_suite.run_suite(parts, tmp_path / "out", budget_s=120, dry_run=True)
    stdout = capsys.readouterr().out
    assert status == 1  # a part did not pass
    rows = table_rows(stdout)
    assert list(rows) == ["good", "broken", "slow", "unparsed", "after"]
    assert rows["good"][1:3] == ["ok", "1.25 ms"]
    assert rows["broken"][1] == "FAILED" and "exit 1: CUDA error: out of memory" in rows["broken"][2]
    assert rows["slow"][1] == "TIMEOUT" and "stopped at 1 s" in rows["slow"][2]
    assert float(rows["slow"][3]) < 30  # killed at its limit, not waited for
    assert rows["unparsed"][1] == "ok" and "last line: a table nobody knows" in rows["unparsed"][2]
    assert rows["after"][1] == "ok"  # the parts after a failure still ran

    out = tmp_path / "out"
    files = sorted(p.name for p in out.rglob("*") if p.is_file())
    assert files == ["logs.txt", "summary.json", "summary.md"]  # the tool brings back 8 at most
    log = (out / "logs.txt").read_text()
    assert "CUDA error: out of memory" in log and "===== slow: timed out" in log and "started" in log
    summary = json.loads((out / "summary.json").read_text())
    assert [p["status"] for p in summary["parts"]] == ["ok", "FAILED", "TIMEOUT", "ok", "ok"]
    assert (out / "summary.md").read_text().strip() in stdout


def test_a_spent_budget_skips_the_rest_and_says_so(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    parts = [stand_in("first", "import time; time.sleep(60)", timeout_s=60), stand_in("second", "print('x')")]
    status = gpu_suite.run_suite(parts, tmp_path, budget_s=6, dry_run=True)
    rows = table_rows(capsys.readouterr().out)
    assert status == 1
    assert rows["first"][1] == "TIMEOUT"  # clipped to the budget, not its own 60 s
    assert rows["second"][1] == "SKIPPED" and "budget is spent" in rows["second"][2]


def tiny_wheel(dpath: Path) -> None:
    """A one-module wheel, as pip downloads them: what the wheels step installs and the parts then import."""
    files = {
        "tinypeer/__init__.py": "VALUE = 42\n",
        "tinypeer-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: tinypeer\nVersion: 1.0\n",
        "tinypeer-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in [*files, "tinypeer-1.0.dist-info/RECORD"])
    dpath.mkdir()
    with zipfile.ZipFile(dpath / "tinypeer-1.0-py3-none-any.whl", "w") as wheel:
        for name, text in {**files, "tinypeer-1.0.dist-info/RECORD": record}.items():
            wheel.writestr(name, text)


def test_wheels_are_installed_first_and_the_parts_import_them(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    tiny_wheel(tmp_path / "whl")
    parts = [stand_in("import", "import tinypeer, benchmarks; print(tinypeer.VALUE)")]
    status = gpu_suite.run_suite(
        parts, tmp_path / "out", budget_s=120, dry_run=False, site=tmp_path / "site", wheel_dpath=tmp_path / "whl"
    )
    rows = table_rows(capsys.readouterr().out)
    assert status == 0, rows
    assert list(rows) == ["wheels", "import"]
    assert rows["wheels"][2] == f"1 wheels into {tmp_path / 'site'}" and rows["import"][2] == "42"


def test_key_figures_read_the_real_tables() -> None:
    assert key_pytest("ssF.\n3 passed, 1 failed, 5 skipped, 900 deselected in 41.20s\n") == (
        "3 passed, 1 failed, 5 skipped, 900 deselected"
    )
    peers = (
        "| d_in | d_sae | contender | step | ÷ ours | ÷ GEMM | peak memory | resident | equal to ours |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
        "| 768 | 19200 | ours topk | 0.001 s | 1 | 2 | 200 MiB | 100 MiB | reference |\n"
        "| 768 | 19200 | SAELens topk | 0.004 s | 4 | 8 | 400 MiB | 100 MiB | equal (1.0e-07) |\n"
        "| 768 | 19200 | sparsify topk | 0.002 s | 2 | 4 | 300 MiB | 100 MiB | DIFFERS (3.0e-01) |\n"
        "| 768 | 19200 | ours relu | 0.001 s | 1 | 2 | 200 MiB | 100 MiB | reference |\n"
        "  note: overcomplete: not installed (overcomplete); pip install -e '.[bench]'\n"
    )
    assert (
        key_peers(peers) == "fastest peer / ours: topk 2.00x (sparsify, mem 1.50x), relu no peer; missing overcomplete"
    )
    assert failure_peers(peers) == "DIFFERS from ours: sparsify topk"
    peers_now = (  # the dead column, and the last table: per variant and dead fraction, the fastest peer
        "| d_in | d_sae | contender | step | ÷ ours | ÷ GEMM | peak memory | resident | equal to ours | dead |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
        "| 768 | 19200 | ours topk | 0.001 s | 1 | 2 | 200 MiB | 100 MiB | reference | 0.0 % |\n"
        "| 768 | 19200 | overcomplete topk | 0.0005 s | 0.5 | 1 | 400 MiB | 100 MiB | equal (1.0e-07) | no AuxK |\n"
        "| 768 | 19200 | SAELens+compile topk | 0.002 s | 2 | 4 | 300 MiB | 100 MiB | DIFFERS (3.0e-01) | 6.2 % |\n"
        "  note: dictionary_learning topk: its step failed (RuntimeError: boom)\n"
        "| d_sae | variant | dead | ours | fastest peer | ÷ ours | peak memory ÷ ours |\n"
        "|---|---|---|---|---|---|---|\n"
        "| 19200 | topk | none | 0.001 s | overcomplete 0.0005 s | 0.5 | 2 |\n"
        "| 19200 | topk | 6.2 % | 0.003 s | SAELens+compile 0.002 s | 0.667 | 1.5 |\n"
        "| 19200 | mpsae | none | 0.01 s | no peer | — | — |\n"
    )
    assert key_peers(peers_now) == (
        "fastest peer / ours: topk 0.50x (overcomplete, mem 2.00x), topk 6.2% dead 0.67x (SAELens+compile, mem 1.50x), "
        "mpsae no peer; step failed: dictionary_learning topk"
    )
    assert failure_peers(peers_now) == "DIFFERS from ours: SAELens+compile topk"
    train = (
        "variant      bare bare+metrics  Trainer  overhead  loop only  mean ovh.\n"
        "topk      250      240      230     8.7%       4.3%      9.0%   250/240/230\n"
    )
    assert key_train_step(train) == "Trainer overhead topk 8.7%"
    multi = (
        "   N | group ms/step | sum alone ms/step |  ratio | bytes/SAE-step group | alone\n"
        "   8 |         20.00 |             21.00 |  0.952 |                  100 | 800\n"
    )
    assert key_multi_sae(multi) == "group / alone N=8 0.952"
    sparse = (
        "| product | Triton | embedding_bag / topk | dense GEMM | bag / Triton | dense / Triton |\n"
        "|---|---|---|---|---|---|\n"
        "| decode | 0.246 ms | 0.207 ms | 0.138 ms | 0.84x | 0.56x |\n"
        "| batchtopk select | 1.513 ms | 0.912 ms | — | 0.60x | — |\n"
    )
    assert (
        key_sparse_kernels(sparse)
        == "Triton (best other / Triton): decode 0.246 ms (0.56x), batchtopk select 1.513 ms (0.60x)"
    )
    with pytest.raises(ValueError):
        key_sparse_kernels("| product | Triton |\n")
    pace = (
        "| variant | bare step tokens/s | fit, 4 workers | ratio | fit, cache gpu | ratio |\n"
        "|---|---|---|---|---|---|\n"
        "| topk | 4,000,000 | 3,000,000 | 0.75 | 3,800,000 | 0.95 |\n"
    )
    assert key_fit_pace(pace) == "fit / bare step: topk 0.75 (workers) 0.95 (cache)"
    with pytest.raises(ValueError):
        key_fit_pace("fit (topk, workers) failed with exit 2\n")


def test_the_parts_are_the_issues_and_fit_the_device_call() -> None:
    names = [part.name for part in PARTS]
    assert names == [
        "pytest -m gpu",
        "gpu",
        "peers",
        "train_step",
        "mp_sae",
        "omp_sae",
        "sparse_kernels",
        "multi_sae",
        "fit_pace",
        "peers_compiled",
    ]
    # the reserved parts fit the call; the optional ones (last) run on what those leave
    assert sum(part.timeout_s for part in PARTS if part.reserved) + gpu_suite.WHEELS_TIMEOUT_S <= 8 * 60 - 30
    assert [part.name for part in PARTS if not part.reserved] == ["fit_pace", "peers_compiled"]
    pytest_part = PARTS[0]
    assert "tests" in pytest_part.gpu_args and "-m" in pytest_part.gpu_args  # by the marker, not by file
    for part in PARTS[2:]:
        assert "cuda" in part.gpu_args or part.name in ("sparse_kernels", "fit_pace"), part.name  # CUDA-only ones
    for part in PARTS:
        if "benchmarks.peers" in part.gpu_args:  # every peer at its fastest: bf16 (equality stays float32)
            assert "--autocast" in part.gpu_args, part.name


def test_an_optional_part_skipped_or_stopped_does_not_fail_the_suite(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    parts = [
        stand_in("first", "print('fine')"),
        dataclasses.replace(stand_in("slow extra", "import time; time.sleep(60)", timeout_s=1), reserved=False),
        dataclasses.replace(stand_in("broken extra", "import sys; sys.exit('no')"), reserved=False),
    ]
    status = gpu_suite.run_suite(parts[:2], tmp_path / "a", budget_s=120, dry_run=True)
    rows = table_rows(capsys.readouterr().out)
    assert status == 0 and rows["slow extra"][1] == "TIMEOUT"
    status = gpu_suite.run_suite(parts[::2], tmp_path / "b", budget_s=120, dry_run=True)
    rows = table_rows(capsys.readouterr().out)
    assert status == 1 and rows["broken extra"][1] == "FAILED"  # a crash still fails it


def test_where_to_run_lists_every_part_with_its_limit() -> None:
    """docs/where-to-run.md's table of the suite's parts is the code's: names and limits."""
    text = (REPO_DPATH / "docs" / "where-to-run.md").read_text()
    table = text[text.index("| part | what it runs on the GPU | limit |") :].split("\n\n")[0]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()[2:]]
    assert [(row[0], row[-1]) for row in rows] == [(f"`{part.name}`", f"{part.timeout_s:.0f} s") for part in PARTS]


# The parts whose dry run another test already runs (each with its own, finer assertions); the suite's dry run
# here runs the others, so that no dry run is paid twice in the suite. ``peers_compiled`` (SAELens's inductor
# compile) runs on CUDA only, in a ``gpu`` test there; the CPU checks its wiring.
DRY_RUN_ELSEWHERE = {
    "gpu": "tests/test_benchmarks_peers.py",
    "peers": "tests/test_benchmarks_peers.py",
    "mp_sae": "tests/test_mp_sae.py",
    "omp_sae": "tests/test_omp_sae.py",
    "sparse_kernels": "tests/test_benchmarks_peers.py",
    "peers_compiled": "tests/test_benchmarks_peers.py",
}
PYTEST_PART = PARTS[0]


@pytest.mark.slow
@pytest.mark.timeout(1900)  # the dry run's own budget is 30 minutes; about 30 s on a loaded 2-core box
def test_dry_run_runs_the_parts_on_the_cpu(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The suite's own dry run (a process, as the device call runs it) with its pytest part: the GPU tests collect
    and skip, pytest's junit.xml lands beside the summaries. The other parts' dry commands run in this process
    (``main`` of the module each part names, with its dry arguments: what ``python -m`` runs), their key figure read
    from their real output: a fresh interpreter per part cost its imports of torch and Lightning, ~20 s a part on a
    loaded 2-core box, and how the runner runs a part as a process is what the stand-in tests above check."""
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_suite", "--dry-run", "--out", str(tmp_path), "--parts", "pytest"],
        capture_output=True,
        text=True,
        timeout=1850,
        cwd=REPO_DPATH,
    )
    rows = table_rows(result.stdout)
    assert list(rows) == [PYTEST_PART.name], result.stdout[-3000:]
    assert result.returncode == 0 and rows[PYTEST_PART.name][1] == "ok", result.stdout[-3000:]
    assert "skipped" in rows[PYTEST_PART.name][2]  # no CUDA here: the GPU tests collect and skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["junit.xml", "logs.txt", "summary.json", "summary.md"]
    assert "GPU suite on no nvidia-smi (CPU) (dry run" in result.stdout

    here = [part for part in PARTS[1:] if part.name not in DRY_RUN_ELSEWHERE]
    assert here, "every part's dry run is elsewhere: drop this half"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a suite worker runs: at these sizes a second thread only adds hand-offs
    # the scripts quiet Lightning's loggers for the rest of their process (their own): this worker's goes on
    loggers = logging.Logger.manager.loggerDict
    levels = {name: logger.level for name, logger in loggers.items() if isinstance(logger, logging.Logger)}
    try:
        for part in here:
            assert part.dry_args[0] == "-m", part.dry_args
            capsys.readouterr()
            importlib.import_module(part.dry_args[1]).main(part.dry_args[2:])
            output = capsys.readouterr().out
            assert part.key(output) and part.failure(output) is None, output  # key raises on output it cannot read
    finally:
        torch.set_num_threads(threads)
        for name, logger in list(loggers.items()):
            if isinstance(logger, logging.Logger):
                logger.setLevel(levels.get(name, logging.NOTSET))
    for test_file in DRY_RUN_ELSEWHERE.values():
        assert (REPO_DPATH / test_file).is_file()


def test_bad_budget_is_one_line_exit_2() -> None:
    with pytest.raises(SystemExit) as exit_info:
        gpu_suite.parse_args(["--budget", "0"])
    assert exit_info.value.code == 2
    assert gpu_suite.parse_args([]).budget == 450 and gpu_suite.parse_args(["--dry-run"]).budget == 1800
