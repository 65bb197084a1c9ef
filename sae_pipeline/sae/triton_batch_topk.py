"""BatchTopK's batch top ``n`` on a GPU, after the per-token kernel of `triton_topk.py` (its ``BATCH`` mode
keeps each row's top ``R`` and picks the first digit); the keys and the digit search are that module's.

**Batch** (`batch_top_k`): the per-token kernel keeps each row's top ``R = 2k`` (with their keys) and the key of
its ``R``-th; the last of its programs picks the first 8-bit digit of the ``n``-th largest key among those
``B·R`` from a histogram the programs added to; one pass per further digit (its last program picks it) gives the
rest. A row whose ``R``-th key reaches that threshold may hold more entries at or above the batch threshold than
it kept (a massive token): only then a second round of digit passes runs, with such rows read whole. A count
per row, a scan over the rows (the count's last program) and a write put the kept flat indices in ascending
order, ties at the threshold to the lowest flat index (as `batch_select.py`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from sae_pipeline.sae.triton_topk import _format, _launch_rows, triton

ROWS_PER_PROGRAM = 16  # rows per program of the batch passes over the kept entries

if triton is not None:
    import triton.language as tl

    from sae_pipeline.sae.triton_topk import _arrive, _choose_digit, _ukeys

    @triton.jit
    def _batch_digit_kernel(
        bits_ptr,
        stride_row,
        n_rows,
        n_cols,
        kept_ptr,
        r,
        vkey_ptr,
        state_ptr,
        hist_ptr,
        n_keep,
        ROUND: tl.constexpr,
        SHIFT: tl.constexpr,
        KEY_BITS: tl.constexpr,
        INF_BITS: tl.constexpr,
        RP: tl.constexpr,
        ROWS: tl.constexpr,
        G: tl.constexpr,
    ):
        """One digit of the batch threshold: round 1 over the kept entries (its first digit was the per-token
        kernel's), round 2 (only when some row may hold more) over the kept entries with those rows whole."""
        if ROUND == 1:
            run = tl.full([], 1, tl.int1)
            prefix = tl.load(state_ptr + 0)
            wanted = tl.load(state_ptr + 1)
        else:
            run = tl.load(state_ptr + 4) == 0
            if SHIFT == KEY_BITS - 8:
                prefix = tl.zeros([], dtype=tl.int64)
                wanted = tl.zeros([], dtype=tl.int64) + n_keep
            else:
                prefix = tl.load(state_ptr + 2)
                wanted = tl.load(state_ptr + 3)
        if run:
            first_t = tl.load(state_ptr + 0)  # round 1's threshold: rows whose k-th key reaches it are read whole
            hist = tl.zeros([256], dtype=tl.int32)
            rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
            use = rows < n_rows
            if ROUND == 2:
                use = use & (tl.load(vkey_ptr + rows, mask=use, other=0) < first_t)
            cols = tl.arange(0, RP)
            ok = use[:, None] & (cols < r)[None, :]
            u = tl.load(kept_ptr + rows[:, None].to(tl.int64) * r + cols[None, :], mask=ok, other=0) & 0xFFFFFFFF
            match = ok & ((u >> (SHIFT + 8)) == (prefix >> (SHIFT + 8)))
            hist += tl.histogram(
                tl.reshape(((u >> SHIFT) & 255).to(tl.int32), [ROWS * RP]), 256, mask=tl.reshape(match, [ROWS * RP])
            )
            if ROUND == 2:
                lanes = tl.arange(0, G)
                for i in range(ROWS):
                    row = tl.program_id(0) * ROWS + i
                    if tl.load(vkey_ptr + row, mask=row < n_rows, other=0) >= first_t:
                        src = bits_ptr + row.to(tl.int64) * stride_row
                        for start in range(0, n_cols, G):
                            c = start + lanes
                            within = c < n_cols
                            uw = _ukeys(tl.load(src + c, mask=within, other=0), KEY_BITS, INF_BITS).to(tl.int64)
                            m = within & ((uw >> (SHIFT + 8)) == (prefix >> (SHIFT + 8)))
                            hist += tl.histogram(((uw >> SHIFT) & 255).to(tl.int32), 256, mask=m)
            added = tl.atomic_add(hist_ptr + tl.arange(0, 256), hist.to(tl.int64), mask=hist > 0)
            if _arrive(state_ptr + 7, tl.where(hist > 0, added, 0)) == tl.num_programs(0) - 1:  # the last picks
                prefix, wanted = _choose_digit(hist_ptr, prefix, wanted, SHIFT)
                if ROUND == 1:
                    tl.store(state_ptr + 0, prefix)
                    tl.store(state_ptr + 1, wanted)
                    if SHIFT == 0:  # round 1 done: a second round only when some row may hold more
                        reach = tl.zeros([], dtype=tl.int32)
                        for start in range(0, n_rows, 1024):
                            at = start + tl.arange(0, 1024)
                            vk = tl.load(vkey_ptr + at, mask=at < n_rows, other=0, cache_modifier=".cg")
                            reach += tl.sum((vk >= prefix).to(tl.int32), 0)
                        if reach == 0:
                            tl.store(state_ptr + 4, 1)
                            tl.store(state_ptr + 5, prefix)
                            tl.store(state_ptr + 6, wanted)
                else:
                    tl.store(state_ptr + 2, prefix)
                    tl.store(state_ptr + 3, wanted)
                    if SHIFT == 0:
                        tl.store(state_ptr + 5, prefix)
                        tl.store(state_ptr + 6, wanted)
                tl.atomic_xchg(state_ptr + 7, 0)

    @triton.jit
    def _batch_count_kernel(
        bits_ptr,
        stride_row,
        n_rows,
        n_cols,
        kept_ptr,
        r,
        vkey_ptr,
        state_ptr,
        counts_ptr,
        KEY_BITS: tl.constexpr,
        INF_BITS: tl.constexpr,
        RP: tl.constexpr,
        ROWS: tl.constexpr,
        G: tl.constexpr,
    ):
        """Per row, the entries above the batch threshold and equal to it; the last program turns them into
        each row's ties kept (the lowest flat indices first) and first output slot."""
        threshold = tl.load(state_ptr + 5)
        need = tl.load(state_ptr + 6)
        first_t = tl.load(state_ptr + 0)
        lane = tl.arange(0, ROWS)
        rows = tl.program_id(0) * ROWS + lane
        within = rows < n_rows
        whole = within & (tl.load(vkey_ptr + rows, mask=within, other=0) >= first_t)
        cols = tl.arange(0, RP)
        ok = (within & ~whole)[:, None] & (cols < r)[None, :]
        u = tl.load(kept_ptr + rows[:, None].to(tl.int64) * r + cols[None, :], mask=ok, other=0) & 0xFFFFFFFF
        above = tl.sum((ok & (u > threshold)).to(tl.int64), 1)
        equal = tl.sum((ok & (u == threshold)).to(tl.int64), 1)
        lanes = tl.arange(0, G)
        for i in range(ROWS):
            row = tl.program_id(0) * ROWS + i
            if tl.load(vkey_ptr + row, mask=row < n_rows, other=0) >= first_t:
                src = bits_ptr + row.to(tl.int64) * stride_row
                a = tl.zeros([], dtype=tl.int64)
                e = tl.zeros([], dtype=tl.int64)
                for start in range(0, n_cols, G):
                    c = start + lanes
                    inside = c < n_cols
                    uw = _ukeys(tl.load(src + c, mask=inside, other=0), KEY_BITS, INF_BITS).to(tl.int64)
                    a += tl.sum((inside & (uw > threshold)).to(tl.int64), 0)
                    e += tl.sum((inside & (uw == threshold)).to(tl.int64), 0)
                above = tl.where(lane == i, a, above)
                equal = tl.where(lane == i, e, equal)
        added = tl.atomic_add(counts_ptr + rows, above, mask=within)  # into zeros: published at L2
        added = tl.minimum(added, tl.atomic_add(counts_ptr + n_rows + rows, equal, mask=within))
        if _arrive(state_ptr + 7, tl.where(within, added, 0)) == tl.num_programs(0) - 1:  # the last: scan rows
            ties_before = tl.zeros([], dtype=tl.int64)
            kept_before = tl.zeros([], dtype=tl.int64)
            for start in range(0, n_rows, 1024):
                at = start + tl.arange(0, 1024)
                inside = at < n_rows
                a = tl.load(counts_ptr + at, mask=inside, other=0, cache_modifier=".cg")
                e = tl.load(counts_ptr + n_rows + at, mask=inside, other=0, cache_modifier=".cg")
                before = ties_before + tl.cumsum(e, 0) - e
                ties = tl.minimum(tl.maximum(need - before, 0), e)
                kept = a + ties
                tl.store(counts_ptr + at, kept_before + tl.cumsum(kept, 0) - kept, mask=inside)  # first slot
                tl.store(counts_ptr + n_rows + at, ties, mask=inside)
                ties_before += tl.sum(e, 0)
                kept_before += tl.sum(kept, 0)
            tl.atomic_xchg(state_ptr + 7, 0)

    @triton.jit
    def _batch_write_kernel(
        bits_ptr,
        stride_row,
        n_rows,
        n_cols,
        kept_ptr,
        r,
        vkey_ptr,
        state_ptr,
        counts_ptr,
        out_ptr,
        KEY_BITS: tl.constexpr,
        INF_BITS: tl.constexpr,
        RP: tl.constexpr,
        ROWS: tl.constexpr,
        G: tl.constexpr,
    ):
        """Each row's kept flat indices, ascending, from its first slot."""
        threshold = tl.load(state_ptr + 5)
        first_t = tl.load(state_ptr + 0)
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        within = rows < n_rows
        whole = within & (tl.load(vkey_ptr + rows, mask=within, other=0) >= first_t)
        first_slot = tl.load(counts_ptr + rows, mask=within, other=0)
        ties = tl.load(counts_ptr + n_rows + rows, mask=within, other=0)
        cols = tl.arange(0, RP)
        ok = (within & ~whole)[:, None] & (cols < r)[None, :]
        entries = tl.load(kept_ptr + rows[:, None].to(tl.int64) * r + cols[None, :], mask=ok, other=0)
        u = entries & 0xFFFFFFFF
        equal = ok & (u == threshold)
        rank = tl.cumsum(equal.to(tl.int64), 1) - 1
        kept = (ok & (u > threshold)) | (equal & (rank < ties[:, None]))
        slot = first_slot[:, None] + tl.cumsum(kept.to(tl.int64), 1) - 1
        tl.store(out_ptr + slot, rows[:, None].to(tl.int64) * n_cols + (entries >> 32), mask=kept)
        lanes = tl.arange(0, G)
        for i in range(ROWS):
            row = tl.program_id(0) * ROWS + i
            if tl.load(vkey_ptr + row, mask=row < n_rows, other=0) >= first_t:
                src = bits_ptr + row.to(tl.int64) * stride_row
                need = tl.load(counts_ptr + n_rows + row)
                slot_at = tl.load(counts_ptr + row)
                ties_seen = tl.zeros([], dtype=tl.int64)
                for start in range(0, n_cols, G):
                    c = start + lanes
                    inside = c < n_cols
                    uw = _ukeys(tl.load(src + c, mask=inside, other=0), KEY_BITS, INF_BITS).to(tl.int64)
                    eq = inside & (uw == threshold)
                    rk = ties_seen + tl.cumsum(eq.to(tl.int64), 0) - 1
                    keep = (inside & (uw > threshold)) | (eq & (rk < need))
                    at = slot_at + tl.cumsum(keep.to(tl.int64), 0) - 1
                    tl.store(out_ptr + at, row.to(tl.int64) * n_cols + c, mask=keep)
                    ties_seen += tl.sum(eq.to(tl.int64), 0)
                    slot_at += tl.sum(keep.to(tl.int64), 0)


def batch_top_k(
    rows: Tensor,
    n: int,
    out: Tensor | None = None,
    *,
    tile: tuple[int, int, int, int] | None = None,
    force_exact: bool = False,
    rows_per_program: int = ROWS_PER_PROGRAM,
) -> Tensor:
    """Ascending flat indices ``[n]`` (int64) of the ``n`` largest entries of ``rows [B, d_sae]``: ties at the
    threshold to the lowest flat index, NaN the largest. The per-token kernel keeps ``R``
    (`topk_select.keep_per_row`) per row; ``tile`` and ``force_exact`` go to it (see `row_top_k`); ``out``: the
    buffer to write; ``rows_per_program``: the rows of each program of the passes after it (a power of 2; the
    tests take a few, so that several programs add to the histograms)."""
    n_rows, n_cols = rows.shape
    r = min(2 * -(-n // n_rows), n_cols)  # `topk_select.keep_per_row`
    if out is None:
        out = torch.empty(n, dtype=torch.int64, device=rows.device)
    bits, key_bits, inf_bits = _format(rows)
    state = torch.zeros(8 + 256, dtype=torch.int64, device=rows.device)  # 8 words of state, then the histogram
    kept = torch.empty(n_rows, r, dtype=torch.int64, device=rows.device)
    vkey = torch.empty(n_rows, dtype=torch.int64, device=rows.device)
    _launch_rows(rows, r, kept, tile=tile, force_exact=force_exact, batch=(vkey, state, n))
    grid = (triton.cdiv(n_rows, rows_per_program),)
    common = dict(KEY_BITS=key_bits, INF_BITS=inf_bits, RP=triton.next_power_of_2(r), ROWS=rows_per_program, G=1024)
    for round_ in (1, 2):
        for shift in range(key_bits - 8, -1, -8):
            if round_ == 1 and shift == key_bits - 8:
                continue  # the per-token kernel's last program chose it
            _batch_digit_kernel[grid](
                bits,
                bits.stride(0),
                n_rows,
                n_cols,
                kept,
                r,
                vkey,
                state,
                state[8:],
                n,
                ROUND=round_,
                SHIFT=shift,
                **common,
            )
    counts = torch.zeros(2, n_rows, dtype=torch.int64, device=rows.device)
    args = (bits, bits.stride(0), n_rows, n_cols, kept, r, vkey, state, counts)
    _batch_count_kernel[grid](*args, **common)
    _batch_write_kernel[grid](*args, out, **common)
    return out
