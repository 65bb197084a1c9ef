"""`features --replicas`: in how many seeds of the same setting each atom is found again ("found in 2 of 3 seeds").

Why: an atom that one seed learns and the others do not is a property of that run, not of the variant or the
data, and a reader of its page should know which kind it is. The browsed SAE's dictionary is matched one to
one with each replica's by |cosine| of decoder rows (`sae_pipeline.metrics.dictionary_match`, the matching of
the study report's stability section); an atom is found in a replica when its partner's |cosine| reaches
`THRESHOLD`, and `found_in` counts the SAEs it is found in, itself included (1 ..= N, N = 1 + replicas).

A replica is given as the browsed SAE is: an export folder (ours or SAELens's), a `fit` checkpoint (a group's
member as `FILE.ckpt:NAME`) or a run folder (its newest checkpoint). It must be the same variant with the same
`d_in` and `d_sae` (a seed replica of the same setting), and not the browsed dictionary itself. Read as data:
safetensors, `torch.load(weights_only=True)`, the SAE class resolved, never imported.
"""

from __future__ import annotations

import dataclasses
import html
from pathlib import Path
from typing import Any

import numpy as np

from sae_pipeline.metrics.dictionary_match import DENSE_MAX_CELLS, THRESHOLD, matched_cosines

FLAG = "--replicas"
INDEX_COLUMNS = ["found_in", "replica_cosine"]


@dataclasses.dataclass
class ReplicaMatch:
    """Per atom: in how many of the N SAEs it is found (``found_in [d_sae]``) and its partner's |cosine| in each
    replica (``cosine [d_sae, R]``), the replicas as given."""

    sources: list[str]
    found_in: np.ndarray
    cosine: np.ndarray

    @property
    def n(self) -> int:
        return 1 + len(self.sources)

    def arrays(self) -> dict[str, np.ndarray]:
        """``features.npz``'s arrays."""
        return {"found_in": self.found_in, "replica_cosine": self.cosine}

    def summary(self) -> dict[str, Any]:
        """``features.json``'s ``replicas``."""
        d_sae = len(self.found_in)
        return {
            "replicas": self.sources,
            "n_seeds": self.n,
            "threshold": THRESHOLD,
            "matching": "dense Hungarian" if d_sae * d_sae <= DENSE_MAX_CELLS else "candidates, certified by duals",
            "found_in_counts": {str(j): int((self.found_in == j).sum()) for j in range(1, self.n + 1)},
        }

    def stat(self, atom: int) -> tuple[str, str, str]:
        """The atom page's line: found in j of N seeds, with the partners' |cosine| and the rule."""
        cosines = ", ".join(f"{c:.3f}" for c in self.cosine[atom])
        return (
            "found in",
            f"{int(self.found_in[atom])} of {self.n} seeds",
            f"partner |cos| per replica {cosines}; found where ≥ {THRESHOLD} (one-to-one matching), itself counted",
        )

    def index_cells(self, atom: int) -> list:
        return [int(self.found_in[atom]), [round(float(c), 3) for c in self.cosine[atom]]]


def index_cells(match: ReplicaMatch | None, atom: int) -> list:
    """The index row's cells (`INDEX_COLUMNS`; none without replicas)."""
    return match.index_cells(atom) if match else []


def index_headers(match: ReplicaMatch | None) -> list[str]:
    if match is None:
        return []
    title = html.escape(
        f"in how many of the {match.n} seeds' SAEs the atom is found (partner |cos| ≥ {THRESHOLD}), itself counted"
    )
    return [f'<th data-key="found_in" title="{title}">found in (of {match.n} seeds)</th>']


def page_stats(match: ReplicaMatch | None, atom: int) -> list[tuple[str, str, str]]:
    return [match.stat(atom)] if match else []


def load_replicas(specs: list[str] | None, sae: Any) -> list[np.ndarray]:
    """Each replica's decoder ``[d_sae, d_in]`` (float64), checked against the browsed ``sae``: one ValueError
    naming the replica and the fix for anything else."""
    if not specs:
        return []
    mine = sae.W_dec.detach().double().cpu().numpy()
    decoders: list[np.ndarray] = []
    for spec in specs:
        replica = _load(spec)
        where = f"{FLAG} {spec}"
        if type(replica).__name__ != type(sae).__name__:
            raise ValueError(
                f"{where}: a {type(replica).__name__}, but the browsed SAE is a {type(sae).__name__}; pass other "
                "seeds of the same variant and setting"
            )
        if (replica.d_in, replica.d_sae) != (sae.d_in, sae.d_sae):
            raise ValueError(
                f"{where}: d_in {replica.d_in}, d_sae {replica.d_sae}, but the browsed SAE has d_in {sae.d_in}, "
                f"d_sae {sae.d_sae}; pass other seeds of the same setting"
            )
        w = replica.W_dec.detach().double().cpu().numpy()
        if not np.isfinite(w).all():
            raise ValueError(f"{where}: its decoder holds NaN or Inf (a diverged run); pass another seed's SAE")
        if np.array_equal(w, mine) or any(np.array_equal(w, other) for other in decoders):
            what = "the browsed SAE itself" if np.array_equal(w, mine) else "given twice"
            raise ValueError(f"{where}: {what} (the same dictionary); pass each other seed's SAE once")
        decoders.append(w)
    return decoders


def _load(spec: str) -> Any:
    """The SAE ``spec`` names: an export folder, a run folder (its newest checkpoint), a checkpoint file, or a
    group checkpoint's member ``FILE:NAME``."""
    from sae_pipeline.artifacts import load_sae
    from sae_pipeline.artifacts.checkpoint import read_checkpoint, sae_from_checkpoint, select_member
    from sae_pipeline.artifacts.export_files import CONFIG_FNAME, SAELENS_CFG_FNAME
    from sae_pipeline.training.checkpointing import newest_checkpoint

    path, name = Path(spec), None
    if not path.exists() and ":" in spec and Path(spec.rsplit(":", 1)[0]).is_file():
        path, name = Path(spec.rsplit(":", 1)[0]), spec.rsplit(":", 1)[1]
    if path.is_dir() and not any((path / f).is_file() for f in (CONFIG_FNAME, SAELENS_CFG_FNAME)):
        found = newest_checkpoint([path])
        if found is not None:
            path = found
    if path.is_dir():
        try:
            return load_sae(path)
        except ValueError as exn:
            raise ValueError(f"{FLAG} {exn}") from None
    if not path.exists():
        raise ValueError(
            f"{FLAG} {spec}: not found; pass the other seeds' SAEs: export folders, `fit` checkpoints "
            "(FILE.ckpt, a group's member as FILE.ckpt:NAME) or run folders"
        )
    checkpoint = read_checkpoint(path, flag=FLAG)
    where = f"{FLAG} {path}"
    members = list(checkpoint["sae_group"]) if "sae_group" in checkpoint else []
    if name is not None and name not in members:
        said = f"has no member {name!r} ({', '.join(members)})" if members else "holds one SAE, not a group"
        raise ValueError(f"{where}: {said}; pass FILE.ckpt for one SAE, FILE.ckpt:NAME for a group's member")
    if members and name is None:
        raise ValueError(f"{where}: holds a group of SAEs; pass the member as {path}:NAME ({', '.join(members)})")
    if name is not None:
        checkpoint = select_member(checkpoint, name, where)
    return sae_from_checkpoint(checkpoint, where)


def match_replicas(sae: Any, decoders: list[np.ndarray], sources: list[str]) -> ReplicaMatch:
    """`ReplicaMatch` of the browsed ``sae`` against the replicas' decoders (rank 0, after the pass)."""
    from sae_pipeline.training.interrupts import raise_if_interrupted

    mine = sae.W_dec.detach().double().cpu().numpy()
    cosine = np.zeros((len(mine), len(decoders)))
    for r, w in enumerate(decoders):
        raise_if_interrupted()
        cosine[:, r] = matched_cosines(mine, w, device=sae.W_dec.device)  # large ones: the products on its device
    found_in = 1 + (cosine >= THRESHOLD).sum(1).astype(np.int64)
    return ReplicaMatch(list(sources), found_in, cosine)
