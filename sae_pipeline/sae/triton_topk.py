"""Triton kernels of the top-k selection (`topk_select.py` says when they run): the per-token top ``k`` of TopK
and BatchTopK's batch top ``n``, each in one read of the values from memory.

Why: at the paper's shape (B 4096, d_sae 19 200, k 32, bfloat16) `torch.topk` per token took about 1.3 ms of a
TopK step on an H200, and BatchTopK's threshold search (`batch_select.py`: a histogram pass over all ``B·d_sae``
values per key byte, then two more passes) 0.6x a plain top-k; reading the pre-activations once takes about
40 µs. Here each value is read once and costs a few integer operations; what follows works on small arrays.

**Keys.** A value's bits, with a negative value's magnitude bits inverted (``flip``), order values as floats
do, except that -0 sits just below +0 and a NaN lies outside ``[-inf, +inf]``. A *composite* appends the
complement of the column, ``flip · 2^16 + (2^16 − 1 − col)`` (``2^32`` for float32 or rows over 65 536), so
composites are distinct and their order is (value descending, column ascending): the top ``k`` composites of a
row are its top ``k`` values with ties at the threshold going to the lowest column. The exact path and the batch
passes use `_ukeys` instead: -0 equal to +0, every NaN one key above +inf.

**Per token** (`row_top_k`, one program per row): the row streams through in chunks of ``G`` columns; each of
the ``G`` lanes keeps the three largest composites it has seen (five integer min/max per value). The ``k``-th
largest of the lanes' two largest (``2G`` candidates: its key found bit by bit by counting, then the
lowest-column tie) is the row's threshold unless some lane's third-largest reaches it, the row holds a NaN, or
the threshold is ±0 (where ``flip`` tells -0 from +0). Then the exact path (`_exact_row`; by a count of
collisions about 2% of random rows at k 32, G 512; rows of many equal values): one more pass over the row (just
read: in L2) gathers the entries at or above a bound taken from the candidates, and the threshold is found among
them, or, when they do not fit (-inf but for a few, all equal), by counting passes over the row. The kept columns
are then sorted.

**Batch**: `triton_batch_topk.py`, from the per-token kernel's ``BATCH`` mode below.

No host synchronisation and fixed-size outputs: every decision is made on the device, so a step stays sync-free
and capturable. Tested on the CPU under `TRITON_INTERPRET=1` (`tests/test_topk_select.py`, the checks in
`tests/topk_select_checks.py`) and on CUDA (`tests/test_gpu_topk_select.py`); timed by
`python -m benchmarks.topk_select`.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU path needs none of this
    triton = None

#: dtype -> (key bits, the magnitude bits of +inf, the integer dtype of the same width)
KEY_FORMATS = {
    torch.bfloat16: (16, 0x7F80, torch.int16),
    torch.float16: (16, 0x7C00, torch.int16),
    torch.float32: (32, 0x7F800000, torch.int32),
}


def tile_for(k: int) -> tuple[int, int, int, int]:
    """``(G, UNROLL, num_warps, STAGES)`` of the per-token kernel for ``k``: ``G`` lanes, at least 16·k so that a
    lane rarely meets three of the top k (by a count of collisions about 2% of random rows at k 32 of 19 200 take
    the exact path; `benchmarks/topk_select.py` counts them),
    ``UNROLL`` chunks of ``G`` loaded per step (2 048 values), few warps (the search over the candidates is a chain
    of reductions, cheaper within fewer warps), ``STAGES`` 1: plain loads (more stages: `tl.range`'s pipelined
    copies through shared memory, more instructions per value; `benchmarks/topk_select.py --sweep` compares)."""
    groups = min(8192, max(512, triton.next_power_of_2(16 * k)))
    return groups, max(1, 2048 // groups), 2 if groups <= 512 else (4 if groups <= 2048 else groups // 512), 1


if triton is not None:

    @triton.jit
    def _keys(bits, KEY_BITS: tl.constexpr, INF_BITS: tl.constexpr):
        # sign and magnitude to two's complement (a negative value's key is minus its magnitude, so -0 -> 0);
        # every NaN one key above +inf
        if KEY_BITS == 16:
            b = bits.to(tl.int32)
            sign = b >> 15  # -1 for a negative value, else 0
            key = (b ^ (sign & 0x7FFF)) - sign
            return tl.where((b & 0x7FFF) > INF_BITS, 0x7FFF, key)
        else:
            sign = bits >> 31
            key = (bits ^ (sign & 0x7FFFFFFF)) - sign
            return tl.where((bits & 0x7FFFFFFF) > INF_BITS, 0x7FFFFFFF, key)

    @triton.jit
    def _ukeys(bits, KEY_BITS: tl.constexpr, INF_BITS: tl.constexpr):
        # keys offset to [1, 2^KEY_BITS - 1] (0: no entry), the form the searches count on
        if KEY_BITS == 16:
            return _keys(bits, KEY_BITS, INF_BITS) + 0x8000
        else:
            return _keys(bits, KEY_BITS, INF_BITS).to(tl.int64) + 0x80000000

    @triton.jit
    def _composites(bits, cols, WIDE: tl.constexpr):
        """``flip · 2^16 + (2^16 − 1 − col)`` (``2^32`` when WIDE): ``flip``, the value's bits with a negative
        value's magnitude bits inverted, orders values as floats do except that -0 sits just below +0 and a NaN
        lies outside ``[-inf, +inf]``; the kernel sends rows where either could matter to the exact path."""
        if WIDE:
            sign = bits >> (bits.dtype.primitive_bitwidth - 1)
            if bits.dtype.primitive_bitwidth == 16:
                flip = (bits ^ (sign & 0x7FFF)).to(tl.int64)
            else:
                flip = (bits ^ (sign & 0x7FFFFFFF)).to(tl.int64)
            return (flip << 32) | (0xFFFFFFFF - cols.to(tl.int64))
        else:  # 16-bit values, built in the high half where their bits land: four operations per value
            w = bits.to(tl.int32) << 16
            return (w ^ ((w >> 31) & 0x7FFF0000)) + (0xFFFF - cols)

    @triton.jit
    def _insert(m1, m2, m3, c):
        # c into each lane's three largest, m1 > m2 > m3: five integer min/max
        hi = tl.maximum(m1, c)
        c = tl.minimum(m1, c)
        m1 = hi
        hi = tl.maximum(m2, c)
        c = tl.minimum(m2, c)
        return m1, hi, tl.maximum(m3, c)

    @triton.jit
    def _exact_row(
        src,
        dst,
        scratch,
        n_cols,
        k,
        bound,
        lanes,
        KEY_BITS: tl.constexpr,
        INF_BITS: tl.constexpr,
        G: tl.constexpr,
        CAP: tl.constexpr,
    ):
        """The row's top k written as ``col << 32 | ukey`` in column order (ties at the threshold, lowest
        column first), given ``bound``, a ukey at most the row's k-th largest: one pass gathers the entries at
        or above it into ``scratch``; when they fit its ``CAP`` slots (the usual case: the bound from the
        candidates is close) the threshold is found among them, else by counting passes over the row (its key
        bit by bit: a row of NaNs, of equal values, or of -inf but for a few)."""
        found = tl.zeros([], dtype=tl.int32)
        for start in range(0, n_cols, G):
            cols = start + lanes
            ok = cols < n_cols
            u = _ukeys(tl.load(src + cols, mask=ok, other=0), KEY_BITS, INF_BITS).to(tl.int64)
            take = ok & (u >= bound)
            slot = found + tl.cumsum(take.to(tl.int32), 0) - 1
            tl.store(scratch + slot, (cols.to(tl.int64) << 32) | u, mask=take & (slot < CAP))
            found += tl.sum(take.to(tl.int32), 0)
        if found <= CAP:
            tl.debug_barrier()  # the gathered entries, read back by other threads of this program
            at = tl.arange(0, CAP)
            inside = at < found
            entries = tl.load(scratch + at, mask=inside, other=0)
            u = entries & 0xFFFFFFFF
            prefix = tl.zeros([], dtype=tl.int64)
            for i in tl.static_range(KEY_BITS):
                cand = prefix | (1 << (KEY_BITS - 1 - i))
                prefix = tl.where(tl.sum((inside & (u >= cand)).to(tl.int32), 0) >= k, cand, prefix)
            need = k - tl.sum((inside & (u > prefix)).to(tl.int32), 0)
            equal = inside & (u == prefix)
            kept = (inside & (u > prefix)) | (equal & (tl.cumsum(equal.to(tl.int32), 0) - 1 < need))
            tl.store(dst + tl.cumsum(kept.to(tl.int32), 0) - 1, entries, mask=kept)
        else:
            prefix = tl.zeros([], dtype=tl.int64)
            for i in tl.static_range(KEY_BITS):
                cand = prefix | (1 << (KEY_BITS - 1 - i))
                count = tl.zeros([], dtype=tl.int32)
                for start in range(0, n_cols, G):
                    cols = start + lanes
                    ok = cols < n_cols
                    u = _ukeys(tl.load(src + cols, mask=ok, other=0), KEY_BITS, INF_BITS)
                    count += tl.sum((ok & (u >= cand)).to(tl.int32), 0)
                prefix = tl.where(count >= k, cand, prefix)
            above = tl.zeros([], dtype=tl.int32)
            for start in range(0, n_cols, G):
                cols = start + lanes
                ok = cols < n_cols
                u = _ukeys(tl.load(src + cols, mask=ok, other=0), KEY_BITS, INF_BITS)
                above += tl.sum((ok & (u > prefix)).to(tl.int32), 0)
            need = k - above
            ties_seen = tl.zeros([], dtype=tl.int32)
            kept_seen = tl.zeros([], dtype=tl.int32)
            for start in range(0, n_cols, G):
                cols = start + lanes
                ok = cols < n_cols
                u = _ukeys(tl.load(src + cols, mask=ok, other=0), KEY_BITS, INF_BITS)
                equal = ok & (u == prefix)
                rank = ties_seen + tl.cumsum(equal.to(tl.int32), 0) - 1
                kept = (ok & (u > prefix)) | (equal & (rank < need))
                slot = kept_seen + tl.cumsum(kept.to(tl.int32), 0) - 1
                tl.store(dst + slot, (cols.to(tl.int64) << 32) | u.to(tl.int64), mask=kept)
                ties_seen += tl.sum(equal.to(tl.int32), 0)
                kept_seen += tl.sum(kept.to(tl.int32), 0)

    @triton.jit
    def _arrive(ticket_ptr, added):
        """This program's ticket (the count of programs before it). ``added``: what the atomics that published
        its results returned, all at least 0; the increment depends on them, so the ticket is taken only once
        every thread's atomic has been performed (at L2, where the last program reads): no fence needed."""
        return tl.atomic_add(ticket_ptr, 1 + (tl.min(added, 0) < 0).to(tl.int64))

    @triton.jit
    def _choose_digit(hist_ptr, prefix, wanted, SHIFT: tl.constexpr):
        """The digit at ``SHIFT`` of the ``wanted``-th largest key (the histogram of the keys that match
        ``prefix`` above it), read and reset atomically: ``(prefix with it, entries still wanted at it)``."""
        i = tl.arange(0, 256)
        from_top = tl.atomic_xchg(hist_ptr + 255 - i, tl.zeros([256], dtype=tl.int64))  # [i]: digit 255 - i
        at_or_above = tl.cumsum(from_top, 0)
        first = tl.min(tl.where(at_or_above >= wanted, i, 256), 0)
        above = tl.sum(tl.where(i < first, from_top, 0), 0)
        return prefix | ((255 - first).to(tl.int64) << SHIFT), wanted - above

    @triton.jit
    def _row_select_kernel(
        bits_ptr,
        stride_row,
        n_cols,
        k,
        col_bits,
        out_ptr,
        stride_out,
        vkey_ptr,
        hist_ptr,
        state_ptr,
        n_rows,
        n_keep,
        fallbacks_ptr,
        scratch_ptr,
        KEY_BITS: tl.constexpr,
        INF_BITS: tl.constexpr,
        WIDE: tl.constexpr,
        G: tl.constexpr,
        UNROLL: tl.constexpr,
        STAGES: tl.constexpr,
        KP: tl.constexpr,
        CAP: tl.constexpr,
        FORCE_EXACT: tl.constexpr,
        BATCH: tl.constexpr,
        COUNT_FALLBACKS: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        src = bits_ptr + row * stride_row
        dst = out_ptr + row * stride_out
        lanes = tl.arange(0, G)
        if WIDE:
            IB: tl.constexpr = 32  # composite bits below the key
            IDX_MAX: tl.constexpr = 0xFFFFFFFF
            m1 = tl.full([G], -9223372036854775808, tl.int64)  # no entry: below every composite
        else:
            IB: tl.constexpr = 16
            IDX_MAX: tl.constexpr = 0xFFFF
            m1 = tl.full([G], -2147483648, tl.int32)
        OFF: tl.constexpr = 1 << (KEY_BITS - 1)  # flip + OFF: 1 .. 2^KEY_BITS - 1 for a value, <= 0 for no entry
        empty = m1
        recount = FORCE_EXACT
        bound = tl.zeros([], dtype=tl.int64)  # a ukey at most the k-th largest, for the exact path
        if not FORCE_EXACT:
            m2 = m1
            m3 = m1
            low = -(m1 + 1)  # the smallest composite seen: a NaN with the sign bit set lies below -inf
            step: tl.constexpr = G * UNROLL
            n_full = n_cols // step * step
            for start in tl.range(0, n_full, step, num_stages=STAGES):  # whole chunks, unmasked (vector loads)
                start = tl.multiple_of(start, step)
                for j in tl.static_range(UNROLL):
                    cols = start + j * G + lanes
                    c = _composites(tl.load(src + cols), cols, WIDE)
                    m1, m2, m3 = _insert(m1, m2, m3, c)
                    low = tl.minimum(low, c)
            for j in tl.static_range(UNROLL):  # the last, partial chunk
                cols = n_full + j * G + lanes
                ok = cols < n_cols
                c = _composites(tl.load(src + cols, mask=ok, other=0), cols, WIDE)
                m1, m2, m3 = _insert(m1, m2, m3, tl.where(ok, c, empty))
                low = tl.minimum(low, tl.where(ok, c, -(empty + 1)))
            # the k-th largest of the 2G candidates: its key bit by bit ...
            u1 = (m1 >> IB) + OFF
            u2 = (m2 >> IB) + OFF
            prefix = tl.zeros([], dtype=u1.dtype)
            for i in tl.static_range(KEY_BITS):
                cand = prefix | (1 << (KEY_BITS - 1 - i))
                count = tl.sum((u1 >= cand).to(tl.int32) + (u2 >= cand).to(tl.int32), 0)
                prefix = tl.where(count >= k, cand, prefix)
            above = tl.sum((u1 > prefix).to(tl.int32) + (u2 > prefix).to(tl.int32), 0)
            eq1 = u1 == prefix
            eq2 = u2 == prefix
            need = k - above
            # ... then the lowest-column tie: the smallest composite of that key, or the need-th largest
            threshold = tl.minimum(
                tl.min(tl.where(eq1, m1, -(empty + 1)), 0), tl.min(tl.where(eq2, m2, -(empty + 1)), 0)
            )
            if tl.sum(eq1.to(tl.int32) + eq2.to(tl.int32), 0) > need:
                r1 = m1 & IDX_MAX
                r2 = m2 & IDX_MAX
                rev = (tl.zeros([], dtype=m1.dtype) + IDX_MAX) ^ ((tl.full([], 1, m1.dtype) << col_bits) - 1)
                for bit in range(col_bits):
                    cand = rev | (tl.full([], 1, m1.dtype) << (col_bits - 1 - bit))
                    count = tl.sum((eq1 & (r1 >= cand)).to(tl.int32) + (eq2 & (r2 >= cand)).to(tl.int32), 0)
                    rev = tl.where(count >= need, cand, rev)
                threshold = ((prefix - OFF).to(m1.dtype) << IB) | rev
            # Every entry a lane did not keep is at most its m3; below the threshold, the candidates hold the top k.
            # Else, or with a NaN in the row, or a threshold of ±0 (flip tells -0 from +0), the exact path.
            recount = (tl.max(m3, 0) >= threshold) | (prefix - OFF == 0) | (prefix - OFF == -1)
            nan = (tl.max(m1, 0) > ((INF_BITS << IB) | IDX_MAX)) | (tl.min(low, 0) < -((INF_BITS + 1) << IB))
            recount = recount | nan
            bound = tl.where(nan, 0, (prefix + (prefix < OFF).to(prefix.dtype)).to(tl.int64))  # as a `_ukeys` key
            if not recount:
                kept1 = m1 >= threshold
                kept2 = m2 >= threshold
                slot1 = tl.cumsum(kept1.to(tl.int32), 0) - 1
                slot2 = tl.sum(kept1.to(tl.int32), 0) + tl.cumsum(kept2.to(tl.int32), 0) - 1
                # the ukey of `_ukeys` (a negative value's flip is one below minus its magnitude)
                key1 = (u1 + (u1 < OFF).to(u1.dtype)).to(tl.int64)
                key2 = (u2 + (u2 < OFF).to(u2.dtype)).to(tl.int64)
                col1 = (IDX_MAX - (m1 & IDX_MAX)).to(tl.int64)
                col2 = (IDX_MAX - (m2 & IDX_MAX)).to(tl.int64)
                tl.store(dst + slot1, (col1 << 32) | key1, mask=kept1)
                tl.store(dst + slot2, (col2 << 32) | key2, mask=kept2)
        if recount:
            if COUNT_FALLBACKS:
                tl.atomic_add(fallbacks_ptr, 1)
            _exact_row(src, dst, scratch_ptr + row * CAP, n_cols, k, bound, lanes, KEY_BITS, INF_BITS, G, CAP)
        # each row ascending by column: the kept entries read back (this program wrote them), sorted, rewritten
        tl.debug_barrier()
        slots = tl.arange(0, KP)
        entries = tl.sort(tl.load(dst + slots, mask=slots < k, other=9223372036854775807), 0)
        tl.debug_barrier()
        if BATCH:
            tl.store(dst + slots, entries, mask=slots < k)
            u = entries & 0xFFFFFFFF
            tl.store(vkey_ptr + row, tl.min(tl.where(slots < k, u, 0xFFFFFFFF), 0))  # the row's k-th key
            hist = tl.histogram(((u >> (KEY_BITS - 8)) & 255).to(tl.int32), 256, mask=slots < k)
            added = tl.atomic_add(hist_ptr + tl.arange(0, 256), hist.to(tl.int64), mask=hist > 0)
            if _arrive(state_ptr + 7, tl.where(hist > 0, added, 0)) == n_rows - 1:  # the last program: first digit
                digit_prefix, wanted = _choose_digit(hist_ptr, tl.zeros([], dtype=tl.int64), n_keep, KEY_BITS - 8)
                tl.store(state_ptr + 0, digit_prefix)
                tl.store(state_ptr + 1, wanted)
                tl.atomic_xchg(state_ptr + 7, 0)
        else:
            tl.store(dst + slots, entries >> 32, mask=slots < k)


def _format(values: Tensor) -> tuple[Tensor, int, int]:
    """``(the values' bits as integers, key bits, +inf's magnitude bits)``."""
    key_bits, inf_bits, int_dtype = KEY_FORMATS[values.dtype]
    return values.view(int_dtype), key_bits, inf_bits


def _launch_rows(
    rows: Tensor,
    k: int,
    out: Tensor,
    *,
    tile: tuple[int, int, int, int] | None,
    force_exact: bool,
    batch: tuple[Tensor, Tensor, int] | None = None,
    fallbacks: Tensor | None = None,
) -> None:
    bits, key_bits, inf_bits = _format(rows)
    n_rows, n_cols = rows.shape
    groups, unroll, num_warps, stages = tile or tile_for(k)
    vkey, state, n_keep = batch if batch is not None else (out, out, 0)
    cap = 4 * triton.next_power_of_2(k)  # the exact path's entries at or above its bound, per row
    _row_select_kernel[(n_rows,)](
        bits,
        bits.stride(0),
        n_cols,
        k,
        max(1, (n_cols - 1).bit_length()),
        out,
        out.stride(0),
        vkey,
        state[8:] if batch is not None else out,
        state,
        n_rows,
        n_keep,
        fallbacks if fallbacks is not None else out,
        torch.empty(n_rows, cap, dtype=torch.int64, device=rows.device),
        KEY_BITS=key_bits,
        INF_BITS=inf_bits,
        WIDE=key_bits == 32 or n_cols > 65536,
        G=groups,
        UNROLL=unroll,
        STAGES=stages,
        KP=triton.next_power_of_2(k),
        CAP=cap,
        FORCE_EXACT=force_exact or 2 * groups < k,
        BATCH=batch is not None,
        COUNT_FALLBACKS=fallbacks is not None,
        num_warps=num_warps,
    )


def row_top_k(
    rows: Tensor,
    k: int,
    out: Tensor | None = None,
    *,
    tile: tuple[int, int, int, int] | None = None,
    force_exact: bool = False,
    fallbacks: Tensor | None = None,
) -> Tensor:
    """Column indices ``[B, k]`` (int64, each row ascending) of the ``k`` largest entries of each row of
    ``rows [B, d_sae]`` (``1 ≤ k ≤ d_sae``; rows contiguous): ties at the threshold to the lowest column, NaN
    the largest. ``out``: the buffer to write (the tests poison it); ``tile``: ``(G, UNROLL, num_warps, STAGES)``
    instead of `tile_for`'s; ``force_exact``: every row through the exact path (the path a row takes when its
    candidates may miss one), from a bound below every value; ``fallbacks``: an int32 ``[1]`` the rows that took
    the exact path are added to."""
    if out is None:
        out = torch.empty(rows.shape[0], k, dtype=torch.int64, device=rows.device)
    if rows.shape[0]:
        _launch_rows(rows, k, out, tile=tile, force_exact=force_exact, fallbacks=fallbacks)
    return out
