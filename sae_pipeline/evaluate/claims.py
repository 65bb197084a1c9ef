"""The paper's claims, checked against a study's measured numbers.

Each check returns ``{"claim", "holds", "measured"}``: ``holds`` is True / False, or None when
the study lacks what the claim needs (a variant or a study not run). The thresholds are stated
in the claim text, so a reader can disagree with them and recompute from ``results.json``.
Claims are those of Costa et al. 2025 (Sections "Results" and "Results on Large Vision Models").
"""
from __future__ import annotations

from typing import Any

SHALLOW = ("relu", "jumprelu", "topk", "batchtopk")
PLATEAU_TOLERANCE = 0.01  # R² change counted as "flat"


def _claim(text: str, holds: bool | None, measured: str) -> dict[str, Any]:
    return {"claim": text, "holds": holds, "measured": measured}


def check_claims(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every claim whose inputs the results hold (others are listed with ``holds: None``)."""
    checks = []
    for check in (_expressivity_k, _expressivity_p, _inference_mp, _inference_topk, _inference_relu,
                  _babel_dictionary, _babel_coactive, _shallow_alignment, _uniform_frequency, _varied_values,
                  _hierarchy, _inverse_frequency, _inverse_frequency_when_active, _negative_atom):
        try:
            checks.append(check(results))
        except (KeyError, IndexError, TypeError, ValueError) as exn:
            checks.append(_claim(check.__doc__ or check.__name__, None, f"not measured ({type(exn).__name__})"))
    return checks


def _shallow(mapping: dict) -> list[str]:
    return [v for v in SHALLOW if v in mapping]


def _expressivity_k(results: dict) -> dict:
    """MP-SAE has a higher R² than every shallow SAE at equal k (fixed p)."""
    vs_k = results["expressivity"]["vs_k"]
    margins = []
    for i, row in enumerate(vs_k["mpsae"]):
        best = max(_shallow(vs_k), key=lambda v: vs_k[v][i]["r2"])
        margins.append((row["k"], row["r2"] - vs_k[best][i]["r2"], best))
    text = ", ".join(f"k={k}: {m:+.3f} vs {b}" for k, m, b in margins)
    return _claim(_expressivity_k.__doc__, all(m > 0 for _, m, _ in margins),
                  f"MP-SAE R² minus best shallow R²: {text}")


def _expressivity_p(results: dict) -> dict:
    """MP-SAE keeps improving as p grows while shallow SAEs plateau (gain over the last doubling of p)."""
    vs_p = results["expressivity"]["vs_p"]
    gains = {v: rows[-1]["r2"] - rows[-2]["r2"] for v, rows in vs_p.items()}
    total = {v: rows[-1]["r2"] - rows[0]["r2"] for v, rows in vs_p.items()}
    shallow_best = max(gains[v] for v in _shallow(vs_p))
    p_from, p_to = vs_p["mpsae"][-2]["p"], vs_p["mpsae"][-1]["p"]
    text = ", ".join(f"{v} {gains[v]:+.3f} (p {vs_p[v][0]['p']}→{p_to}: {total[v]:+.3f})" for v in vs_p)
    return _claim(_expressivity_p.__doc__, gains["mpsae"] > 0 and gains["mpsae"] > shallow_best,
                  f"R² gain p {p_from}→{p_to}: {text}")


def _inference_mp(results: dict) -> dict:
    """MP-SAE's R² rises monotonically with the inference k."""
    sweep = results["inference"]["main"]["mpsae"]
    r2 = sweep["r2"]
    rises = all(b >= a - 1e-6 for a, b in zip(r2, r2[1:]))
    return _claim(_inference_mp.__doc__, rises,
                  f"R² at k = {sweep['ks'][0]}, {results['inference']['k_train']} (trained), {sweep['ks'][-1]}: "
                  f"{r2[0]:.3f}, {r2[sweep['ks'].index(results['inference']['k_train'])]:.3f}, {r2[-1]:.3f}")


def _inference_topk(results: dict) -> dict:
    """TopK degrades when the inference k moves above its training k."""
    parts, holds = [], []
    for train_k, sweep in results["inference"]["by_train_k"]["topk"].items():
        ks, r2 = sweep["ks"], sweep["r2"]
        at = r2[ks.index(int(train_k))]
        parts.append(f"trained k={train_k}: R² {at:.3f} at k={train_k}, {r2[-1]:.3f} at k={ks[-1]}")
        holds.append(r2[-1] < at)
    return _claim(_inference_topk.__doc__, all(holds), "; ".join(parts))


def _inference_relu(results: dict) -> dict:
    """ReLU plateaus: raising the inference k beyond its own support changes R² by < 0.01."""
    sweep = results["inference"]["main"]["relu"]
    ks, r2 = sweep["ks"], sweep["r2"]
    trained_k = results["inference"]["k_train"]
    start = ks.index(trained_k)
    change = r2[-1] - r2[start]
    return _claim(_inference_relu.__doc__, abs(r2[-1] - r2[-2]) < PLATEAU_TOLERANCE,
                  f"R² {r2[start]:.3f} at k={trained_k}, {r2[-2]:.3f} at k={ks[-2]}, {r2[-1]:.3f} at k={ks[-1]} "
                  f"(change from k={trained_k}: {change:+.3f})")


def _babel_at(curve: list[float], r: int) -> float:
    return curve[min(r, len(curve)) - 1]


def _babel_dictionary(results: dict) -> dict:
    """MP-SAE learns a more coherent dictionary (higher Babel μ₁(r) of the whole dictionary) than shallow SAEs."""
    curves, k = results["coherence"]["dictionary"], results["coherence"]["k"]
    r_max = len(curves["mpsae"])
    values = {v: (_babel_at(c, 1), _babel_at(c, k), _babel_at(c, r_max)) for v, c in curves.items()}
    holds = all(values["mpsae"][1] > values[v][1] for v in _shallow(curves))
    text = ", ".join(f"{v} {a:.3f}/{b:.3f}/{c:.2f}" for v, (a, b, c) in values.items())
    return _claim(_babel_dictionary.__doc__, holds, f"μ₁(1)/μ₁({k})/μ₁({r_max}): {text}")


def _babel_coactive(results: dict) -> dict:
    """MP-SAE selects less coherent atoms per input (lower co-active Babel) than shallow SAEs."""
    curves, k = results["coherence"]["coactive"], results["coherence"]["k"]
    values = {v: _babel_at(c, k) for v, c in curves.items()}
    lower = [v for v in _shallow(curves) if values["mpsae"] < values[v]]
    holds = len(lower) == len(_shallow(curves))
    return _claim(_babel_coactive.__doc__, holds,
                  f"co-active μ₁({k}): " + ", ".join(f"{v} {x:.3f}" for v, x in values.items())
                  + f" (MP-SAE lower than {', '.join(lower) or 'none'})")


def _shallow_alignment(results: dict) -> dict:
    """Shallow SAEs: dictionary and co-active coherence rank alike; ReLU most coherent, TopK least."""
    k = results["coherence"]["k"]
    dictionary = {v: _babel_at(c, k) for v, c in results["coherence"]["dictionary"].items() if v in SHALLOW}
    coactive = {v: _babel_at(c, k) for v, c in results["coherence"]["coactive"].items() if v in SHALLOW}
    order_d = sorted(dictionary, key=dictionary.get, reverse=True)
    order_c = sorted(coactive, key=coactive.get, reverse=True)
    if len(order_d) < 2:
        return _claim(_shallow_alignment.__doc__, None, "needs at least two shallow variants")
    holds = order_d == order_c
    if {"relu", "topk"} <= set(order_d):
        holds = holds and order_d[0] == "relu" and order_d[-1] == "topk"
    return _claim(_shallow_alignment.__doc__, holds,
                  f"most to least coherent at r={k}: dictionary {' > '.join(order_d)}; co-active {' > '.join(order_c)}")


def _spread_text(stats: dict) -> str:
    return ", ".join(f"{v} {s['frequency_cv']:.2f}/{s['mean_value_cv']:.2f}" for v, s in stats.items())


def _uniform_frequency(results: dict) -> dict:
    """MP-SAE uses its atoms with more uniform frequency than TopK/BatchTopK/JumpReLU (lower CV of frequency)."""
    stats = results["concepts"]["variants"]
    l0_based = [v for v in ("jumprelu", "topk", "batchtopk") if v in stats]
    holds = all(stats["mpsae"]["frequency_cv"] < stats[v]["frequency_cv"] for v in l0_based)
    return _claim(_uniform_frequency.__doc__, holds if l0_based else None,
                  f"CV of frequency / CV of mean value: {_spread_text(stats)}")


def _varied_values(results: dict) -> dict:
    """MP-SAE's atoms vary more in mean value E[z_j] than those of TopK/BatchTopK/JumpReLU (higher CV)."""
    stats = results["concepts"]["variants"]
    l0_based = [v for v in ("jumprelu", "topk", "batchtopk") if v in stats]
    holds = all(stats["mpsae"]["mean_value_cv"] > stats[v]["mean_value_cv"] for v in l0_based)
    return _claim(_varied_values.__doc__, holds if l0_based else None,
                  f"CV of frequency / CV of mean value: {_spread_text(stats)}")


def _negative_rho(results: dict, field: str, doc: str, what: str) -> dict:
    """A claim that MP-SAE's Spearman ρ ``field`` is negative, with every variant's ρ as evidence."""
    stats = results["concepts"]["variants"]
    rho = stats["mpsae"].get(field)
    text = ", ".join(f"{v} {s[field]:+.2f}" for v, s in stats.items() if s.get(field) is not None)
    return _claim(doc, rho is not None and rho < 0, f"ρ({what}): {text}")


def _hierarchy(results: dict) -> dict:
    """MP-SAE selects atoms with higher mean value earlier (negative Spearman ρ of mean value vs selection step)."""
    return _negative_rho(results, "spearman_mean_vs_step", _hierarchy.__doc__, "mean value, mean step")


def _inverse_frequency(results: dict) -> dict:
    """MP-SAE: atoms with higher mean value fire less often (negative Spearman ρ of frequency vs mean value)."""
    return _negative_rho(results, "spearman_frequency_vs_mean", _inverse_frequency.__doc__, "frequency, mean value")


def _inverse_frequency_when_active(results: dict) -> dict:
    """MP-SAE: atoms with a higher value when active (E[z_j | z_j ≠ 0]) fire less often (negative Spearman ρ)."""
    return _negative_rho(results, "spearman_frequency_vs_value_when_active", _inverse_frequency_when_active.__doc__,
                         "frequency, value when active")


def _negative_atom(results: dict) -> dict:
    """Shallow SAEs hold a 'negative' atom close to −b_pre (cosine > 0.8), most frequent for ReLU and JumpReLU."""
    stats = results["concepts"]["variants"]
    shallow = _shallow(stats)
    atoms = {v: stats[v]["negative_atom"] for v in stats}
    holds = all(atoms[v]["cosine_with_minus_b_pre"] > 0.8 for v in shallow) and all(
        atoms[v]["frequency_rank"] == 1 for v in ("relu", "jumprelu") if v in atoms)
    text = ", ".join(f"{v} cos {a['cosine_with_minus_b_pre']:.2f} (frequency rank {a['frequency_rank']})"
                     for v, a in atoms.items())
    return _claim(_negative_atom.__doc__, holds if shallow else None, f"closest atom to −b_pre: {text}")
