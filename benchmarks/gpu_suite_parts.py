"""The parts benchmarks/gpu_suite.py runs, their commands on a GPU and in the CPU dry run, and the one figure
each gives the summary table.

Shapes: the issue's (d_in 768, d_sae 19 200, k 32, B 4 096) wherever a part takes them, so the figures
of gpu.py, peers.py, train_step.py and mp_sae.py describe one step. Each part's seconds are sized so that
all of them, with the wheels' install, fit one device call of 8 minutes on an H100 (their sum is
`TOTAL_BUDGET_S`, with 20 s for the wheels); a part that outruns its own is stopped and the next one starts.
An optional part (``reserved=False``, the last two) has no seconds of its own: it runs on what the others left
of the budget, up to its limit, and its being skipped or stopped there does not fail the suite (`fit` from
shards, four fresh fits; SAELens compiled, whose compiling takes most of its time).

Each ``key_*`` function reads the figure from the part's output and raises on output it does not
recognise; the runner then shows the output's last line instead, so a changed table never hides a
result. ``failure_*`` functions name a failure that the exit status does not show (a peer that
computes something else than ours).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO_DPATH = Path(__file__).resolve().parents[1]
GPU_TEST_FILES = sorted(f"tests/{path.name}" for path in (REPO_DPATH / "tests").glob("test_gpu_*.py")) or ["tests"]
SHAPE = ["--d-in", "768", "--d-sae", "19200", "--batch-size", "4096", "--k", "32"]
TOTAL_BUDGET_S = 450  # 7.5 minutes: the device call's 8, less the start of Python and the copy of $OUT


@dataclass(frozen=True)
class Part:
    name: str
    gpu_args: list[str]  # after the Python interpreter
    dry_args: list[str]
    timeout_s: float
    key: Callable[[str], str] = field(default=lambda text: last_line(text))
    failure: Callable[[str], str | None] = field(default=lambda text: None)
    reserved: bool = True  # False: runs on the budget the others left (see the module docstring)


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:140] if lines else "(no output)"


def table_cells(text: str) -> list[list[str]]:
    """The rows of the Markdown tables in ``text``, header and rule lines left out."""
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not set(line) <= set("|-: "):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def key_pytest(text: str) -> str:
    matches = re.findall(r"^=*\s*(\d+ (?:passed|failed|skipped|deselected|error).*?) in [\d.]+s", text, re.M)
    if not matches:
        raise ValueError("no pytest summary line")
    return matches[-1]


def key_gpu(text: str) -> str:
    steps = [f"{row[0]} {row[1].removesuffix(' ms')}" for row in table_cells(text) if row[1].endswith(" ms")]
    if not steps:
        raise ValueError("no variant rows")
    images = re.search(r"([\d,.]+) images/s", text)
    return "ms/step " + ", ".join(steps) + (f"; ViT {images.group(1)} images/s" if images else "")


def key_train_step(text: str) -> str:
    rows = re.findall(r"^(\w+)\s+[\d.e+]+\s+[\d.e+]+\s+[\d.e+]+\s+(-?[\d.]+%)", text, re.M)
    if not rows:
        raise ValueError("no variant rows")
    return "Trainer overhead " + ", ".join(f"{variant} {overhead}" for variant, overhead in rows)


def key_fit_pace(text: str) -> str:
    """`fit`'s tokens/s over the bare step's, per variant: from the loader's workers, then from the cache."""
    rows = [row for row in table_cells(text) if len(row) == 6 and row[0] != "variant"]
    if not rows:
        raise ValueError("no variant rows")
    return "fit / bare step: " + ", ".join(f"{row[0]} {row[3]} (workers) {row[5]} (cache)" for row in rows)


def key_peers(text: str) -> str:
    """Per variant (and dead fraction): the fastest peer's step over ours (> 1: ours is faster), and its peak
    memory over ours; from peers.py's last table, or, in an output without it, from the contenders' rows."""
    parts = [fastest_peer(row) for row in table_cells(text) if len(row) == 7 and row[0] != "d_sae"]
    if not parts:
        parts = contender_ratios(text)
    missing = re.findall(r"note: (\S+): not installed", text)
    absent = f"; missing {', '.join(sorted(set(missing)))}" if missing else ""
    failed = re.findall(r"note: (\S+ \S+): its step failed", text)
    broken = f"; step failed: {', '.join(failed)}" if failed else ""
    return "fastest peer / ours: " + ", ".join(parts) + absent + broken


def fastest_peer(row: list[str]) -> str:
    """One row of peers.py's last table (d_sae, variant, dead, ours, fastest peer, ÷ ours, peak ÷ ours)."""
    block = row[1] if row[2] == "none" else f"{row[1]} {row[2].replace(' ', '')} dead"
    if row[4] == "no peer":
        return f"{block} no peer"
    return f"{block} {float(row[5]):.2f}x ({row[4].split()[0]}, mem {float(row[6]):.2f}x)"


def contender_ratios(text: str) -> list[str]:
    """key_peers from the contenders' rows (an output cut before the last table, or an older one)."""
    best: dict[str, tuple[float, float, str]] = {}
    ours_peak: dict[str, float] = {}
    for row in table_cells(text):
        if len(row) < 9 or row[2] == "contender":
            continue
        library, variant = row[2].split()
        peak = float(row[6].split()[0])
        if library == "ours":
            ours_peak[variant] = peak
        elif variant not in best or float(row[4]) < best[variant][0]:
            best[variant] = (float(row[4]), peak, library)
    if not ours_peak:
        raise ValueError("no contender rows")
    parts = []
    for variant in ours_peak:
        if variant in best:
            ratio, peak, library = best[variant]
            parts.append(f"{variant} {ratio:.2f}x ({library}, mem {peak / ours_peak[variant]:.2f}x)")
        else:
            parts.append(f"{variant} no peer")
    return parts


def failure_peers(text: str) -> str | None:
    differ = [row[2] for row in table_cells(text) if len(row) >= 9 and row[8].startswith("DIFFERS")]
    return f"DIFFERS from ours: {', '.join(differ)}" if differ else None


def key_multi_sae(text: str) -> str:
    rows = re.findall(r"^\s*(\d+) \|\s*[\d.]+ \|\s*[\d.]+ \|\s*([\d.]+) \|", text, re.M)
    if not rows:
        raise ValueError("no group rows")
    return "group / alone " + ", ".join(f"N={n} {ratio}" for n, ratio in rows)


def pursuit_rows(text: str) -> list[list[str]]:
    rows = [line.split() for line in text.splitlines() if re.match(r"^\s*\d+\s+\d+\s+\d+\s+\d+\s+\w+ \|", line)]
    if not rows:
        raise ValueError("no shape rows")
    return rows


def key_mp_sae(text: str) -> str:
    shape = pursuit_rows(text)[-1]  # d_in d_sae B k dtype | mp s plain s speedup | ...
    return f"d_sae {shape[1]} B {shape[2]} k {shape[3]} {shape[4]}: MP {float(shape[6]) * 1e3:.2f} ms, {shape[8]} plain"


def key_omp_sae(text: str) -> str:
    shape = pursuit_rows(text)[-1]  # d_in d_sae B k dtype | omp s mp s mp-mm s naive s | omp/mp ...
    return f"d_sae {shape[1]} B {shape[2]} k {shape[3]} {shape[4]}: OMP {float(shape[6]) * 1e3:.2f} ms, {shape[11]} MP"


def key_sparse_kernels(text: str) -> str:
    """Per product: the Triton time and the fastest other column over it (< 1: the kernel loses)."""
    parts = []
    for row in table_cells(text):
        if len(row) == 6 and row[1].endswith(" ms"):
            others = [float(cell.removesuffix("x")) for cell in row[4:] if cell.endswith("x")]
            parts.append(f"{row[0]} {row[1]} ({min(others):.2f}x)" if others else f"{row[0]} {row[1]}")
    if not parts:
        raise ValueError("no product rows")
    return "Triton (best other / Triton): " + ", ".join(parts)


PURSUIT_GPU = ["--device", "cuda", "--d_in", "768", "--d_sae", "19200", "--shapes", "4096:32"]
PARTS = [
    Part(
        "pytest -m gpu",
        # by the marker, over the whole suite: every tests/test_gpu_*.py, whoever added it
        ["-m", "pytest", "-m", "gpu", "tests", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors"],
        # the dry run collects only those files (they skip without CUDA): the whole suite takes minutes on 2 cores
        ["-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *GPU_TEST_FILES],
        90,
        key_pytest,
    ),
    Part("gpu", ["-m", "benchmarks.gpu"], ["-m", "benchmarks.gpu", "--dry-run"], 55, key_gpu),
    Part(
        "peers",
        # bf16 autocast: training's precision on a GPU and every peer's fastest setting (equality stays float32)
        ["-m", "benchmarks.peers", "--device", "cuda", *SHAPE, "--equal-rows", "1024", "--autocast"],
        ["-m", "benchmarks.peers", "--dry-run"],
        80,
        key_peers,
        failure_peers,
    ),
    Part(
        "train_step",
        ["-m", "benchmarks.train_step", "--device", "cuda", *SHAPE, "--variants", "topk", "mpsae"]
        + ["--steps", "60", "--repeats", "2"],
        ["-m", "benchmarks.train_step", "--quick"],
        50,
        key_train_step,
    ),
    Part(
        "mp_sae",
        # on CUDA it adds the shape in float32 and bfloat16 to the small one given here
        ["-m", "benchmarks.mp_sae", "--device", "cuda", "--shapes", "1024:16", "--plain_reps", "1"],
        ["-m", "benchmarks.mp_sae", "--quick"],
        20,
        key_mp_sae,
    ),
    Part(
        "omp_sae",
        # without the naive reference: its batched least squares alone outran 30 s on an H200 (2026-11-28)
        ["-m", "benchmarks.omp_sae", *PURSUIT_GPU, "--reps", "3", "--skip_reference"],
        ["-m", "benchmarks.omp_sae", "--quick"],
        45,
        key_omp_sae,
    ),
    Part(
        "sparse_kernels",
        ["-m", "benchmarks.sparse_kernels"],
        ["-m", "benchmarks.sparse_kernels", "--dry-run"],
        40,
        key_sparse_kernels,
    ),
    Part(
        "multi_sae",
        ["-m", "benchmarks.multi_sae", "--device", "cuda", "--d_in", "768", "--d_sae", "19200", "--batch", "4096"]
        + ["--n", "1", "8", "--rounds", "1", "--steps", "20"],
        ["-m", "benchmarks.multi_sae", "--quick"],
        45,
        key_multi_sae,
    ),
    Part(
        "fit_pace",
        # the real `fit` from shards (the recipe's 4 workers, then --data.cache gpu) against the bare step
        ["-m", "benchmarks.fit_pace"],
        ["-m", "benchmarks.fit_pace", "--dry-run", "--variants", "topk"],
        120,
        key_fit_pace,
        reserved=False,
    ),
    Part(
        "peers_compiled",
        # SAELens with its runner's compile_sae (torch.compile), timed after compiling; ours again, the reference
        ["-m", "benchmarks.peers", "--device", "cuda", *SHAPE, "--equal-rows", "1024", "--autocast"]
        + ["--peers", "SAELens+compile"],
        ["-m", "benchmarks.peers", "--dry-run", "--variants", "topk", "--peers", "SAELens+compile"],
        150,
        key_peers,
        failure_peers,
        reserved=False,
    ),
]
