"""sae_pipeline.training.heap: after fix_mmap_threshold a freed large block goes back to the system, as it
does before glibc's dynamic threshold kicks in (the growth ``predict`` showed in python -m benchmarks.scaling)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

PROBE = """
import sys
import numpy as np
from sae_pipeline.training.heap import fix_mmap_threshold

def rss_kib():
    return next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmRSS"))

if sys.argv[1] == "fixed":
    assert fix_mmap_threshold()
big = np.ones(16 * 2**20, np.uint8)  # a mapped block; freeing it raises glibc's threshold to 16 MiB
del big
block = np.ones(8 * 2**20, np.uint8)  # mapped again only if the threshold stayed fixed
before = rss_kib()
del block
print((before - rss_kib()) // 1024)  # MiB given back by the free
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt's mmap threshold is glibc's")
def test_fixed_threshold_returns_freed_batches_to_the_system() -> None:
    def returned_mib(mode: str) -> int:
        done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
        return int(done.stdout.strip())

    assert returned_mib("fixed") >= 7
    assert returned_mib("dynamic") < 2  # without the fix the 8 MiB stay in the heap: the pile-up it prevents
