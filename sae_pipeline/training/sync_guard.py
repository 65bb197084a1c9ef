"""Find the calls that would make the host wait for a GPU, on any device (the CPU included).

Why: a training step that reads a device value on the host (``.item()``, ``bool(t)``, ``if t.any()``,
a tensor whose size depends on the data, such as ``nonzero`` or a boolean mask) stops the host until
the GPU has caught up, so the GPU idles while the host queues the next kernels. CUDA can report
such reads itself (``torch.cuda.set_sync_debug_mode("error")``), but only on a GPU; this guard
names the Python-level calls that cause them, so a CPU test can keep the step free of them.

It is a ``TorchFunctionMode``: it sees every torch function and tensor method called from Python
while it is active (the autograd Functions' backward included), not what C++ does inside one op.
``numpy()`` is not counted: it fails on a CUDA tensor, so it only runs on CPU-only branches.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

#: Calls that copy a device value to the host (or wait for one).
READS = {
    "item",
    "tolist",
    "cpu",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "__format__",
    "__repr__",
}
#: Calls whose output size depends on the data (CUDA reads the size back).
DATA_SIZED = {"nonzero", "argwhere", "bincount", "unique", "unique_consecutive", "masked_select"}
#: Indexing calls that sync when an index is a boolean tensor.
MASK_INDEXING = {"__getitem__", "__setitem__", "index_put", "index_put_"}


def _has_bool_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dtype == torch.bool
    if isinstance(value, (tuple, list)):
        return any(_has_bool_tensor(item) for item in value)
    return False


def syncing_call(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the call ``name(*args, **kwargs)`` would wait for a CUDA device."""
    if name in READS or name in DATA_SIZED:
        return True
    if name in MASK_INDEXING:
        return _has_bool_tensor(args[1:2]) or _has_bool_tensor(args[1:2] and args[1])
    if name == "repeat_interleave":  # tensor repeats without output_size: the size is read back
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    if name == "to":  # a copy to the host, named as such (``x.to(y.device)`` stays on y's device)
        return any(target == "cpu" for target in [*args[1:], kwargs.get("device")] if isinstance(target, str))
    return False


class HostSyncCounter(TorchFunctionMode):
    """Records ``(call name, where)`` of every call that would sync, or raises on the first one."""

    def __init__(self, raise_on_sync: bool = False) -> None:
        super().__init__()
        self.raise_on_sync = raise_on_sync
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if syncing_call(name, args, kwargs):
            where = _caller()
            self.calls.append(f"{name} at {where}")
            if self.raise_on_sync:
                raise RuntimeError(f"host sync: {name} at {where}")
        return func(*args, **kwargs)


def _caller() -> str:
    """The innermost frame outside torch and this module, as ``file:line``."""
    import traceback

    for frame in reversed(traceback.extract_stack()):
        if "/torch/" not in frame.filename and not frame.filename.endswith("sync_guard.py"):
            return f"{frame.filename}:{frame.lineno}"
    return "?"


@contextmanager
def count_host_syncs() -> Iterator[list[str]]:
    """``with count_host_syncs() as calls:`` -- ``calls`` lists the syncing calls made in the block."""
    counter = HostSyncCounter()
    with counter:
        yield counter.calls
