"""Dense where dense is faster: each product of the sparse path runs as its Triton kernel or as its dense
cuBLAS form, whichever this process measured faster for the device, the dtype and the shape.

Why: the sparse path (`sparse_decode.py`) trades the dense GEMMs of a shallow SAE's decode and backward
for products over the selected (token, latent) entries, run on a GPU as Triton kernels (`triton_sparse.py`).
Fewer flops is not always less time: at the paper's shape on an H200 (d_in 768, d_sae 19 200, B 4 096,
k 32, bf16) cuBLAS's dense GEMM beat the latent-major kernel of ``∂W_dec`` even at its best tiles, while the
codes' gradient was several times faster as a kernel (BENCHMARKS.md). Which side wins moves with the GPU,
the dtype, the shape and k, so it is measured where the run is, not assumed from one card.

How:

- Each call of a product (`PRODUCTS`) on the kernels' operands asks `CHOOSER` under a `Key`: the product,
  the device's name, the operands' dtype, B, d_sae, the feature width (d_in) and the entries per token,
  rounded up to a power of two (ReLU's count moves with the data: it must not measure every batch).
- The first call of a new key times both paths (`event_timer`: warm-up calls of each, then interleaved
  repetitions between CUDA events, the median of each) and keeps the faster; every later call of the key
  takes the kept path and measures nothing. The choices live in memory, per process.
- Never during a CUDA graph capture (a capture records kernels, it cannot time them): a key first seen
  while capturing takes the kernel, the path before this chooser, and is measured at its first eager call.
  A captured training step comes after eager ones (`sae_pipeline/training/graph_step.py`: three before the
  first capture, one before each new AuxK plan's), which have measured its keys by then.
- A measurement waits for the GPU: once per key and process (the first step of a fit, the first step of
  a new AuxK plan or batch shape); the steps after it read nothing on the host.
- The training side logs each choice in use once per fit (`report`, called after each training step by
  `SAEModule`): one INFO line per product and shape, with both times.

Both paths compute the same sums (the dense one scatters the entries into ``[B, d_sae]`` and multiplies,
in the operands' dtype with autocast off, as the kernels do), so a choice changes rounding, not results
(`tests/test_product_choice.py`). The timer and the capture test are parameters of `ProductChooser`: the
CPU tests, which have no Triton path, feed it timings.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import torch

T = TypeVar("T")

#: The products that choose, each with what it computes (the names of `Key.product` and of the log lines).
PRODUCTS = {
    "decode": "x_hat = Σ z · W_dec[j] per token",
    "dW_dec": "∂W_dec = Σ z · ∂x_hat per latent",
    "dW_enc": "∂W_enc = Σ ∂pre · (x − b_pre) per latent",
    "dvalues": "∂z = ⟨∂x_hat, W_dec[j]⟩ per entry",
    "dx": "∂x = Σ ∂pre · W_enc[:, j] per token",
}
SPARSE, DENSE = "sparse", "dense"
#: How a path reads in the log.
PATH_NAMES = {SPARSE: "the Triton kernel", DENSE: "cuBLAS (dense)"}


@dataclass(frozen=True)
class Key:
    """What a measurement holds for: a product on one kind of device, dtype and shape."""

    product: str
    device: str
    dtype: torch.dtype
    batch: int
    d_sae: int
    width: int
    per_token: int

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"{self.device}, {dtype}, B {self.batch}, d_sae {self.d_sae}, d_in {self.width}, "
            f"{self.per_token} entries per token"
        )


@dataclass(frozen=True)
class Choice:
    """The path a key takes, and the seconds per call measured for each (None: not measured)."""

    path: str
    sparse_seconds: float | None = None
    dense_seconds: float | None = None

    @property
    def measured(self) -> bool:
        return self.sparse_seconds is not None and self.dense_seconds is not None


#: The path of a key not measured yet while a capture runs: the kernel, as before there was a choice.
UNMEASURED = Choice(SPARSE)


def entries_per_token(nnz: int, batch: int) -> int:
    """``ceil(nnz / batch)`` rounded up to a power of two (1 for no entry): exact for TopK's k = 32, and a
    count that moves with the data (ReLU, JumpReLU) falls in a few keys, not one per batch."""
    per = -(-nnz // max(batch, 1))
    return 1 << max(per - 1, 0).bit_length()


@functools.cache
def _device_name(device_type: str, index: int | None) -> str:
    if device_type == "cuda":
        return torch.cuda.get_device_name(torch.cuda.current_device() if index is None else index)
    return device_type


def device_name(device: torch.device) -> str:
    """The GPU's name (``NVIDIA H200``), or the device type elsewhere; looked up once per device."""
    return _device_name(device.type, device.index)


def key_for(product: str, operand: torch.Tensor, batch: int, d_sae: int, width: int, nnz: int) -> Key:
    """The `Key` of ``product`` whose dtype is ``operand``'s (the table or tokens the product reads)."""
    return Key(product, device_name(operand.device), operand.dtype, batch, d_sae, width, entries_per_token(nnz, batch))


def stream_capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is being captured into a graph (never on another device)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def event_timer(
    sparse: Callable[[], object], dense: Callable[[], object], device: torch.device, warmup: int = 3, repeats: int = 10
) -> tuple[float, float]:
    """Seconds per call of ``sparse`` and ``dense``: ``warmup`` calls of each first (a Triton compile, cuBLAS's
    heuristics), then ``repeats`` of each, interleaved, the median of each. On a GPU each call lies between two
    CUDA events recorded on the current stream, all read after one wait at the end (the host queues the calls
    meanwhile, so this is the GPU's time, as in a replayed graph); elsewhere the host's clock."""
    for _ in range(warmup):
        sparse()
        dense()
    times: tuple[list[float], list[float]] = ([], [])
    if device.type == "cuda":
        events = []
        for _ in range(repeats):
            for side, fn in enumerate((sparse, dense)):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                events.append((side, start, end))
        events[-1][2].synchronize()
        for side, start, end in events:
            times[side].append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeats):
            for side, fn in enumerate((sparse, dense)):
                began = time.perf_counter()
                fn()
                times[side].append(time.perf_counter() - began)
    return statistics.median(times[0]), statistics.median(times[1])


Timer = Callable[[Callable[[], object], Callable[[], object], torch.device], tuple[float, float]]


class ProductChooser:
    """The per-process choices of the sparse products (see the module's docstring).

    Args:
        timer: ``timer(sparse, dense, device) -> (sparse seconds, dense seconds)``; `event_timer` by default,
            fake timings in the CPU tests.
        capturing: ``capturing(device) -> bool``, whether a CUDA graph is being captured now
            (`stream_capturing` by default; a flag in the CPU tests).
    """

    def __init__(self, timer: Timer = event_timer, capturing: Callable[[torch.device], bool] = stream_capturing):
        self.timer, self.capturing = timer, capturing
        self.choices: dict[Key, Choice] = {}
        self.measurements = 0
        #: "sparse" or "dense" for every call, measuring nothing (`forcing`: the benchmark's columns, the tests).
        self.force: str | None = None
        self._unreported: dict[Key, Choice] = {}
        self._reported: set[tuple[Key, bool]] = set()

    def run(
        self,
        key: Key,
        device: torch.device,
        sparse: Callable[[], T],
        dense: Callable[[], T],
        timed_sparse: Callable[[], object] | None = None,
    ) -> T:
        """``sparse()`` or ``dense()``, as `choose` says. ``timed_sparse``: what to time for the sparse side when
        that differs from the call (`sparse_decode.latent_sums`: a call that would sort the entries by latent
        first is timed with the sort)."""
        choice = self.choose(key, device, timed_sparse or sparse, dense)
        return dense() if choice.path == DENSE else sparse()

    def choose(
        self, key: Key, device: torch.device, sparse: Callable[[], object], dense: Callable[[], object]
    ) -> Choice:
        """``key``'s `Choice`: the kept one, else measured now (both callables timed), else, while a CUDA graph
        is being captured, `UNMEASURED` (not kept: the key's first eager call measures)."""
        if self.force is not None:
            return Choice(self.force)
        choice = self.choices.get(key)
        if choice is None:
            if self.capturing(device):
                choice = UNMEASURED
            else:
                sparse_seconds, dense_seconds = self.timer(sparse, dense, device)
                self.measurements += 1
                path = DENSE if dense_seconds < sparse_seconds else SPARSE
                choice = self.choices[key] = Choice(path, sparse_seconds, dense_seconds)
        if (key, choice.measured) not in self._reported:
            self._unreported[key] = choice
        return choice

    @contextmanager
    def forcing(self, path: str) -> Iterator[None]:
        """Every product on ``path`` ("sparse" or "dense") inside the block, nothing measured or kept."""
        if path not in (SPARSE, DENSE):
            raise ValueError(f"path must be {SPARSE!r} or {DENSE!r}, got {path!r}")
        before, self.force = self.force, path
        try:
            yield
        finally:
            self.force = before

    def new_fit(self) -> None:
        """Start a fit's report: every choice in use is logged again once (the measurements are kept)."""
        self._unreported.clear()
        self._reported.clear()

    def report(self) -> list[str]:
        """One line per choice used since the last report and not yet reported in this fit (cheap when none)."""
        if not self._unreported:
            return []
        lines = []
        for key, choice in self._unreported.items():
            self._reported.add((key, choice.measured))
            lines.append(describe(key, choice))
        self._unreported.clear()
        return lines


def describe(key: Key, choice: Choice) -> str:
    """The log line of a choice: the product, the path taken and why, the shape it holds for."""
    what = f"sparse path: {key.product} ({PRODUCTS.get(key.product, key.product)}) runs as {PATH_NAMES[choice.path]}"
    if not choice.measured:
        return f"{what}, not measured (first seen during a CUDA graph capture) [{key.describe()}]"
    assert choice.sparse_seconds is not None and choice.dense_seconds is not None
    return (
        f"{what}: measured {choice.sparse_seconds * 1e3:.3f} ms as the Triton kernel, "
        f"{choice.dense_seconds * 1e3:.3f} ms as cuBLAS [{key.describe()}]"
    )


#: The process's chooser, which `sparse_decode`'s products ask.
CHOOSER = ProductChooser()
