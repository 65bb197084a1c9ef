"""Cost curves: one stage measured at several sizes, its fitted log-log slope and the slope its algorithm predicts.

The parts of ``python -m benchmarks.scaling`` each return :class:`Curve` objects; this module fits, flags,
tabulates and plots them, and measures one point of a curve in a fresh process (:func:`run_point`),
so that each size's peak RSS is that size's alone and not the high-water mark of the sizes before it.

A stage is *flagged* when its time or memory grows faster than expected: fitted slope > expected slope
+ ``SLOPE_TOLERANCE``. The tolerance absorbs the fixed costs that flatten a curve at small sizes and the
noise of a shared machine; it does not absorb a wrong exponent (an O(n²) stage where O(n) was expected
fits a slope near 2, far above 1 + tolerance).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SLOPE_TOLERANCE = 0.25


@dataclass
class Curve:
    """One stage's cost at several sizes.

    ``expected_memory_slope`` is None when memory is not part of the claim (e.g. a stage measured
    in-process, where RSS is shared with other stages). ``memory_offset_mib`` is subtracted before the
    memory slope is fitted: the interpreter and imports (a few hundred MiB) would flatten any slope.
    """

    stage: str
    x_name: str
    xs: list[float]
    seconds: list[float]
    expected_time_slope: float
    peak_mib: list[float] | None = None
    expected_memory_slope: float | None = None
    memory_offset_mib: float = 0.0
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def time_slope(self) -> float:
        return loglog_slope(self.xs, self.seconds)

    @property
    def memory_slope(self) -> float | None:
        if self.peak_mib is None:
            return None
        return loglog_slope(self.xs, [max(m - self.memory_offset_mib, 1e-3) for m in self.peak_mib])

    @property
    def flags(self) -> list[str]:
        out = []
        if self.time_slope > self.expected_time_slope + SLOPE_TOLERANCE:
            out.append("time")
        slope = self.memory_slope
        if slope is not None and self.expected_memory_slope is not None:
            if slope > self.expected_memory_slope + SLOPE_TOLERANCE:
                out.append("memory")
        return out

    def to_json(self) -> dict:
        return {
            "stage": self.stage,
            "x_name": self.x_name,
            "xs": self.xs,
            "seconds": self.seconds,
            "peak_mib": self.peak_mib,
            "time_slope": self.time_slope,
            "expected_time_slope": self.expected_time_slope,
            "memory_slope": self.memory_slope,
            "expected_memory_slope": self.expected_memory_slope,
            "memory_offset_mib": self.memory_offset_mib,
            "flags": self.flags,
            "note": self.note,
            "extra": self.extra,
        }


def loglog_slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log y against log x (the exponent of a power law through the points)."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"a slope needs >= 2 points with one y per x, got {len(xs)} xs and {len(ys)} ys")
    lx, ly = np.log(np.asarray(xs, float)), np.log(np.asarray(ys, float))
    return float(np.polyfit(lx, ly, 1)[0])


def _number(v: float) -> str:
    if v >= 100:
        return f"{v:,.0f}".replace(",", " ")
    return f"{v:.3g}"


def markdown_table(curves: list[Curve]) -> str:
    """One row per stage: sizes, times, peaks, both slopes against their expectation, and the flag."""
    lines = [
        "| stage | x | sizes | seconds | peak MiB | time slope (expected) | memory slope (expected) | flag |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in curves:
        peaks = " / ".join(_number(m) for m in c.peak_mib) if c.peak_mib else "–"
        mem = "–"
        if c.memory_slope is not None:
            expected = "–" if c.expected_memory_slope is None else f"{c.expected_memory_slope:g}"
            mem = f"{c.memory_slope:.2f} ({expected})"
        lines.append(
            f"| {c.stage} | {c.x_name} | {' / '.join(_number(x) for x in c.xs)} | "
            f"{' / '.join(f'{s:.3g}' for s in c.seconds)} | {peaks} | "
            f"{c.time_slope:.2f} ({c.expected_time_slope:g}) | {mem} | {', '.join(c.flags) or 'ok'} |"
        )
    return "\n".join(lines)


def plot(curves: list[Curve], fpath: Path) -> None:
    """Log-log time (and memory, where measured) per stage, with the expected slope drawn through the first point."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter

    n = len(curves)
    cols = 3
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(4.2 * cols, 3.2 * rows), layout="constrained")
    for i, c in enumerate(curves):
        ax = fig.add_subplot(rows, cols, i + 1)
        xs = np.asarray(c.xs, float)
        ax.loglog(xs, c.seconds, "o-", color="C0", label=f"time (slope {c.time_slope:.2f})")
        ax.loglog(xs, c.seconds[0] * (xs / xs[0]) ** c.expected_time_slope, ":", color="C0", alpha=0.6)
        ax.set_xlabel(c.x_name)
        ax.xaxis.set_minor_formatter(NullFormatter())  # 2x steps: minor labels would overlap
        ax.set_ylabel("seconds")
        if c.peak_mib is not None:
            twin = ax.twinx()
            twin.loglog(xs, c.peak_mib, "s--", color="C1", label="peak MiB")
            twin.set_ylabel("peak MiB")
            low = min(c.peak_mib) / 1.25  # at least a factor 4 tall: a flat peak must look flat, not zoomed in
            twin.set_ylim(low, max(max(c.peak_mib) * 1.25, 4 * low))
            twin.yaxis.set_minor_formatter(NullFormatter())
            twin.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(c.stage + (" ⚑ " + ",".join(c.flags) if c.flags else ""), fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
    fig.savefig(fpath, dpi=110)


def run_point(module: str, args: list[str], env: dict[str, str] | None = None, timeout: float = 3600) -> dict:
    """Run ``python -m MODULE ARGS`` in a fresh process; return the JSON object its last stdout line prints,
    plus ``wall_s`` and ``peak_rss_mib`` (see :func:`run_measured`)."""
    run = run_measured([sys.executable, "-m", module, *args], env=env, timeout=timeout)
    lines = [x for x in run["stdout"].splitlines() if x.startswith("{")]
    if not lines:
        raise RuntimeError(
            f"{module} {' '.join(args)} printed no JSON line:\n{run['stdout'][-2000:]}\n{run['stderr'][-2000:]}"
        )
    result = json.loads(lines[-1])
    result.setdefault("wall_s", run["wall_s"])
    result.setdefault("peak_rss_mib", run["peak_rss_mib"])
    return result


# Runs the command as its child and writes that child's wait4 usage to the file named by argv[1]. Why a
# launcher: Linux keeps the high-water RSS across exec (exec_mmap records the old mm's), so a child forked
# straight from the benchmark (torch imported, ~1 GB) reports at least the benchmark's RSS as its own peak.
# Forked from this small interpreter (python -I, stdlib only: ~10 MiB), the command's peak is its own.
# argv[2] names a hold file or is empty: the child is SIGKILLed once that file appears (the rehearsal's kill -9).
_LAUNCHER = """
import json, os, sys, time
usage_fpath, hold = sys.argv[1], sys.argv[2]
pid = os.fork()
if pid == 0:
    try:
        os.execvp(sys.argv[3], sys.argv[3:])
    finally:
        os._exit(127)
while True:
    done, status, usage = os.wait4(pid, os.WNOHANG if hold else 0)
    if done:
        break
    if os.path.exists(hold):
        os.kill(pid, 9)
        hold = ""
    time.sleep(0.05)
cpu = usage.ru_utime + usage.ru_stime
with open(usage_fpath, "w") as f:
    json.dump({"status": os.waitstatus_to_exitcode(status), "maxrss_kib": usage.ru_maxrss, "cpu_s": cpu}, f)
"""


def run_measured(
    command: list[str],
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float | None = 3600,
    hold: Path | None = None,
    expect_status: int = 0,
    merge_stderr: bool = False,
) -> dict:
    """Run ``command`` in a fresh process; return its ``stdout``, ``stderr``, ``status``, ``wall_s``, ``cpu_s`` and
    ``peak_rss_mib`` (the process's own high-water mark and its reaped children's, from ``wait4``: DataLoader
    workers and writer processes included, each at its own peak, not their sum). With ``hold``, the command is
    SIGKILLed once that file appears (pass ``expect_status=-signal.SIGKILL``); ``merge_stderr`` sends stderr into
    ``stdout`` (one interleaved log). An exit status other than ``expect_status`` or a timeout raises RuntimeError."""
    start = time.perf_counter()
    with (
        tempfile.TemporaryFile("w+") as out,
        tempfile.TemporaryFile("w+") as err,
        tempfile.TemporaryDirectory(prefix="run-measured-") as tmp,
    ):
        usage_fpath = Path(tmp) / "usage.json"
        process = subprocess.Popen(
            [sys.executable, "-I", "-c", _LAUNCHER, str(usage_fpath), str(hold or ""), *command],
            stdout=out,
            stderr=subprocess.STDOUT if merge_stderr else err,
            cwd=cwd,
            env={**os.environ, **(env or {})},
            start_new_session=True,  # a timeout kills the launcher and the command together
        )
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise RuntimeError(f"{' '.join(command)} ran past {timeout:.0f} s and was killed") from None
        except BaseException:  # Ctrl-C at the driver: its own session keeps the command from the signal, so stop it
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise
        wall = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
        usage = json.loads(usage_fpath.read_text()) if usage_fpath.exists() else {"status": process.returncode}
    if process.returncode != 0 or usage["status"] != expect_status:
        raise RuntimeError(f"{' '.join(command)} exited {usage['status']}:\n{(stderr or stdout)[-4000:]}")
    return {
        "stdout": stdout,
        "stderr": stderr,
        "status": usage["status"],
        "wall_s": wall,
        "cpu_s": usage["cpu_s"],
        "peak_rss_mib": usage["maxrss_kib"] / 1024,
    }
