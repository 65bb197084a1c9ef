"""Keep glibc from growing the heap batch after batch in long passes over a dataset (``predict``).

glibc's malloc serves a block above ``M_MMAP_THRESHOLD`` (128 KiB) with its own ``mmap``, returned to the
system when freed, but each such free raises the threshold to the freed size (up to 32 MiB), so the
next blocks of that size come from the heap instead, where they fragment: a ``predict`` over 67k tokens
(d_in 768, d_sae 4096, batches of 1024: a few MiB per tensor) grew from 0.9 to 1.7-2.4 GiB, and its
peak grew with the number of tokens (``python -m benchmarks.scaling``, part ``predict_tokens``). Setting the
threshold explicitly turns that adjustment off (mallopt(3)): per-batch tensors are then mapped and
unmapped each batch, and the peak stays flat (0.9 GiB at any size), for a page-fault cost per batch that
the encoder's matmul dwarfs.
"""

from __future__ import annotations

import ctypes
import sys

M_MMAP_THRESHOLD = -3  # <malloc.h>
DEFAULT_THRESHOLD_BYTES = 128 * 1024  # glibc's initial value


def fix_mmap_threshold(nbytes: int = DEFAULT_THRESHOLD_BYTES) -> bool:
    """Pin glibc's mmap threshold at ``nbytes`` (no dynamic raise); False where libc is not glibc or refuses."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)  # the C library already loaded: find_library would start a subprocess
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt, nothing to fix
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, int(nbytes)))
