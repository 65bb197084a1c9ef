"""The check that SAELens's `matching_pursuit` computes our MP-SAE's codes, run before an MP-SAE is exported to it.

Why it is needed: SAELens picks `argmax relu(r·D)` and adds `relu(<r, d>)`; ours picks the signed
`argmax r·D` and adds it. The two agree exactly when every selected correlation is ≥ 0 (a negative
maximum means every atom anti-correlates with the residual: SAELens then adds 0 and stops moving,
ours adds the negative coefficient). So the export (`saelens_export.py`) runs our pursuit over a
probe set (the run's own validation split by default, or `--probe`) and refuses, in one line, when
any step selects a negative correlation; that check *is* the comparison, with no need for SAELens at
export time. Reading a probe set is the one place the export needs the data package.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from sae_pipeline.sae import MatchingPursuitSAE
from sae_pipeline.sae.config import ExportError

__all__ = ["check_pursuit_agrees", "checkpoint_probe", "pursuit_sign_violations"]

DEFAULT_PROBE_TOKENS = 65_536
NEGATIVE_TOLERANCE = 1e-6  # relative to the probe's RMS residual norm: float32 round-off, not a real sign


def pursuit_sign_violations(sae: MatchingPursuitSAE, x: Tensor, chunk_tokens: int = 4096) -> tuple[int, float]:
    """``(tokens, worst)``: how many tokens of ``x`` select a negative correlation at some MP step, and the
    most negative one (relative to the RMS norm of ``x − b_pre``). 0 tokens means SAELens's clipped
    pursuit gives exactly our codes on ``x`` (see the module docstring)."""
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] != sae.d_in:
        raise ExportError(f"the probe set has shape {list(x.shape)}; the MP-SAE needs [tokens >= 1, d_in={sae.d_in}]")
    scale = float((x - sae.b_pre.detach()).norm(dim=1).square().mean().sqrt()) or 1.0
    n_tokens, worst = 0, 0.0
    with torch.no_grad():
        for chunk in x.split(chunk_tokens):
            _, coefficients = sae.pursuit(chunk)
            smallest = coefficients.min(dim=1).values / scale
            n_tokens += int((smallest < -NEGATIVE_TOLERANCE).sum())
            worst = min(worst, float(smallest.min()))
    return n_tokens, worst


def check_pursuit_agrees(sae: MatchingPursuitSAE, x: Tensor, probe_name: str) -> None:
    """ExportError (one line) unless SAELens's ``matching_pursuit`` computes our codes on ``x``."""
    n_bad, worst = pursuit_sign_violations(sae, x)
    if n_bad:
        raise ExportError(
            f"MP-SAE not exported to SAELens: on {n_bad} of {x.shape[0]} tokens of {probe_name} a pursuit step "
            f"selects a negative correlation (down to {worst:.3g} x the RMS residual norm), which SAELens's "
            "matching_pursuit clips at zero while ours takes the signed argmax, so the outputs would differ; "
            "use --format native"
        )


def checkpoint_probe(checkpoint: dict[str, Any], probe: str | None, n_tokens: int) -> tuple[Tensor, str]:
    """Probe tokens for the MP check and their description: ``--probe SOURCE`` (its validation split),
    else the validation split of the data the run was trained on, as its checkpoint records it."""
    data_hparams = dict(checkpoint.get("datamodule_hyper_parameters") or {})
    source = probe or (checkpoint.get("data") or {}).get("source") or data_hparams.get("source")
    if not source or source == "None":
        raise ExportError(
            "the checkpoint records no data source to check the MP-SAE export on; "
            "pass --probe SOURCE (a shard directory, an .h5 token cache, digits or mnist)"
        )
    val_fraction = float(data_hparams.get("val_fraction") or 0.1) if probe is None else 0.1
    data_dpath = str(data_hparams.get("data_dpath") or "data")
    from sae_pipeline.data.validation import validation_tokens  # the data package loads Lightning: on use

    try:
        x = validation_tokens(str(source), val_fraction, n_tokens, data_dpath)
    except (ValueError, OSError) as exn:
        raise ExportError(
            f"cannot read the probe data {source} for the MP-SAE check "
            f"({str(exn).splitlines()[0] if str(exn) else type(exn).__name__}); "
            "pass --probe SOURCE with data of the same kind"
        ) from None
    return x, f"the validation split of {source}"
