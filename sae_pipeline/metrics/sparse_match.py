"""The matching of `sae_pipeline.metrics.dictionary_match` for large dictionaries: the dense optimum, certified,
without the dense matrix.

Why: the dense Hungarian needs the `d_a x d_b` float64 |cosine| matrix (19 200 atoms: 2.9 GB, 5.8 GiB with the
solver's work) and about d³ time; the feature browser's dictionaries reach 19 200 atoms and more.

How: each row keeps its `CANDIDATES` largest |cosine| and each column its best rows, computed in blocks of float32
rows (on ``device``), so no `d_a x d_b` matrix is ever held. Every row also gets a dummy partner of |cosine| 0,
so a full matching always exists (a row left without a real partner). LAPJVsp
(`scipy.sparse.csgraph.min_weight_full_bipartite_matching`, cost 2 - |cosine|) solves that graph exactly; its
LP duals (`_duals`) then certify it against every pair left out: a pair can only improve the matching if its
cost is below the sum of its row's and its column's duals. Each left-out pair's |cosine| is bounded by its row's and its
column's m-th best, so only the rows whose bound reaches the duals are scanned again (in blocks, against every
column); pairs that beat the duals (or come within `SLACK`) join the graph and it is solved again, until none
does. The result is then the dense optimum (tests/test_dictionary_match.py: equal to `match_cosines`'s sums and
found-again decisions on random dictionaries with near-duplicate families and replaced atoms, few candidates).

When it can differ from the dense solver: between optima of equal sum (ties, either is optimal), and where two
pairs' |cosine| differ by less than float32 rounding (about 1e-7, `TOLERANCE`); the cosines returned are float64.
Its time and memory against the dense solver: BENCHMARKS.md, "Matching seed replicas"
(`python -m benchmarks.dictionary_match`).
"""

from __future__ import annotations

import numpy as np
import torch

#: Candidates per atom (each way), and rows per block of the products.
CANDIDATES, BLOCK = 32, 2048
#: How far (in |cosine|, float32) a pair may beat the duals before it joins the candidate graph.
TOLERANCE = 1e-6
#: Pairs within this of violating the duals join the graph too (they would likely violate the next round's).
SLACK = 0.02


def unit_rows(w: np.ndarray) -> np.ndarray:
    w = np.asarray(w, np.float64)
    return w / np.maximum(np.linalg.norm(w, axis=1, keepdims=True), 1e-12)


def _candidates(a: torch.Tensor, b: torch.Tensor, m: int) -> tuple[np.ndarray, ...]:
    """``(rows, cols, |cosine|)`` of each row of ``a``'s ``m`` largest |cosine| in ``b`` and each row of ``b``'s in
    ``a`` (unit rows), pairs possibly repeated, and the bounds of the pairs left out: each row's and each column's
    m-th largest |cosine| (-1 where none is left out). One product in blocks of ``a``'s rows serves both ways
    (``b``'s best so far kept as ``[m, n_b]`` and merged with each block's)."""
    m_ab, m_ba = min(m, len(b)), min(m, len(a))
    rows, cols, cosines, row_floor = [], [], [], []
    best_value = torch.full((m_ba, len(b)), -1.0, device=b.device)
    best_row = torch.zeros((m_ba, len(b)), dtype=torch.long, device=b.device)
    for start in range(0, len(a), BLOCK):
        sims = (a[start : start + BLOCK] @ b.T).abs_()
        values, index = (t.cpu() for t in sims.topk(m_ab, dim=1))
        rows.append(np.repeat(np.arange(start, start + len(index)), m_ab))
        cols.append(index.reshape(-1).numpy())
        cosines.append(values.reshape(-1).numpy())
        row_floor.append(values[:, -1].numpy() if m_ab < len(b) else np.full(len(values), -1.0, np.float32))
        values, at = sims.T.topk(min(m_ba, len(sims)), dim=1)
        merged, pick = torch.cat([best_value, values.T]).topk(m_ba, dim=0)
        best_row = torch.cat([best_row, at.T + start]).gather(0, pick)
        best_value = merged
    best_value, best_row = best_value.cpu(), best_row.cpu()
    rows.append(best_row.reshape(-1).numpy())
    cols.append(np.tile(np.arange(len(b)), m_ba))
    cosines.append(best_value.reshape(-1).numpy())
    col_floor = best_value[-1].numpy() if m_ba < len(a) else np.full(len(b), -1.0, np.float32)
    return (*(np.concatenate(x) for x in (rows, cols, cosines, row_floor)), col_floor)


def _violations(
    a: torch.Tensor, b: torch.Tensor, u: np.ndarray, v: np.ndarray, m: int, which: np.ndarray
) -> tuple[np.ndarray, ...]:
    """``(rows, cols, |cosine|, excess)`` of the pairs of rows ``which`` whose cost ``2 - |cosine|`` is below
    ``u_i + v_j + SLACK`` (the duals of the candidate graph's optimum; excess > 0: the pair violates them), at
    most ``m`` per row, the largest excess first: one more pass of blocks over those rows and every column."""
    rows, cols, cosines, excesses = [], [], [], []
    bound = torch.from_numpy(2.0 - v).float().to(b.device)
    for start in range(0, len(which), BLOCK):
        chunk = which[start : start + BLOCK]
        sims = (a[torch.from_numpy(chunk).to(a.device)] @ b.T).abs_()
        excess = sims - (bound[None, :] - torch.from_numpy(u[chunk]).float().to(b.device)[:, None])
        values, index = excess.topk(min(m, len(b)), dim=1)
        cosine = sims.gather(1, index).cpu().numpy()
        values, index = values.cpu().numpy(), index.cpu().numpy()
        hit = values > -SLACK
        at_row, _ = np.nonzero(hit)
        rows.append(chunk[at_row])
        cols.append(index[hit])
        cosines.append(cosine[hit])
        excesses.append(values[hit])
    return tuple(np.concatenate(x) for x in (rows, cols, cosines, excesses))


def _duals(cost: np.ndarray, rows: np.ndarray, cols: np.ndarray, partner: np.ndarray, n_cols: int) -> tuple:
    """Row and column duals ``(u, v)`` of an optimal matching (``partner[i]``, every row matched) of the graph
    ``(rows, cols, cost)``: ``u_i + v_j <= cost_ij`` on every edge, equal on the matching, ``v <= 0``, 0 on free
    columns. With ``v = -d``, ``u_i = cost_i,partner + d_partner``, ``d`` is any solution of
    ``0 <= d_partner(i) <= d_j + cost_ij - cost_i,partner(i)``, ``d = 0`` on free columns: the largest (the
    shortest alternating paths from a free column) and the smallest (the least fixed point from 0) bound them all;
    the midpoint, feasible too, leaves fewer pairs outside the graph violating them (measured: fewer rounds than
    either end). Each by rounds of one vectorised pass over the edges (rounds: the longest path)."""
    key = rows * n_cols + cols
    matched_cost = cost[np.searchsorted(key, np.arange(len(partner)) * n_cols + partner)]  # key is sorted
    other = partner[rows] != cols
    src, dst = cols[other], partner[rows[other]]
    weight = cost[other] - matched_cost[rows[other]]
    high = np.full(n_cols, np.inf)
    high[np.setdiff1d(np.arange(n_cols), partner)] = 0.0
    low = np.zeros(n_cols)
    for d, relax in ((high, np.minimum), (low, np.maximum)):
        for _ in range(len(partner) + 1):
            new = d.copy()
            if relax is np.minimum:
                np.minimum.at(new, dst, d[src] + weight)
            else:
                np.maximum.at(new, src, d[dst] - weight)
            if np.array_equal(new, d):
                break
            d[:] = new
    d = (np.where(np.isfinite(high), high, low) + low) / 2  # (every partner is reachable: high is finite)
    return matched_cost + d[partner], -d


def match_cosines_sparse(
    w_a: np.ndarray, w_b: np.ndarray, m: int = CANDIDATES, device: str | torch.device = "cpu"
) -> np.ndarray:
    """|cosine| of each row of ``w_a`` with its partner in ``w_b`` under the one-to-one matching that maximises
    their sum (0 for a row left without one), as `sae_pipeline.metrics.dictionary_match.match_cosines`: from each
    atom's ``m`` best candidates both ways plus the pairs the duals ask for (the module docstring); the products
    on ``device``."""
    if len(w_a) > len(w_b):  # the smaller side is matched whole: solve from it, read back
        cosine_b, partner_b = _solve_sparse(w_b, w_a, m, device)
        matched = np.zeros(len(w_a))
        matched[partner_b[partner_b >= 0]] = cosine_b[partner_b >= 0]
        return matched
    return _solve_sparse(w_a, w_b, m, device)[0]


def _solve_sparse(w_a: np.ndarray, w_b: np.ndarray, m: int, device: str | torch.device) -> tuple[np.ndarray, ...]:
    """``(|cosine| of each row's partner, the partner's column or -1)`` for ``len(w_a) <= len(w_b)``: the rounds
    of `match_cosines_sparse` (the module docstring)."""
    from scipy.sparse import coo_array
    from scipy.sparse.csgraph import min_weight_full_bipartite_matching

    a64, b64 = unit_rows(w_a), unit_rows(w_b)
    n_a, n_b = len(a64), len(b64)
    if n_a == 0:
        return np.zeros(0), np.zeros(0, np.int64)
    a, b = torch.from_numpy(a64).float().to(device), torch.from_numpy(b64).float().to(device)
    rows, cols, cosine, row_floor, col_floor = _candidates(a, b, m)
    # every row also has its own dummy column n_b + i of |cosine| 0 (cost 2): a full matching always exists
    rows, cols = np.concatenate([rows, np.arange(n_a)]), np.concatenate([cols, n_b + np.arange(n_a)])
    cosine = np.concatenate([cosine, np.zeros(n_a, np.float32)])
    n_cols = n_b + n_a
    while True:
        key, first = np.unique(rows * n_cols + cols, return_index=True)  # a pair found twice: one edge
        rows, cols, cosine = key // n_cols, key % n_cols, cosine[first]
        cost = 2.0 - cosine.astype(np.float64)  # in [1, 2]: never 0 (LAPJVsp would drop an explicit zero)
        row_ind, col_ind = min_weight_full_bipartite_matching(coo_array((cost, (rows, cols)), (n_a, n_cols)).tocsr())
        partner = np.empty(n_a, np.int64)
        partner[row_ind] = col_ind
        u, v = _duals(cost, rows, cols, partner, n_cols)
        # a pair outside the graph is in neither top-m list: its |cosine| <= min(row_floor_i, col_floor_j), so
        # only rows where that bound can beat the duals need a pass over every column
        reach = np.minimum(row_floor + v[:n_b].max(), (col_floor + v[:n_b]).max())
        suspect = np.nonzero(reach + TOLERANCE > 2.0 - u)[0]
        if len(suspect) == 0:  # no pair outside the graph can beat the duals: the matching is the dense optimum
            break
        more_rows, more_cols, more_cosine, excess = _violations(a, b, u, v[:n_b], m, suspect)
        new = ~np.isin(more_rows * n_cols + more_cols, key)
        if not (excess[new] > TOLERANCE).any():  # the duals are feasible for every pair: the dense optimum
            break
        rows, cols = np.concatenate([rows, more_rows[new]]), np.concatenate([cols, more_cols[new]])
        cosine = np.concatenate([cosine, more_cosine[new]])
    matched = np.zeros(n_a)
    real = np.nonzero(partner < n_b)[0]
    matched[real] = _dots(a64, b64, real, partner[real])
    return matched, np.where(partner < n_b, partner, -1)


def _dots(a: np.ndarray, b: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """|⟨a_rows, b_cols⟩| pair by pair, float64, in chunks (no ``[pairs, d]`` copy of the whole list)."""
    out = np.empty(len(rows))
    for start in range(0, len(rows), 1 << 14):
        r, c = rows[start : start + (1 << 14)], cols[start : start + (1 << 14)]
        out[start : start + len(r)] = np.abs(np.einsum("ij,ij->i", a[r], b[c]))
    return out
