"""The paper's claims, checked against a study's measured numbers.

Each check returns ``{"id", "kind", "claim", "quote", "holds", "measured"}``:

- ``kind`` is ``"paper"`` for a finding of Costa et al. 2025 that the SAEs could contradict, or
  ``"implementation"`` for a property that holds by construction (MP-SAE's R² rising with the
  inference k is Proposition 2; ReLU's support cannot grow at inference). Implementation
  checks test our code, not the paper, and :func:`count_claims` leaves them out;
- ``quote`` is the paper's sentence the check tests (``QUOTES``);
- ``holds`` is True / False, or None when the study lacks what the claim needs.

How each claim is measured, so that the verdict comes from the SAEs and not from the yardstick:

- expressivity at **equal measured L0**: variants reach different L0 at the same requested k
  (ReLU has no k, JumpReLU only a penalty), so each shallow variant's R² is interpolated
  linearly in log L0 over its k sweep at MP-SAE's measured L0; a curve that does not span that
  L0 is reported as not reaching it and is left out of that comparison (never extrapolated);
- "plateau" and "keeps improving" use a stated tolerance, ``PLATEAU_TOLERANCE`` in R²;
- value statistics use the value **when active**, ``E[z_j | z_j ≠ 0]`` (the paper's sentences
  are about how strongly an atom contributes when used); ``E[z_j]`` with zeros counted, which
  is frequency × value-when-active, is reported beside it;
- co-active coherence is **controlled for support size**: the restricted Babel μ₁^S(r) over
  tokens with ``|S| ≥ r + 1`` (:mod:`.coherence`) at the largest r every variant supports,
  with mean ``|S|`` per variant reported.
"""

from __future__ import annotations

import math
from typing import Any

from sae_pipeline.sae import SAE_REGISTRY

# Read off the registry's class attributes, so a new variant joins the comparisons it belongs to.
SHALLOW = tuple(key for key, cls in SAE_REGISTRY.items() if not cls.is_pursuit)  # one encoder pass
# The paper's "ℓ0-based methods" (and JumpReLU): shallow SAEs whose sparsity is a k or target L0, not an L1 penalty
L0_BASED = tuple(key for key in SHALLOW if SAE_REGISTRY[key].sparsity_knob != "l1_coefficient")
PLATEAU_TOLERANCE = 0.01  # R² change counted as "flat"
NEGATIVE_ATOM_COSINE = 0.8  # "closely resembles −b_pre"
EXACT = 1e-6  # "unchanged" for the implementation checks

QUOTES = {
    "expressivity_k": "when fixing p = 1000 and varying k, MP-SAE is consistently more expressive across sparsity "
    "levels",
    "p_improves": "when k = 10 is fixed and p is swept, MP-SAE continues to improve as the dictionary size grows",
    "p_plateau": "while shallow SAEs plateau",
    "inference_topk": "TopK-based SAEs, which often degrade under sparsity mismatch […] particularly when the "
    "inference-time k is much larger than the training value (shown on DINOv2)",
    "inference_mp": "MP-SAE shows monotonic improvement, as guaranteed by Proposition 2",
    "inference_relu": "ReLU-based SAEs, by contrast, cannot expand their support beyond the features activated "
    "during training and thus exhibit flat or plateaued performance as k increases",
    "babel_dictionary": "MP-SAE exhibits a more coherent dictionary than the shallow SAEs",
    "babel_coactive": "it selects more incoherent atoms at inference",
    "shallow_alignment": "for shallow SAEs, the trends for the learned dictionary and the selected atoms align: ReLU "
    "consistently exhibits the highest coherence, while TopK remains the least coherent",
    "uniform_frequency": "its atoms are activated with roughly equal frequency",
    "varied_values": "but their activation values vary widely",
    "inverse_frequency": "atoms with higher activation values tend to be used less frequently",
    "hierarchy": "atoms with higher average activation values tend to be selected in the early layers of MP-SAE "
    "(the first iterations of Matching Pursuit)",
    "negative_atom": 'all shallow methods include a "negative" atom that closely resembles −b_pre, which is the '
    "most frequently activated atom in ReLU and JumpReLU",
}


def _claim(check: Any, holds: bool | None, measured: str) -> dict[str, Any]:
    return {
        "id": check.claim_id,
        "kind": check.kind,
        "claim": " ".join(check.__doc__.split()),
        "quote": QUOTES[check.claim_id],
        "holds": holds,
        "measured": measured,
    }


def claim(claim_id: str, kind: str = "paper"):
    """Register a check under its id; ``kind`` "implementation" keeps it out of the count of paper claims."""

    def register(function):
        function.claim_id, function.kind = claim_id, kind
        CHECKS.append(function)
        return function

    return register


CHECKS: list = []


def check_claims(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every check, in order; those whose inputs the results lack get ``holds: None``."""
    checks = []
    for check in CHECKS:
        try:
            checks.append(check(results))
        except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError) as exn:
            checks.append(_claim(check, None, f"not measured ({type(exn).__name__}: {exn})"))
    return checks


def count_claims(checks: list[dict[str, Any]]) -> dict[str, int]:
    """How many *paper* claims hold, do not hold and were not measured (implementation checks apart)."""
    paper = [c for c in checks if c["kind"] == "paper"]
    return {
        "holds": sum(c["holds"] is True for c in paper),
        "does_not_hold": sum(c["holds"] is False for c in paper),
        "not_measured": sum(c["holds"] is None for c in paper),
        "implementation_checks_passed": sum(c["holds"] is True for c in checks if c["kind"] == "implementation"),
        "implementation_checks": sum(c["kind"] == "implementation" for c in checks),
    }


def _shallow(mapping: dict) -> list[str]:
    return [v for v in SHALLOW if v in mapping]


def _label(variant: str) -> str:
    cls = SAE_REGISTRY.get(variant)
    return cls.label if cls is not None else variant


def r2_at_l0(rows: list[dict], l0: float) -> float | None:
    """R² of a variant's sweep interpolated linearly in log L0 at ``l0``; None outside its L0 range."""
    points = sorted((r["l0"], r["r2"]) for r in rows if r["l0"] > 0)
    if not points or not points[0][0] <= l0 <= points[-1][0]:
        return None
    for (a, ra), (b, rb) in zip(points, points[1:]):
        if a <= l0 <= b:
            if b == a:
                return max(ra, rb)
            t = (math.log(l0) - math.log(a)) / (math.log(b) - math.log(a))
            return ra + t * (rb - ra)
    return points[0][1]  # a single point equal to l0


@claim("expressivity_k")
def _expressivity_k(results: dict) -> dict:
    """MP-SAE has a higher R² than every shallow SAE at equal measured L0 (p fixed; shallow R² interpolated
    in log L0 at MP-SAE's L0, curves that do not reach it left out)."""
    vs_k = results["expressivity"]["vs_k"]
    shallow = _shallow(vs_k)
    parts, wins, compared = [], [], 0
    for row in vs_k["mpsae"]:
        cells = []
        for v in shallow:
            other = r2_at_l0(vs_k[v], row["l0"])
            if other is None:
                l0s = [r["l0"] for r in vs_k[v]]
                cells.append(f"{_label(v)} does not reach it (L0 {min(l0s):.1f}–{max(l0s):.1f})")
            else:
                compared += 1
                wins.append(row["r2"] > other)
                cells.append(f"{_label(v)} {other:.3f}")
        parts.append(f"L0 {row['l0']:.1f} (k={row['k']}): MP-SAE {row['r2']:.3f} vs " + ", ".join(cells))
    holds = all(wins) if compared else None
    return _claim(_expressivity_k, holds, "; ".join(parts))


def _gains(rows: list[dict]) -> list[float]:
    return [b["r2"] - a["r2"] for a, b in zip(rows, rows[1:])]


@claim("p_improves")
def _p_improves(results: dict) -> dict:
    """MP-SAE's R² keeps improving as p grows (k fixed): it never drops by more than the tolerance, and it
    gains more than the tolerance (0.01) over the last doubling of p."""
    rows = results["expressivity"]["vs_p"]["mpsae"]
    if len(rows) < 2:
        raise ValueError("the p sweep needs at least two p values")
    gains = _gains(rows)
    holds = all(g > -PLATEAU_TOLERANCE for g in gains) and gains[-1] > PLATEAU_TOLERANCE
    text = ", ".join(f"p={r['p']}: {r['r2']:.3f} (L0 {r['l0']:.1f})" for r in rows)
    return _claim(_p_improves, holds, f"MP-SAE R² {text}; last gain {gains[-1]:+.3f}")


@claim("p_plateau")
def _p_plateau(results: dict) -> dict:
    """Shallow SAEs plateau in p: over the last doubling of p each one's R² changes by at most the tolerance
    (0.01)."""
    vs_p = results["expressivity"]["vs_p"]
    shallow = _shallow(vs_p)
    if not shallow or len(vs_p[shallow[0]]) < 2:
        raise ValueError("needs a shallow variant and at least two p values")
    last = {v: _gains(vs_p[v])[-1] for v in shallow}
    total = {v: vs_p[v][-1]["r2"] - vs_p[v][0]["r2"] for v in shallow}
    p0, p1, p2 = vs_p[shallow[0]][0]["p"], vs_p[shallow[0]][-2]["p"], vs_p[shallow[0]][-1]["p"]
    text = ", ".join(
        f"{_label(v)} {last[v]:+.3f} (p {p0}→{p2}: {total[v]:+.3f}; L0 {vs_p[v][-1]['l0']:.1f})" for v in shallow
    )
    return _claim(_p_plateau, all(abs(g) <= PLATEAU_TOLERANCE for g in last.values()), f"R² change p {p1}→{p2}: {text}")


@claim("inference_topk")
def _inference_topk(results: dict) -> dict:
    """TopK degrades when the inference k is well above its training k: R² at the largest inference k is
    below R² at the training k by more than the tolerance (0.01), for every training k."""
    parts, holds = [], []
    for train_k, sweep in results["inference"]["by_train_k"]["topk"].items():
        ks, r2 = sweep["ks"], sweep["r2"]
        at = r2[ks.index(int(train_k))]
        parts.append(f"trained k={train_k}: {at:.3f} at k={train_k}, {r2[-1]:.3f} at k={ks[-1]}")
        holds.append(r2[-1] < at - PLATEAU_TOLERANCE)
    return _claim(_inference_topk, all(holds) if holds else None, "TopK R² " + "; ".join(parts))


@claim("inference_mp", kind="implementation")
def _inference_mp(results: dict) -> dict:
    """Implementation check (Proposition 2): MP-SAE's R² never decreases as the inference k grows, for every
    training k."""
    parts, holds = [], []
    for train_k, sweep in results["inference"]["by_train_k"]["mpsae"].items():
        r2 = sweep["r2"]
        holds.append(all(b >= a - EXACT for a, b in zip(r2, r2[1:])))
        parts.append(f"trained k={train_k}: {r2[0]:.3f} (k={sweep['ks'][0]}) → {r2[-1]:.3f} (k={sweep['ks'][-1]})")
    return _claim(_inference_mp, all(holds) if holds else None, "; ".join(parts))


@claim("inference_relu", kind="implementation")
def _inference_relu(results: dict) -> dict:
    """Implementation check: an inference k beyond ReLU's support leaves its codes as trained (R² at the
    largest inference k equals the R² without k, |Δ| ≤ 1e-6)."""
    study = results["inference"]
    sweep = study["main"]["relu"]
    trained = results["runs"][f"relu_p{study['p']}_k{study['k_train']}"]["r2"]
    change = sweep["r2"][-1] - trained
    return _claim(
        _inference_relu,
        abs(change) <= EXACT,
        f"R² {trained:.4f} as trained, {sweep['r2'][-1]:.4f} at k={sweep['ks'][-1]} (Δ {change:+.1e}); "
        f"ReLU's R² at k={study['k_train']}: {sweep['r2'][sweep['ks'].index(study['k_train'])]:.4f}",
    )


def _babel_at(curve: list[float], r: int) -> float:
    return curve[min(r, len(curve)) - 1]


@claim("babel_dictionary")
def _babel_dictionary(results: dict) -> dict:
    """MP-SAE learns a more coherent dictionary than every shallow SAE (higher dictionary Babel μ₁(k))."""
    curves, k = results["coherence"]["dictionary"], results["coherence"]["k"]
    r_max = len(curves["mpsae"])
    values = {v: (_babel_at(c, 1), _babel_at(c, k), _babel_at(c, r_max)) for v, c in curves.items()}
    holds = all(values["mpsae"][1] > values[v][1] for v in _shallow(curves))
    text = ", ".join(f"{_label(v)} {a:.3f}/{b:.2f}/{c:.1f}" for v, (a, b, c) in values.items())
    return _claim(_babel_dictionary, holds, f"μ₁(1)/μ₁({k})/μ₁({r_max}): {text}")


def _coactive_controlled(results: dict) -> tuple[int, dict[str, float], dict[str, dict]]:
    """``(r, restricted Babel per variant at r, support statistics)`` at the common r (see .coherence)."""
    from sae_pipeline.evaluate.coherence import common_r

    support = results["coherence"]["support"]
    r = common_r(support, results["coherence"]["k"])
    if r is None:
        raise ValueError("no r at which every variant has enough tokens with |S| >= r + 1")
    return r, {v: s["restricted_babel"][r - 1] for v, s in support.items()}, support


@claim("babel_coactive")
def _babel_coactive(results: dict) -> dict:
    """MP-SAE selects less coherent atoms per input than every shallow SAE: lower co-active Babel μ₁^S(r)
    on tokens with |S| ≥ r + 1 (r: the largest ≤ k − 1 that every variant reaches on ≥ 25 % of tokens)."""
    r, values, support = _coactive_controlled(results)
    k = results["coherence"]["k"]
    lower = [v for v in _shallow(values) if values["mpsae"] < values[v]]
    holds = len(lower) == len(_shallow(values))
    text = ", ".join(
        f"{_label(v)} {values[v]:.3f} (mean |S| {support[v]['mean_support']:.1f}, "
        f"{support[v]['restricted_tokens'][r - 1]} tokens; uncontrolled μ₁({k}) "
        f"{_babel_at(results['coherence']['coactive'][v], k):.3f})"
        for v in values
    )
    return _claim(_babel_coactive, holds, f"μ₁^S({r}): {text}")


@claim("shallow_alignment")
def _shallow_alignment(results: dict) -> dict:
    """Shallow SAEs: dictionary Babel μ₁(k) and co-active μ₁^S(r) rank them alike, ReLU most coherent and TopK
    least."""
    k = results["coherence"]["k"]
    dictionary = {v: _babel_at(c, k) for v, c in results["coherence"]["dictionary"].items() if v in SHALLOW}
    r, coactive, _ = _coactive_controlled(results)
    coactive = {v: x for v, x in coactive.items() if v in SHALLOW}
    order_d = sorted(dictionary, key=dictionary.get, reverse=True)
    order_c = sorted(coactive, key=coactive.get, reverse=True)
    if len(order_d) < 2:
        raise ValueError("needs at least two shallow variants")
    holds = order_d == order_c
    if {"relu", "topk"} <= set(order_d):
        holds = holds and order_d[0] == "relu" and order_d[-1] == "topk"
    return _claim(
        _shallow_alignment,
        holds,
        f"most to least coherent: dictionary μ₁({k}) "
        f"{' > '.join(map(_label, order_d))}; co-active μ₁^S({r}) {' > '.join(map(_label, order_c))}",
    )


def _l0_based(stats: dict) -> list[str]:
    found = [v for v in L0_BASED if v in stats]
    if not found or "mpsae" not in stats:
        raise ValueError("needs MP-SAE and at least one of JumpReLU, TopK, BatchTopK")
    return found


@claim("uniform_frequency")
def _uniform_frequency(results: dict) -> dict:
    """MP-SAE uses its atoms with more uniform frequency than JumpReLU, TopK and BatchTopK (lower coefficient
    of variation of the firing frequency over the atoms that fire)."""
    stats = results["concepts"]["variants"]
    others = _l0_based(stats)
    holds = all(stats["mpsae"]["frequency_cv"] < stats[v]["frequency_cv"] for v in others)
    text = ", ".join(f"{_label(v)} {s['frequency_cv']:.2f} ({s['n_fired']} atoms fire)" for v, s in stats.items())
    return _claim(_uniform_frequency, holds, f"CV of frequency: {text}")


@claim("varied_values")
def _varied_values(results: dict) -> dict:
    """MP-SAE's atoms vary more in value when active, E[z_j | z_j ≠ 0], than those of JumpReLU, TopK and
    BatchTopK (higher coefficient of variation; the CV of E[z_j], zeros counted, is shown second)."""
    stats = results["concepts"]["variants"]
    others = _l0_based(stats)
    holds = all(stats["mpsae"]["value_when_active_cv"] > stats[v]["value_when_active_cv"] for v in others)
    text = ", ".join(
        f"{_label(v)} {s['value_when_active_cv']:.2f} / {s['mean_value_cv']:.2f}" for v, s in stats.items()
    )
    return _claim(_varied_values, holds, f"CV of value when active / of E[z_j]: {text}")


def _rho_text(stats: dict, primary: str, secondary: str) -> str:
    return ", ".join(f"{_label(v)} {_signed(s.get(primary))} / {_signed(s.get(secondary))}" for v, s in stats.items())


def _signed(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.2f}"


@claim("inverse_frequency")
def _inverse_frequency(results: dict) -> dict:
    """MP-SAE: atoms with a higher value when active fire less often (Spearman ρ(frequency, E[z_j | z_j ≠ 0])
    < 0; ρ with E[z_j] shown second)."""
    stats = results["concepts"]["variants"]
    rho = stats["mpsae"]["spearman_frequency_vs_value_when_active"]
    return _claim(
        _inverse_frequency,
        None if rho is None else rho < 0,
        "ρ(frequency, value when active) / ρ(frequency, E[z_j]): "
        + _rho_text(stats, "spearman_frequency_vs_value_when_active", "spearman_frequency_vs_mean"),
    )


@claim("hierarchy")
def _hierarchy(results: dict) -> dict:
    """MP-SAE selects atoms with a higher value when active earlier (Spearman ρ(E[z_j | z_j ≠ 0], mean
    selection step) < 0; ρ with E[z_j] shown second; shallow SAEs ordered by value, as the paper does)."""
    stats = results["concepts"]["variants"]
    rho = stats["mpsae"]["spearman_value_when_active_vs_step"]
    return _claim(
        _hierarchy,
        None if rho is None else rho < 0,
        "ρ(value when active, step) / ρ(E[z_j], step): "
        + _rho_text(stats, "spearman_value_when_active_vs_step", "spearman_mean_vs_step"),
    )


@claim("negative_atom")
def _negative_atom(results: dict) -> dict:
    """Every shallow SAE holds an atom close to −b_pre (cosine > 0.8); for ReLU and JumpReLU it is the most
    frequently firing atom."""
    stats = results["concepts"]["variants"]
    shallow = _shallow(stats)
    if not shallow:
        raise ValueError("needs a shallow variant")
    atoms = {v: stats[v]["negative_atom"] for v in stats}
    holds = all(atoms[v]["cosine_with_minus_b_pre"] > NEGATIVE_ATOM_COSINE for v in shallow) and all(
        atoms[v]["frequency_rank"] == 1 for v in ("relu", "jumprelu") if v in atoms
    )
    text = ", ".join(
        f"{_label(v)} cos {a['cosine_with_minus_b_pre']:.2f} (frequency rank {a['frequency_rank']})"
        for v, a in atoms.items()
    )
    return _claim(_negative_atom, holds, f"closest atom to −b_pre: {text}")
