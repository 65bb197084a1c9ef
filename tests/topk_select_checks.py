"""Shared checks of the top-k selection kernels (`sae_pipeline/sae/triton_topk.py`) against `torch.topk` and the
stated rule (ties at the threshold to the lowest index, -0 equal to +0, NaN the largest): on the CPU under the
Triton interpreter (`tests/test_topk_select.py`) and on CUDA (`tests/test_gpu_topk_select.py`).

``rule_rows`` / ``rule_flat`` are the rule written out in float64 (a stable sort); ``check_rows`` /
``check_flat`` compare a selection with it exactly, and with `torch.topk`: the same kept values always, the
same indices where no tie straddles the threshold.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

Select = Callable[[Tensor, int], Tensor]


def rule_order(values: Tensor) -> Tensor:
    """Per row (last dimension), the indices in the rule's order: NaN first, then by value descending (-0 and
    +0 equal), equal values by index ascending."""
    v = values.detach().cpu().double()
    nan = torch.isnan(v)
    order = torch.sort(-torch.where(nan, 0.0, v) + 0.0, dim=-1, stable=True).indices  # + 0.0: -0 -> +0
    first = torch.sort((~nan).gather(-1, order).to(torch.int8), dim=-1, stable=True).indices
    return order.gather(-1, first)


def rule_rows(values: Tensor, k: int) -> Tensor:
    """The stated per-row top ``k``: each row's indices ascending."""
    return rule_order(values)[..., :k].sort(dim=-1).values


def rule_flat(values: Tensor, n: int) -> Tensor:
    """The stated batch top ``n`` over the flattened values (flat indices ascending)."""
    return rule_order(values.reshape(-1))[:n].sort().values


def _same_values(a: Tensor, b: Tensor, name: str) -> None:
    torch.testing.assert_close(a.sort(dim=-1).values, b.sort(dim=-1).values, rtol=0, atol=0, equal_nan=True, msg=name)


def check_rows(got: Tensor, values: Tensor, k: int, name: str) -> bool:
    """One per-row selection: the rule's indices exactly, and `torch.topk`'s kept values; its indices too where
    no tie straddles the threshold. Returns whether a tie straddled it in some row."""
    values = values.detach().cpu()
    got = got.cpu()
    assert got.dtype == torch.int64 and got.shape == (*values.shape[:-1], k), (name, got.shape)
    assert torch.equal(got, rule_rows(values, k)), name
    today = values.topk(k, dim=-1, sorted=False).indices
    _same_values(values.gather(-1, got), values.gather(-1, today), name)
    straddled = False
    for row in range(values.shape[0]):
        if torch.equal(got[row], today[row].sort().values):
            continue
        kept = values[row][today[row]]
        kth = torch.where(torch.isnan(kept), float("inf"), kept).min()  # a NaN threshold only if all kept are NaN
        ties = values[row] == kth if not torch.isnan(kept).all() else torch.isnan(values[row])
        assert int(ties.sum()) > int(ties[today[row]].sum()), f"{name}: row {row} differs without a straddling tie"
        straddled = True
    return straddled


def check_flat(got: Tensor, values: Tensor, n: int, name: str) -> bool:
    """One batch selection (flat indices): the rule's exactly, and `torch.topk`'s kept values over the flattened
    values; its indices too where no tie straddles the threshold. Returns whether one did."""
    flat = values.detach().cpu().reshape(-1)
    got = got.cpu()
    assert got.dtype == torch.int64 and got.shape == (n,), (name, got.shape)
    assert torch.equal(got, rule_flat(flat, n)), name
    today = flat.topk(n, sorted=False).indices
    _same_values(flat[got], flat[today], name)
    if torch.equal(got, today.sort().values):
        return False
    kept = flat[today]
    kth = torch.where(torch.isnan(kept), float("inf"), kept).min()
    ties = flat == kth if not torch.isnan(kept).all() else torch.isnan(flat)
    assert int(ties.sum()) > int(ties[today].sum()), f"{name}: differs without a straddling tie"
    return True


def row_cases(batch: int, d_sae: int, k: int, dtype: torch.dtype, seed: int) -> Iterator[tuple[str, Tensor, int]]:
    """``[B, d_sae]`` values and the ``k`` to keep per row: random, deliberate ties, -inf (AuxK's masks), NaN,
    signed zeros, constant rows; and k at its edges."""
    g = torch.Generator().manual_seed(seed)
    plain = torch.randn(batch, d_sae, generator=g, dtype=torch.float64).to(dtype)
    yield "random", plain, k
    yield "k=1", plain, 1
    yield "k=d_sae-1", plain, d_sae - 1
    coarse = torch.randint(-3, 4, (batch, d_sae), generator=g).to(dtype)  # 7 values: ties at every threshold
    yield "coarse", coarse, k
    top = plain.double().topk(k, dim=1).indices
    ties = plain.clone()
    ties.scatter_(1, top[:, 1:], ties.gather(1, top[:, 1:2]).expand(-1, k - 1))  # ties among the kept
    yield "ties inside", ties, k
    straddle = plain.clone()
    kth = straddle.gather(1, top[:, k - 2 : k - 1])
    spots = torch.rand(batch, d_sae, generator=g) < 3 * k / d_sae
    yield "ties across the threshold", torch.where(spots, kth, straddle), k
    masked = torch.where(torch.rand(batch, d_sae, generator=g) < 0.9, float("-inf"), plain.double()).to(dtype)
    masked[0, k // 2 :] = float("-inf")  # fewer than k finite: -inf ties at the threshold
    masked[1] = float("-inf")
    yield "-inf", masked, k
    nan = plain.clone()
    nan[0, 3] = float("nan")
    nan[1, ::2] = float("nan")  # more NaNs than k: NaN ties at the threshold
    nan[2, 5] = -float("nan")  # the sign bit set
    yield "nan", nan, k
    zeros = torch.zeros(batch, d_sae, dtype=dtype)
    zeros[:, ::3] = -0.0
    zeros[:, : k // 2] = 1.0  # the threshold is 0, -0 and +0 straddling it
    yield "signed zeros", zeros, k
    yield "constant", torch.full_like(plain, 2.5), k
    yield "negative", -plain.abs() - 1, k


def flat_cases(batch: int, d_sae: int, k: int, dtype: torch.dtype, seed: int) -> Iterator[tuple[str, Tensor, int]]:
    """``[B, d_sae]`` values and the ``n`` BatchTopK keeps (``B·k`` unless named)."""
    g = torch.Generator().manual_seed(seed)
    n = batch * k
    plain = torch.randn(batch, d_sae, generator=g, dtype=torch.float64).to(dtype)
    yield "random", plain, n
    yield "one", plain, 1
    yield "n not a multiple of B", plain, n + batch // 2 + 1
    top = plain.double().flatten().topk(n).indices
    straddle = plain.clone().flatten()
    straddle[torch.randperm(straddle.numel(), generator=g)[: 3 * k]] = straddle[top[n - 2]].clone()
    yield "ties across the threshold", straddle.view(batch, d_sae), n
    coarse = torch.randint(-3, 4, (batch, d_sae), generator=g).to(dtype)
    coarse.view(-1)[::5] = -0.0  # -0 and +0 are equal
    yield "coarse", coarse, n
    yield "constant", torch.full_like(plain, 2.5), n
    yield "negative", -plain.abs() - 1, n
    massive = plain.clone()
    massive[:2] += 100  # two tokens take every slot they can (a CLS / register token): those rows read whole
    yield "massive rows", massive, n
    nan = plain.clone()
    nan[-1, :4] = float("nan")
    yield "nan", nan, n
    masked = torch.where(torch.rand(batch, d_sae, generator=g) < 0.5, float("-inf"), plain.double()).to(dtype)
    yield "-inf", masked, n


#: Interpreter sizes: it runs every program instance in Python, so a case costs about rows × columns. 40 columns:
#: one whole chunk of the (16, 2) tile and a partial one, lanes of two or three values; one row per case but where
#: the case is about several rows (`row_cases`: -inf in rows 0-1, NaN in rows 0-2). Rows of signed zeros take
#: the exact path's counting passes (more than its 4·8 slots at or above the bound); NaN rows, cut to 24 columns,
#: gather theirs.
ROW_SHAPE, ROW_TILE, ROWS_OF_CASE = (3, 40, 5), (16, 2, 1, 1), {"-inf": [0, 1], "nan": [0, 1, 2]}
COLUMNS_OF_CASE = {"nan": 24}
#: float16 differs from bfloat16 only in where +inf and NaN lie: its cases are those about them (NaN: of either
#: sign; the ties of many NaNs, row 1, are bfloat16's and float32's).
HALF_CASES = {"-inf": [0, 1], "nan": [0, 2]}
#: Three rows (two of them massive in `flat_cases`), two per program of the batch passes: two programs add up.
FLAT_SHAPE, FLAT_ROWS_PER_PROGRAM = (3, 40, 2), 2
#: float32's batch cases: its four digits in both rounds (massive rows), NaN's key and ties of -0, +0 and negatives.
WIDE_FLAT_CASES = ("coarse", "massive rows", "nan")


def three_in_a_lane(values: Tensor, lanes: int) -> Tensor:
    """``values`` with row 0's three largest in columns 0, ``lanes`` and ``2·lanes``: one lane of the per-token
    kernel meets three of its top k, so its two candidates miss one and the row takes the exact path from a bound
    (random rows this small rarely do)."""
    crowded = values.double().clone()
    crowded[0, [0, lanes, 2 * lanes]] = crowded[0].max() + torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64)
    return crowded.to(values.dtype)


def interpreted_checks() -> list[str]:
    """Every case on CPU tensors (for a process started with ``TRITON_INTERPRET=1``), the launches guarded
    against host reads and their outputs poisoned; returns the names of the cases run."""
    from sae_pipeline.sae import triton_batch_topk, triton_topk
    from sae_pipeline.training.sync_guard import HostSyncCounter

    done = []
    fallbacks = torch.zeros(1, dtype=torch.int32)  # the rows that took the exact path
    rows_run = exact_before = 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        straddled = 0
        cases = list(row_cases(*ROW_SHAPE, dtype, seed=1))
        if dtype != torch.float16:
            cases.append(("three in a lane", three_in_a_lane(cases[0][1][:1], ROW_TILE[0]), ROW_SHAPE[2]))
        for name, values, k in cases:
            if dtype == torch.float16 and name not in HALF_CASES:
                continue
            rows = (HALF_CASES if dtype == torch.float16 else ROWS_OF_CASE).get(name, [0])
            values = values[rows, : COLUMNS_OF_CASE.get(name, ROW_SHAPE[1])]
            with HostSyncCounter(raise_on_sync=True):
                got = triton_topk.row_top_k(
                    values, k, out=torch.full((values.shape[0], k), -1), tile=ROW_TILE, fallbacks=fallbacks
                )
            straddled += check_rows(got, values, k, f"{name} {dtype}")
            if name == "three in a lane":
                assert int(fallbacks) == exact_before + 1, f"{dtype}: the crowded lane's row must take the exact path"
            exact_before = int(fallbacks)
            rows_run += values.shape[0]
            done.append(f"rows-{name.replace(' ', '-')}-{dtype}")
        assert straddled >= (1 if dtype == torch.float16 else 3), f"{dtype}: the cases must put ties at the threshold"
    assert 0 < int(fallbacks) < rows_run, f"both paths must run ({int(fallbacks)} of {rows_run} rows exact)"
    for dtype in (torch.float32, torch.bfloat16):  # 32- and 16-bit keys; by counting passes, ties at the threshold
        values = dict((name, v) for name, v, _ in row_cases(*ROW_SHAPE, dtype, seed=2))["coarse"][:1]
        got = triton_topk.row_top_k(values, 5, tile=(32, 1, 1, 2), force_exact=True)
        check_rows(got, values, 5, f"forced exact {dtype}")
        done.append(f"rows-forced-exact-{dtype}")
    batch, d_sae, k = FLAT_SHAPE
    for dtype in (torch.float32, torch.bfloat16):
        cases = list(flat_cases(batch, d_sae, k, dtype, seed=3))
        if dtype == torch.bfloat16:
            cases.append(("three in a lane", three_in_a_lane(cases[0][1], ROW_TILE[0]), cases[0][2]))
        for name, values, n in cases:
            if dtype == torch.float32 and name not in WIDE_FLAT_CASES:
                continue
            with HostSyncCounter(raise_on_sync=True):
                got = triton_batch_topk.batch_top_k(
                    values, n, out=torch.full((n,), -1), tile=ROW_TILE, rows_per_program=FLAT_ROWS_PER_PROGRAM
                )
            check_flat(got, values, n, f"{name} {dtype}")
            done.append(f"flat-{name.replace(' ', '-')}-{dtype}")
    # the default tile (k 32: G 512, four chunks a step, the row in its partial step), several whole steps of a
    # small tile, a row over 65 536 columns (composites of 64 bits)
    values = torch.randn(1, 1500, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    check_rows(triton_topk.row_top_k(values, 32), values, 32, "default tile")
    check_rows(triton_topk.row_top_k(values, 7, tile=(64, 4, 1, 2)), values, 7, "several chunks")
    wide = torch.randn(1, 65_600, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    check_rows(triton_topk.row_top_k(wide, 1), wide, 1, "65 600 columns")
    done += ["rows-default-tile", "rows-several-chunks", "rows-65600-columns"]
    return done


def cpu_applies(values: Tensor, k: int) -> bool:
    """`topk_select.applies` without its CUDA condition: the kernels on CPU tensors (under the interpreter)."""
    from sae_pipeline.sae import topk_select

    return (
        values.dtype in topk_select.KEYED_DTYPES
        and values.numel() > 0
        and values.stride(-1) == 1
        and 1 <= k <= topk_select.MAX_K
        and k < values.shape[-1]
    )


def sae_step(sae: Any, x: Tensor, sparse: bool) -> dict[str, Tensor]:
    """One forward, loss and backward: the reconstruction, every loss term and every gradient."""
    sae.sparse_max_density = 1.0 if sparse else 0.0
    out = sae(x)
    assert (out.sparse is not None) == sparse
    loss = sae.loss(x, out)
    loss.loss.backward()
    found = {"x_hat": out.x_hat.detach(), **{name: t.detach() for name, t in loss.terms.items()}}
    return found | {f"grad {name}": p.grad for name, p in sae.named_parameters()}


def sae_checks(kernels: bool) -> dict[str, dict[str, Tensor]]:
    """TopK, BatchTopK and Matryoshka's training step, sparse and dense, with AuxK over some dead latents (its
    picks a top-k over the planned slots), with the kernels (``kernels``: `topk_select.applies` patched to take
    CPU tensors) or with `torch.topk`: ``{case: sae_step's tensors}``."""
    import copy

    from sae_pipeline.sae import BatchTopKSAE, MatryoshkaBatchTopKSAE, TopKSAE, topk_select

    topk_select.applies = cpu_applies if kernels else (lambda values, k: False)
    found = {}
    for cls in (TopKSAE, BatchTopKSAE, MatryoshkaBatchTopKSAE):
        torch.manual_seed(0)
        template = cls(16, 96, k=4, k_aux=6, dead_after_tokens=10)
        with torch.no_grad():
            template.b_enc.copy_(0.1 * torch.randn_like(template.b_enc))
        template.tokens_since_fired[::9] = template.dead_after_tokens  # 11 dead latents: AuxK picks 6 of them
        x = torch.randn(2, 16, generator=torch.Generator().manual_seed(1))  # two tokens: the interpreter's cost
        for sparse in (True, False):
            found[f"{cls.key} {'sparse' if sparse else 'dense'}"] = sae_step(copy.deepcopy(template), x, sparse)
    return found


def interpreted_sae_checks() -> list[str]:
    """Each SAE's step through the kernels equals its step through `torch.topk` (random float32 values: no ties;
    the order of the entries differs, so sums agree to rounding)."""
    with_kernels, without = sae_checks(True), sae_checks(False)
    for case, tensors in with_kernels.items():
        for name, tensor in tensors.items():
            torch.testing.assert_close(tensor, without[case][name], rtol=1e-5, atol=1e-6, msg=f"{case}: {name}")
    return [f"sae-{case.replace(' ', '-')}" for case in with_kernels]


if __name__ == "__main__":
    print("checked:", " ".join([*interpreted_checks(), *interpreted_sae_checks()]))
