"""An allocation that fails is one line: what was being allocated, how much, why it was refused, and the fix.

Why: the large allocations sized by a flag (training's `--data.cache` split in host or device memory, its
shuffle buffer, its loader's batches in pinned host memory; the extraction's batches in pinned host memory)
fail as whatever their allocator raises: an `OSError` (ENOMEM) from `mmap` under `ulimit -v` or strict
overcommit, a `MemoryError`, torch's `OutOfMemoryError` for device memory, a `RuntimeError`
(`AcceleratorError`) "CUDA error: out of memory" when pinning, each inside dozens of lines of traceback
that name none of the flags that would fix it. `allocating` turns them into `AllocationError` (a
`ValueError`: exit 2, one `error:` line, as a bad input; a fit's new `version_N` is removed with it,
`sae_pipeline.run_lock`); anything else passes through unchanged. Here, beside the other command plumbing,
because both packages allocate so (the extraction imports nothing of `sae_pipeline`).

`ulimit -v` (RLIMIT_AS) counts address space, mapped or not: `address_space_left` is what this process
may still map under it, which the `--data.cache` fit check compares with the split's bytes as it does
`MemAvailable` (`sae_pipeline.data.cache.check_fits`).
"""

from __future__ import annotations

import errno
import re
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["AllocationError", "address_space_left", "allocating", "is_out_of_memory", "size_text"]

# What torch says when an allocation fails: device memory, pinned memory, shared memory (`unable to mmap N
# bytes from file </torch_...>: Cannot allocate memory (12)`).
_OUT_OF_MEMORY_TEXT = re.compile(r"out of memory|cannot allocate memory|unable to allocate", re.IGNORECASE)


class AllocationError(ValueError):
    """An allocation the run needs was refused: one line naming it, its size and the fix (exit 2)."""


def size_text(n_bytes: float) -> str:
    """Bytes for an error line: from a digits split (kB) to an ImageNet one (hundreds of GB)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.2f} {unit}"
    return f"{int(n_bytes)} B"


def address_space_used() -> int:
    """Bytes of address space this process has mapped (`VmSize`), 0 where `/proc/self/status` is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def address_space_left() -> int | None:
    """Bytes this process may still map under `ulimit -v` (its RLIMIT_AS soft limit less what it has mapped);
    None without a limit."""
    try:
        import resource
    except ImportError:  # not a Unix
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    return max(0, soft - address_space_used())


def is_out_of_memory(exn: BaseException) -> bool:
    """Whether `exn` is an allocation that failed (module docstring), not some other error."""
    if isinstance(exn, MemoryError):
        return True
    if isinstance(exn, OSError):
        return exn.errno == errno.ENOMEM
    if isinstance(exn, RuntimeError):  # torch.OutOfMemoryError, AcceleratorError and plain RuntimeErrors
        return type(exn).__name__ == "OutOfMemoryError" or bool(_OUT_OF_MEMORY_TEXT.search(str(exn)))
    return False


def _reason(exn: BaseException) -> str:
    """The allocator's own words, short: `Cannot allocate memory`, `CUDA out of memory`, ..."""
    if isinstance(exn, OSError) and exn.strerror:
        return exn.strerror
    lines = [line.strip() for line in str(exn).splitlines() if line.strip()]
    if lines and lines[0].startswith("Caught "):  # re-raised from a DataLoader thread: the original is last
        lines = [lines[-1].partition(": ")[2] or lines[-1]]
    text = lines[0].split(". ")[0].rstrip(".") if lines else ""
    return text[:200] or type(exn).__name__


@contextmanager
def allocating(what: str, n_bytes: int | None, fix: str) -> Iterator[None]:
    """Raise `AllocationError` (`what: could not allocate SIZE (REASON); FIX`) for an allocation that fails in
    the block; other errors pass through."""
    try:
        yield
    except (OSError, MemoryError, RuntimeError) as exn:
        if not is_out_of_memory(exn):
            raise
        size = f" {size_text(n_bytes)}" if n_bytes else ""
        left = address_space_left()
        limit = f"; ulimit -v leaves this process {size_text(left)} of address space" if left is not None else ""
        raise AllocationError(f"{what}: could not allocate{size} ({_reason(exn)}{limit}); {fix}") from None
