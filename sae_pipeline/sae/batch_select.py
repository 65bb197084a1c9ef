"""BatchTopK's selection: the ``n`` largest of ``B·d_sae`` values, without a top-k over all of them on a GPU.

Since the selection kernels (`topk_select.py`, `triton_topk.py`: one read of the values), this search runs only
for the shapes they do not take (`topk_select.batch_top_indices` falls back to it); the tie rule is the same.

The support BatchTopK trains on is the batch top ``n = B·k`` of the ranked pre-activations. On the
CPU that stays one `torch.topk` (a partial sort, cheap there). On a GPU a `topk` of 131 072 out of
78.6 M values (the paper shape) is a multi-block radix select plus a gather of values and indices;
here instead, a threshold search over the float bit patterns finds the n-th largest value, and the
support is every entry above it plus, of the entries equal to it, those of lowest flat index:

1. every value maps to a 64-bit key whose signed order is the float order (a negative float's key is
   minus its magnitude bits, -0 counts as +0, a 32-bit float's key fills the high half);
2. one pass per key byte (2 for bfloat16, 3 for float16, 4 for float32, 8 for float64): a Triton
   kernel builds the histogram of that byte over the entries whose higher bytes equal the prefix
   found so far, and a one-program kernel picks the byte where the count from the top reaches the
   entries still wanted; the prefix and that count live in a device tensor, so no pass reads
   anything back on the host (the step stays free of host synchronisation);
3. two more passes write the entries above the threshold and the first ties into ``n`` slots, in
   flat order (as `SparseCodes.from_flat` wants them): a count per program, a scan over the
   counts, then each program's kept indices at its offset.

The tie rule (lowest flat index among the values equal to the n-th largest) is the order in which
CUDA's radix-select `topk` gathers ties, so the support should equal today's on a GPU even then
(`tests/test_gpu_sparse_kernels.py` checks it); the CPU's `topk` breaks such ties in no documented
order. The checks (`tests/batch_select_checks.py`): the same support as `topk` where no tie straddles
the threshold, the same kept values and the rule where one does.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU path needs none of this
    triton = None

#: Key bytes that can differ between values of each dtype (the rest of a 64-bit key is 0).
PASSES = {torch.bfloat16: 2, torch.float16: 3, torch.float32: 4, torch.float64: 8}
BLOCK = 8192  # values per program of a histogram pass: fewer programs, fewer atomics on the 256 bins

if triton is not None:

    @triton.jit
    def _sortable_keys(x, IS64: tl.constexpr):
        # sign and magnitude to two's complement: a negative float's key is minus its magnitude bits
        # (which keeps the low zero bits of a bfloat16's float32 zero, so its 2 passes settle every bit)
        if IS64:
            bits = tl.where(x == 0, 0.0, x.to(tl.float64)).to(tl.int64, bitcast=True)
            return tl.where(bits < 0, -(bits & 0x7FFFFFFFFFFFFFFF), bits)
        else:
            bits = tl.where(x == 0, 0.0, x.to(tl.float32)).to(tl.int32, bitcast=True)
            keys = tl.where(bits < 0, -(bits & 0x7FFFFFFF), bits)
            return keys.to(tl.int64) << 32

    @triton.jit
    def _byte_histogram_kernel(
        x_ptr, n, state_ptr, hist_ptr, prefix_mask, SHIFT: tl.constexpr, IS64: tl.constexpr, BLOCK: tl.constexpr
    ):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offsets < n
        keys = _sortable_keys(tl.load(x_ptr + offsets, mask=ok, other=0.0), IS64)
        match = ok & ((keys & prefix_mask) == tl.load(state_ptr))
        byte = (keys >> SHIFT) & 255
        if SHIFT == 56:  # the sign byte: flip its top bit so that byte order is key order
            byte = byte ^ 128
        counts = tl.histogram(byte.to(tl.int32), 256, mask=match)
        tl.atomic_add(hist_ptr + tl.arange(0, 256), counts)

    @triton.jit
    def _choose_byte_kernel(hist_ptr, state_ptr, SHIFT: tl.constexpr):
        i = tl.arange(0, 256)
        from_top = tl.load(hist_ptr + 255 - i).to(tl.int64)  # from_top[i]: entries with byte 255 - i
        at_or_above = tl.cumsum(from_top, 0)
        wanted = tl.load(state_ptr + 1)
        first = tl.min(tl.where(at_or_above >= wanted, i, 256), 0)
        above = tl.sum(tl.where(i < first, from_top, 0), 0)
        byte = (255 - first).to(tl.int64)
        if SHIFT == 56:
            byte = byte ^ 128
        tl.store(state_ptr, tl.load(state_ptr) | (byte << SHIFT))
        tl.store(state_ptr + 1, wanted - above)
        tl.store(hist_ptr + i, tl.zeros([256], dtype=tl.int32))

    @triton.jit
    def _count_kernel(x_ptr, n, state_ptr, above_ptr, equal_ptr, IS64: tl.constexpr, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offsets < n
        keys = _sortable_keys(tl.load(x_ptr + offsets, mask=ok, other=0.0), IS64)
        threshold = tl.load(state_ptr)
        tl.store(above_ptr + tl.program_id(0), tl.sum((ok & (keys > threshold)).to(tl.int64), 0))
        tl.store(equal_ptr + tl.program_id(0), tl.sum((ok & (keys == threshold)).to(tl.int64), 0))

    @triton.jit
    def _write_kernel(
        x_ptr, n, state_ptr, equal_before_ptr, kept_before_ptr, out_ptr, IS64: tl.constexpr, BLOCK: tl.constexpr
    ):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offsets < n
        keys = _sortable_keys(tl.load(x_ptr + offsets, mask=ok, other=0.0), IS64)
        threshold = tl.load(state_ptr)
        equal = ok & (keys == threshold)
        tie_rank = tl.load(equal_before_ptr + tl.program_id(0)) + tl.cumsum(equal.to(tl.int64), 0) - 1
        kept = (ok & (keys > threshold)) | (equal & (tie_rank < tl.load(state_ptr + 1)))
        slot = tl.load(kept_before_ptr + tl.program_id(0)) + tl.cumsum(kept.to(tl.int64), 0) - 1
        tl.store(out_ptr + slot, offsets, mask=kept)


def radix_applies(values: Tensor) -> bool:
    """Whether the threshold search runs: Triton imported, a CUDA tensor of a float dtype it keys."""
    return triton is not None and values.is_cuda and values.dtype in PASSES


def batch_top_indices(values: Tensor, n: int) -> Tensor:
    """Flat indices of the ``n`` largest entries of the 1-D ``values`` (``1 ≤ n ≤ numel``): the threshold
    search on a GPU (sorted, ties to the lowest index), `torch.topk` elsewhere (any order)."""
    if not radix_applies(values):
        return values.topk(n, sorted=False).indices
    return radix_top_indices(values, n)


def _blocks(values: Tensor) -> tuple[int, tuple[int]]:
    """Values per program and the grid of a pass over ``values``."""
    block = max(256, min(BLOCK, triton.next_power_of_2(values.numel())))
    return block, (triton.cdiv(values.numel(), block),)


def threshold_state(values: Tensor, n: int) -> Tensor:
    """``[key of the n-th largest, how many entries equal to it the top n holds]`` (int64, on the device), by
    one histogram pass per key byte (the bytes above the pass's are settled: the host knows their mask)."""
    values = values.contiguous()
    state = torch.zeros(2, dtype=torch.int64, device=values.device)
    state[1:].fill_(n)  # a fill kernel: `state[1] = n` copies a host scalar, a sync (and illegal in a capture)
    hist = torch.zeros(256, dtype=torch.int32, device=values.device)
    is64 = values.dtype == torch.float64
    block, grid = _blocks(values)
    for byte in range(PASSES[values.dtype]):
        shift = 56 - 8 * byte
        settled = -(1 << (shift + 8)) if byte else 0  # the bits above this byte, as a signed 64-bit mask
        _byte_histogram_kernel[grid](
            values, values.numel(), state, hist, settled, SHIFT=shift, IS64=is64, BLOCK=block, num_warps=8
        )
        _choose_byte_kernel[(1,)](hist, state, SHIFT=shift)
    return state


def radix_top_indices(values: Tensor, n: int, out: Tensor | None = None) -> Tensor:
    """Sorted flat indices of the ``n`` largest entries of 1-D ``values``; of the entries equal to the n-th
    largest, those of lowest index. No host synchronisation: after the threshold search, one pass counts
    each program's entries above and equal to the threshold, a scan over those counts (one per program)
    gives each program its first output slot and its first tie's rank, and a second pass writes the
    kept indices in flat order (into ``out``, int64 ``[n]``, when given: the tests poison it)."""
    values = values.contiguous()
    state = threshold_state(values, n)
    block, grid = _blocks(values)
    above = torch.empty(grid[0], dtype=torch.int64, device=values.device)
    equal = torch.empty_like(above)
    _count_kernel[grid](
        values, values.numel(), state, above, equal, IS64=values.dtype == torch.float64, BLOCK=block, num_warps=8
    )
    equal_before = equal.cumsum(0) - equal
    kept = above + (state[1] - equal_before).clamp(min=torch.zeros_like(equal), max=equal)  # the ties it keeps
    if out is None:
        out = torch.empty(n, dtype=torch.int64, device=values.device)
    _write_kernel[grid](
        values,
        values.numel(),
        state,
        equal_before,
        kept.cumsum(0) - kept,
        out,
        IS64=values.dtype == torch.float64,
        BLOCK=block,
        num_warps=8,
    )
    return out
