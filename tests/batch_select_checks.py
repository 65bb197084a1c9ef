"""Shared checks of BatchTopK's threshold search (`sae_pipeline/sae/batch_select.py`) against today's
selection (`torch.topk` over the flattened batch) and its stated tie rule: on the CPU under the Triton
interpreter (`tests/test_triton_sparse.py`) and on CUDA (`tests/test_gpu_sparse_kernels.py`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor

Select = Callable[[Tensor, int], Tensor]


def rule(values: Tensor, n: int) -> Tensor:
    """The stated support, in float64: every entry above the n-th largest value, then the entries equal to
    it in flat order until n are kept; sorted."""
    v = values.double()
    kth = v.topk(n).values[-1]
    above = (v > kth).nonzero().squeeze(1)
    equal = (v == kth).nonzero().squeeze(1)
    return torch.cat([above, equal[: n - above.numel()]]).sort().values


def check_selection(select: Select, values: Tensor, n: int, name: str) -> bool:
    """Checks one selection; returns whether ties straddled the threshold (the case where the CPU's `topk`
    and the rule may keep different copies of the tied value)."""
    got = select(values, n)
    assert got.shape == (n,) and torch.equal(got, rule(values, n)), name
    today = values.topk(n, sorted=False).indices  # BatchTopK's selection before the threshold search
    kth = values[today].min()
    if int((values == kth).sum()) == int((values[today] == kth).sum()):  # no tie straddles the threshold
        assert torch.equal(got, today.sort().values), name
        return False
    else:  # the same kept values, the ties settled by the rule
        assert torch.equal(values[got].sort().values, values[today].sort().values), name
        assert torch.equal((values[got] > kth).sum(), (values[today] > kth).sum()), name
        return True


def cases(batch: int, d_sae: int, k: int, dtype: torch.dtype, seed: int) -> Iterator[tuple[str, Tensor, int]]:
    """Random ``[B·d_sae]`` values with and without deliberate ties, and the ``n`` to keep."""
    g = torch.Generator().manual_seed(seed)
    n = batch * k
    plain = torch.randn(batch * d_sae, generator=g, dtype=torch.float64).to(dtype)
    yield "random", plain, n
    yield "one", plain, 1
    yield "all", plain, plain.numel()
    top = plain.double().topk(n).indices
    ties_inside = plain.clone()
    ties_inside[top[1 : n // 2]] = ties_inside[top[1]].clone()  # ties among the kept, above the threshold
    yield "ties inside", ties_inside, n
    ties_at = plain.clone()
    ties_at[top[n // 2 :]] = ties_at[top[n // 2]].clone()  # the threshold tied, all its copies kept
    yield "ties at the threshold", ties_at, n
    straddle = plain.clone()
    straddle[torch.randperm(straddle.numel(), generator=g)[: 3 * k]] = straddle[top[n - 2]].clone()  # across it
    yield "ties across the threshold", straddle, n
    coarse = torch.randint(-3, 4, (batch * d_sae,), generator=g).to(dtype)  # 7 values: ties everywhere
    coarse[::5] = -0.0  # -0 and +0 are equal
    yield "coarse", coarse, n
    yield "constant", torch.full_like(plain, 2.5), n
    yield "negative", -plain.abs() - 1, n
    for name, values, count in [("massive rows", plain.clone(), n)]:
        values.view(batch, d_sae)[:2] += 100  # two tokens take every slot they can (a CLS / register token)
        yield name, values, count


def interpreted_selection_checks(batch: int = 16, d_sae: int = 64, k: int = 4) -> list[str]:
    """Every case on CPU tensors (in a process started with ``TRITON_INTERPRET=1``), the search guarded
    against host reads; returns the names of the cases run."""
    from sae_pipeline.sae import batch_select
    from sae_pipeline.training.sync_guard import HostSyncCounter

    def guarded(values: Tensor, n: int) -> Tensor:
        with HostSyncCounter(raise_on_sync=True):
            return batch_select.radix_top_indices(values, n, out=torch.full((n,), -1))  # poisoned

    done = []
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        straddled = 0
        for name, values, n in cases(batch, d_sae, k, dtype, seed=3):
            if dtype == torch.bfloat16 and name not in ("random", "ties across the threshold", "coarse"):
                continue  # the key's low half is what bfloat16 differs in; the rest is float32's code
            straddled += check_selection(guarded, values, n, f"{name} {dtype}")
            done.append(f"select-{name.replace(' ', '-')}-{dtype}")
        assert straddled >= 2, f"{dtype}: the cases must put ties across the threshold"
    for dtype in (torch.float32, torch.bfloat16):  # several programs (8192 values each): the scan across them
        for name, values, n in cases(40, 640, 32, dtype, seed=5):
            if name in ("random", "ties across the threshold", "coarse", "massive rows"):
                check_selection(guarded, values, n, f"{name} {dtype} 25600")
                done.append(f"select-{name.replace(' ', '-')}-{dtype}-25600")
    return done
