"""The prepared GPU script: every CUDA check and benchmark of the GPU-pace work, one device call, one table.

    bash benchmarks/gpu_wheels.sh                 # here, once: the peers' wheels into .whl/ (make gpu-wheels)
    python -m benchmarks.gpu_suite                # on the lent GPU, one device call carrying .whl (make gpu-suite)
    python -m benchmarks.gpu_suite --dry-run      # CPU: every part in its tiny form (tests/test_gpu_suite.py)
    python -m benchmarks.gpu_suite --parts peers gpu     # some parts only (a rerun with the device time left)

A lent GPU comes for minutes, once, and whoever gets it runs this first; so the script runs every part
whatever happens to the others: each part is a child process with its own time limit
(benchmarks/gpu_suite_parts.py lists them), killed with its whole process group when it outruns it,
and all of them share one budget (``--budget``, 7.5 minutes) so the call ends inside the device tool's
8. A part that fails, times out or is not reached is reported as such in the table, never dropped. The optional
parts (``fit_pace``, ``peers_compiled``, last) run on what the others left of the budget: they do not fail the
suite for being skipped or stopped there.

Before the parts: the wheels in ``.whl/`` (when there are any) are installed into ``--site`` (a
folder of the machine's temporary directory) with the device tool's command, and every part then
runs with ``PYTHONPATH=<site>:<repository>`` (the product runs from the checkout, uninstalled).

Output, in ``--out`` (default ``$OUT`` when set, which the device tool brings back, else
``gpu_suite_out``): ``<out>/logs.txt`` (every part's command, exit status, seconds and whole output,
in order), ``<out>/summary.md`` (the table), ``<out>/summary.json`` (the same, for scripts) and
``<out>/junit.xml`` (pytest's report of the CUDA tests): four files, within the tool's eight. The
summary is rewritten after each part, so a call cut short still brings back what ran. The table is
printed last, under the GPU's name as ``nvidia-smi`` gives it; the exit status is 1 when a part did
not pass.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.gpu_suite_parts import PARTS, REPO_DPATH, TOTAL_BUDGET_S, Part, last_line

DRY_TIMEOUT_S, DRY_BUDGET_S = 600, 1800  # the dry run on a loaded 2-core box: each part's tiny form, minutes
LOG_LIMIT_BYTES = 4 * 2**20  # per part in logs.txt: the tool brings back files of up to 16 MiB
WHEELS_TIMEOUT_S = 20


@dataclass
class Result:
    part: str
    status: str  # ok, FAILED, TIMEOUT, SKIPPED
    key: str
    seconds: float
    command: str = ""
    optional: bool = False  # a part on the budget the others left: skipped or stopped, the suite still passes

    def passed(self) -> bool:
        return self.status == "ok" or (self.optional and self.status in ("SKIPPED", "TIMEOUT"))

    def row(self) -> str:
        return f"| {self.part} | {self.status} | {self.key.replace('|', '/')} | {self.seconds:.0f} |"


def gpu_name() -> str:
    """The GPU as ``nvidia-smi`` names it, with its memory and driver; what stands in for it otherwise."""
    if shutil.which("nvidia-smi") is None:
        return "no nvidia-smi (CPU)"
    try:
        query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
        return subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip() or "nvidia-smi: none"
    except (OSError, subprocess.SubprocessError) as exn:
        return f"nvidia-smi failed: {exn}"


def run_part(
    name: str, argv: list[str], timeout_s: float, log_fpath: Path, env: dict[str, str]
) -> tuple[int | None, str, float]:
    """(exit status or None on timeout, output, seconds) of one child; its output is appended to the log as it comes."""
    with open(log_fpath, "ab") as log:
        log.write(f"\n===== {name}: {' '.join(argv)} (limit {timeout_s:.0f} s)\n".encode())
        log.flush()
        start_offset = log.tell()
        start = time.perf_counter()
        # its own process group, so a timeout stops what it started too (a DataLoader worker, pytest's children)
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_DPATH, env=env, start_new_session=True
        )
        try:
            returncode: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended in between
                pass
            proc.wait()
            returncode = None
        seconds = time.perf_counter() - start
    with open(log_fpath, "rb") as log:
        log.seek(start_offset)
        output = log.read().decode(errors="replace")
    if len(output.encode()) > LOG_LIMIT_BYTES:  # keep the log within what comes back: its head and its tail
        kept = output[: LOG_LIMIT_BYTES // 4] + "\n[... cut ...]\n" + output[-LOG_LIMIT_BYTES // 2 :]
        with open(log_fpath, "r+b") as log:
            log.seek(start_offset)
            log.write(kept.encode())
            log.truncate()
    with open(log_fpath, "ab") as log:
        status = "timed out" if returncode is None else f"exit {returncode}"
        log.write(f"===== {name}: {status} after {seconds:.1f} s\n".encode())
    return returncode, output, seconds


def judge(part: Part, returncode: int | None, output: str, seconds: float, timeout_s: float) -> Result:
    try:
        key = part.key(output)
    except (ValueError, IndexError, KeyError) as exn:  # an unrecognised output shows its last line instead
        key = f"{type(exn).__name__}: {exn}; last line: {last_line(output)}"
    failure = part.failure(output) if returncode == 0 else None
    if returncode is None:
        return Result(part.name, "TIMEOUT", f"stopped at {timeout_s:.0f} s; {key}", seconds)
    if returncode != 0:
        return Result(part.name, "FAILED", f"exit {returncode}: {last_line(output)}", seconds)
    if failure:
        return Result(part.name, "FAILED", failure, seconds)
    return Result(part.name, "ok", key, seconds)


def install_wheels(wheel_dpath: Path, site: Path, log_fpath: Path, env: dict[str, str]) -> Result | None:
    wheels = sorted(str(path) for path in wheel_dpath.glob("*.whl"))
    if not wheels:
        return None
    argv = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir"]
    argv += ["--upgrade", "--target", str(site), *wheels]
    returncode, output, seconds = run_part("wheels", argv, WHEELS_TIMEOUT_S, log_fpath, env)
    part = Part("wheels", [], [], WHEELS_TIMEOUT_S, key=lambda text: f"{len(wheels)} wheels into {site}")
    return judge(part, returncode, output, seconds, WHEELS_TIMEOUT_S)


def write_summary(out: Path, device: str, results: list[Result], dry_run: bool) -> str:
    header = f"GPU suite on {device}" + (" (dry run: CPU, tiny shapes)" if dry_run else "")
    table = "\n".join(
        [header, "", "| part | status | key figure | s |", "|---|---|---|---|", *(r.row() for r in results)]
    )
    (out / "summary.md").write_text(table + "\n")
    payload = {"device": device, "dry_run": dry_run, "parts": [r.__dict__ for r in results]}
    (out / "summary.json").write_text(json.dumps(payload, indent=1) + "\n")
    return table


def run_suite(
    parts: list[Part],
    out: Path,
    budget_s: float,
    dry_run: bool,
    site: Path | None = None,
    wheel_dpath: Path = REPO_DPATH / ".whl",
) -> int:
    """Runs ``parts`` in order within ``budget_s`` seconds, writes ``out``, prints the table last.

    Returns the exit status: 1 if any part did not pass."""
    out.mkdir(parents=True, exist_ok=True)
    log_fpath = out / "logs.txt"
    log_fpath.write_text("")
    deadline = time.monotonic() + budget_s
    device = gpu_name()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    results: list[Result] = []
    paths = [str(REPO_DPATH), *filter(None, [env.get("PYTHONPATH")])]
    if site is not None and not dry_run:
        wheels = install_wheels(wheel_dpath, site, log_fpath, env)
        if wheels is not None:
            results.append(wheels)
            if wheels.status == "ok":
                paths.insert(0, str(site))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if shutil.which("nvidia-smi"):
        run_part("nvidia-smi", ["nvidia-smi"], 30, log_fpath, env)
    for part in parts:
        left = deadline - time.monotonic()
        if left < 5:
            spent = f"the suite's {budget_s:.0f} s budget is spent"
            results.append(Result(part.name, "SKIPPED", spent, 0.0, optional=not part.reserved))
            print(f"[gpu_suite] {part.name}: skipped, budget spent", flush=True)
            continue
        timeout_s = min(part.timeout_s, left)
        args = list(part.dry_args if dry_run else part.gpu_args)
        if "pytest" in args:
            args += [f"--junitxml={out / 'junit.xml'}"]
        print(f"[gpu_suite] {part.name}: {' '.join(args)} (limit {timeout_s:.0f} s)", flush=True)
        returncode, output, seconds = run_part(part.name, [sys.executable, *args], timeout_s, log_fpath, env)
        result = judge(part, returncode, output, seconds, timeout_s)
        result.command = " ".join(["python", *args])
        result.optional = not part.reserved
        results.append(result)
        print(f"[gpu_suite] {part.name}: {result.status} in {seconds:.0f} s", flush=True)
        write_summary(out, device, results, dry_run)
    table = write_summary(out, device, results, dry_run)
    files = ", ".join(sorted(path.name for path in out.iterdir() if path.is_file()))
    print(f"\noutput in {out}/ ({files})\n\n{table}", flush=True)
    return 0 if all(r.passed() for r in results) else 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = [part.name.split()[0] for part in PARTS]
    parser.add_argument("--parts", nargs="+", choices=names, default=names, help="which parts, in the suite's order")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu_suite_out"))
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help=f"seconds for all parts together (default: {TOTAL_BUDGET_S}; dry run {DRY_BUDGET_S})",
    )
    parser.add_argument("--site", type=Path, default=Path("/tmp/site"), help="where the .whl/ wheels are installed")
    parser.add_argument("--dry-run", action="store_true", help="CPU, each part's tiny form (a check of the script)")
    args = parser.parse_args(argv)
    if args.budget is not None and args.budget <= 0:
        parser.error(f"--budget must be > 0 seconds, got {args.budget}")
    if args.budget is None:
        args.budget = DRY_BUDGET_S if args.dry_run else TOTAL_BUDGET_S
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    parts = [part for part in PARTS if part.name.split()[0] in args.parts]
    if args.dry_run:  # a check that each part runs, on whatever CPU: no GPU-sized limits
        parts = [dataclasses.replace(part, timeout_s=DRY_TIMEOUT_S) for part in parts]
    sys.exit(run_suite(parts, args.out, args.budget, args.dry_run, site=args.site))


if __name__ == "__main__":
    main()
