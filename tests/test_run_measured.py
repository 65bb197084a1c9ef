"""benchmarks.scaling.fit.run_measured: a Ctrl-C at the driver stops the measured command too (the command
runs in its own session, out of reach of the terminal's SIGINT)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO_DPATH = Path(__file__).resolve().parents[1]


def test_ctrl_c_at_the_driver_stops_the_measured_command(tmp_path: Path) -> None:
    marker = tmp_path / "running"
    child_code = f"import os, time; open({str(marker)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    driver_code = (
        "import signal, sys\nfrom benchmarks.scaling.fit import run_measured\n"
        # a terminal's Ctrl-C: Python leaves SIGINT ignored when it starts so (as under `nohup` or `cmd &`)
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        f"run_measured([sys.executable, '-c', {child_code!r}])\n"
    )
    driver = subprocess.Popen([sys.executable, "-c", driver_code], cwd=REPO_DPATH, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 30
    while not (marker.exists() and marker.read_text()):
        assert time.time() < deadline and driver.poll() is None, driver.stderr.read() if driver.stderr else ""
        time.sleep(0.05)
    child_pid = int(marker.read_text())
    driver.send_signal(signal.SIGINT)
    assert driver.wait(timeout=30) != 0 and "KeyboardInterrupt" in (driver.stderr.read() if driver.stderr else "")
    deadline = time.time() + 10
    while _alive(child_pid):
        assert time.time() < deadline, "the measured command outlived the driver's Ctrl-C"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not open(f"/proc/{pid}/stat").read().split(") ")[1].startswith("Z")  # a zombie is gone
