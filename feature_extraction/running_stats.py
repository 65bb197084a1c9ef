"""Normalisation statistics of token activations, summed while shards are written.

Each shard's sidecar carries float64 running sums, so ``write_manifest`` gets the
per-dimension mean (``b_pre``) and E‖x‖² (the input scale) of 0.5 TB of tokens by merging
a few hundred small JSON records instead of re-reading the shards.
"""

from __future__ import annotations

import numpy as np

from feature_extraction.file_checks import COUNT, NUMBER, list_of, shown
from feature_extraction.validate import check_int

__all__ = ["RunningStats"]


class RunningStats:
    """Per-dimension float64 sums of tokens, mergeable across shards and tasks.

    ``mean_sq_norm`` is E‖x‖² (not centred); the centred value is
    ``mean_sq_norm() - ‖mean()‖²``. ``d == 0`` means "no tokens seen yet" (an empty shard)
    and merges with any ``d``.
    """

    def __init__(self, d: int, n_tokens: int = 0, sum: np.ndarray | None = None, sum_sq_norm: float = 0.0) -> None:
        check_int("RunningStats d", d, 0)
        self.d = int(d)
        self.n_tokens = int(n_tokens)
        self.sum = np.zeros(self.d, np.float64) if sum is None else np.asarray(sum, np.float64).copy()
        if self.sum.shape != (self.d,):
            raise ValueError(f"RunningStats sum must have shape [{self.d}], got {list(self.sum.shape)}")
        self.sum_sq_norm = float(sum_sq_norm)

    def update(self, tokens: np.ndarray) -> None:
        """Add tokens ``[n, d]`` (any float dtype; summed in float64)."""
        if tokens.ndim != 2 or tokens.shape[1] != self.d:
            raise ValueError(f"RunningStats.update expects tokens [n, {self.d}], got {list(tokens.shape)}")
        x = tokens.astype(np.float64, copy=False)
        self.sum += x.sum(axis=0)
        self.sum_sq_norm += float(np.einsum("nd,nd->", x, x))
        self.n_tokens += x.shape[0]

    def merge(self, other: RunningStats) -> RunningStats:
        """Return the statistics of both token sets (neither input is changed)."""
        if self.d == 0 and self.n_tokens == 0:
            return RunningStats(other.d, other.n_tokens, other.sum, other.sum_sq_norm)
        if other.d == 0 and other.n_tokens == 0:
            return RunningStats(self.d, self.n_tokens, self.sum, self.sum_sq_norm)
        if other.d != self.d:
            raise ValueError(f"cannot merge RunningStats with d={self.d} and d={other.d}")
        return RunningStats(
            self.d, self.n_tokens + other.n_tokens, self.sum + other.sum, self.sum_sq_norm + other.sum_sq_norm
        )

    def mean(self) -> np.ndarray:
        """Per-dimension mean ``[d]`` (float64), e.g. to initialise ``b_pre``."""
        if self.n_tokens == 0:
            raise ValueError("RunningStats.mean: no tokens were added")
        return self.sum / self.n_tokens

    def mean_sq_norm(self) -> float:
        """E‖x‖² over all tokens, used to rescale inputs to a fixed norm."""
        if self.n_tokens == 0:
            raise ValueError("RunningStats.mean_sq_norm: no tokens were added")
        return self.sum_sq_norm / self.n_tokens

    def to_json(self) -> dict:
        """JSON-safe dict; Python floats round-trip float64 exactly."""
        return {"d": self.d, "n_tokens": self.n_tokens, "sum": self.sum.tolist(), "sum_sq_norm": self.sum_sq_norm}

    @classmethod
    def from_json(cls, d: dict) -> RunningStats:
        """Inverse of ``to_json``; a ValueError for anything else (a sidecar is read from disk: the types are
        checked before ``d`` sizes any array, so a forged ``d`` of 10¹² allocates nothing)."""
        fields = {"d": COUNT, "n_tokens": COUNT, "sum": list_of(NUMBER), "sum_sq_norm": NUMBER}
        problem = "must be a JSON object" if not isinstance(d, dict) else None
        for name, kind in fields.items() if problem is None else ():
            if name not in d or not kind.test(d[name]):
                problem = f"needs {name} as {kind.text}, got {shown(d.get(name))}"
                break
        if problem is None and len(d["sum"]) != d["d"]:
            problem = f"has {len(d['sum'])} sums for d = {d['d']}"
        if problem is not None:
            raise ValueError(f"RunningStats json {problem}")
        return cls(d["d"], d["n_tokens"], np.asarray(d["sum"], np.float64), float(d["sum_sq_norm"]))
