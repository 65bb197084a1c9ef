"""A SAELens 6 directory (`cfg.json` + `sae_weights.safetensors`) read back as our SAE module.

Why: every `--sae DIR` accepts SAELens's SAEs too (`sae_pipeline.artifacts.load_sae` reads through
here), so an SAE trained with SAELens gets our evaluation and feature browser. SAELens itself is not
needed: the format is plain JSON and safetensors. This is the reading direction of the mapping that
`saelens_export.py` writes.

Reading a SAELens directory builds the same classes back: `standard` → `ReLUSAE`,
`jumprelu` → `JumpReLUSAE` (or `BatchTopKSAE` when SAELens marks it as a
trained BatchTopK with one global threshold), `topk` → `TopKSAE`,
`matching_pursuit` → `MatchingPursuitSAE`. Settings our classes cannot compute
(run-time `layer_norm` / `constant_norm_rescale`, MP's early stopping, TopK's decoder-norm
rescaling with non-unit atoms, other architectures) are refused with the field and the fix,
never approximated. Atoms are loaded as saved (our formulas do not need unit norm; Babel
normalises them itself).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor

from feature_extraction.file_checks import shown, terminal_text
from sae_pipeline.artifacts.export_files import SAELENS_CFG_FNAME, SAELENS_WEIGHTS_FNAME, read_config_file
from sae_pipeline.sae import (
    BatchTopKSAE,
    JumpReLUSAE,
    MatchingPursuitSAE,
    ReLUSAE,
    SparseAutoencoder,
    TopKSAE,
)
from sae_pipeline.sae.config import ExportError

__all__ = ["load_saelens", "sae_from_saelens"]

ARCHITECTURES = ("standard", "jumprelu", "topk", "matching_pursuit")
RUNTIME_IDENTITY_NORMALIZATIONS = ("none", "expected_average_only_in")  # SAELens applies neither at inference


def _require(config: dict[str, Any], name: str, allowed: tuple, fix: str, where: str) -> None:
    value = config.get(name, allowed[0])
    if value not in allowed:
        raise ExportError(
            f"{where}: {name} = {shown(value)} is not supported (our SAEs compute it only with "
            f"{' or '.join(map(repr, allowed))}); {fix}"
        )


def _mapping(config: dict[str, Any], name: str, where: str) -> dict[str, Any]:
    """``config[name]`` when it is an object ({} when absent or null); one ExportError naming it otherwise."""
    value = config.get(name) or {}
    if not isinstance(value, dict):
        raise ExportError(f"{where}: {SAELENS_CFG_FNAME}'s {name} must be an object, not {shown(value)}")
    return value


def _tensor(tensors: dict[str, Tensor], name: str, shape: tuple[int, ...], where: str) -> Tensor:
    if name not in tensors:
        raise ExportError(
            f"{where}: {SAELENS_WEIGHTS_FNAME} has no {name!r} (has {terminal_text(', '.join(sorted(tensors)), 200)}); "
            "save the SAE with SAELens's save_model"
        )
    tensor = tensors[name].float()
    if tuple(tensor.shape) != shape:
        raise ExportError(f"{where}: {name} has shape {list(tensor.shape)}, cfg.json implies {list(shape)}")
    return tensor


def sae_from_saelens(
    config: dict[str, Any], tensors: dict[str, Tensor], where: str = "SAELens SAE"
) -> SparseAutoencoder:
    """Our SAE computing the same ``encode`` / ``decode`` as the SAELens model ``(cfg, state dict)``."""
    architecture = config.get("architecture", "standard")
    if architecture not in ARCHITECTURES:
        raise ExportError(
            f"{where}: architecture {shown(architecture)} has no equivalent here; supported: {', '.join(ARCHITECTURES)}"
        )
    _require(
        config,
        "normalize_activations",
        RUNTIME_IDENTITY_NORMALIZATIONS,
        "fold the normalisation into the weights before saving",
        where,
    )
    d_in, d_sae = config.get("d_in"), config.get("d_sae")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in (d_in, d_sae)):
        raise ExportError(
            f"{where}: cfg.json needs integers d_in and d_sae >= 1, has {shown(d_in)} and {shown(d_sae)}; "
            "save the SAE again with SAELens"
        )
    W_dec = _tensor(tensors, "W_dec", (d_sae, d_in), where)
    b_dec = _tensor(tensors, "b_dec", (d_in,), where)
    subtract_b_dec = bool(config.get("apply_b_dec_to_input", True))
    metadata = _mapping(config, "metadata", where)
    if architecture == "matching_pursuit":
        return _mp_from_saelens(config, W_dec, b_dec, subtract_b_dec, where)
    W_enc = _tensor(tensors, "W_enc", (d_in, d_sae), where)
    b_enc = _tensor(tensors, "b_enc", (d_sae,), where)
    if not subtract_b_dec:  # SAELens: x @ W_enc + b_enc; ours: (x − b_pre) @ W_enc + b_enc'
        b_enc = b_enc + b_dec @ W_enc
    sae: SparseAutoencoder
    if architecture == "standard":
        sae = ReLUSAE(d_in, d_sae)
    elif architecture == "topk":
        k = config.get("k")
        if not isinstance(k, int) or not 1 <= k <= d_sae:
            raise ExportError(f"{where}: topk needs an integer k in [1, d_sae={d_sae}], got {shown(k)}")
        norms = W_dec.norm(dim=1)
        if config.get("rescale_acts_by_decoder_norm") and not torch.allclose(norms, torch.ones_like(norms), atol=1e-5):
            raise ExportError(
                f"{where}: rescale_acts_by_decoder_norm with non-unit atoms ranks latents by "
                "pre-activation x atom norm, which our TopK does not; fold the decoder norms first "
                "(SAELens: sae.fold_W_dec_norm()) and save again"
            )
        sae = TopKSAE(d_in, d_sae, k=k)
    else:
        threshold = _tensor(tensors, "threshold", (d_sae,), where).clamp_min(0.0)  # SAELens: relu(pre)·(pre > θ)
        details = _mapping(metadata, "training_architecture_details", where)
        k = details.get("k")
        if (
            metadata.get("training_architecture") == "batchtopk"
            and isinstance(k, (int, float))
            and k >= 1
            and bool((threshold == threshold[0]).all())
        ):
            sae = BatchTopKSAE(d_in, d_sae, k=min(d_sae, max(1, round(k))))
            with torch.no_grad():
                sae.threshold.fill_(float(threshold[0]))
                sae.n_threshold_updates.fill_(1)
        else:
            sae = JumpReLUSAE(d_in, d_sae)
            with torch.no_grad():
                sae.log_threshold.copy_(threshold.log())  # θ = 0 -> -inf: exp gives 0 back exactly
    with torch.no_grad():
        sae.W_dec.copy_(W_dec)
        sae.b_pre.copy_(b_dec)
        sae.W_enc.copy_(W_enc)
        sae.b_enc.copy_(b_enc)
    return sae.eval()


def _mp_from_saelens(
    config: dict[str, Any], W_dec: Tensor, b_dec: Tensor, subtract_b_dec: bool, where: str
) -> MatchingPursuitSAE:
    """MP-SAE for SAELens's ``matching_pursuit`` with a fixed number of steps and no early stopping."""
    fix = "save it with residual_threshold 0, stop_on_duplicate_support false and max_iterations = k"
    threshold = config.get("residual_threshold", 1e-2)
    if not isinstance(threshold, (int, float)) or threshold > 0:
        raise ExportError(
            f"{where}: residual_threshold = {shown(threshold)} stops each token early, which our MP-SAE "
            f"(a fixed number of steps) does not; {fix}"
        )
    if config.get("stop_on_duplicate_support", True):
        raise ExportError(
            f"{where}: stop_on_duplicate_support = true stops a token when an atom repeats, while "
            f"ours may pick an atom again; {fix}"
        )
    steps = config.get("max_iterations")
    d_sae, d_in = W_dec.shape
    if not isinstance(steps, int) or not 1 <= steps <= d_sae:
        raise ExportError(
            f"{where}: max_iterations = {shown(steps)}; ours needs an integer number of steps in "
            f"[1, d_sae={d_sae}]; {fix}"
        )
    sae = MatchingPursuitSAE(d_in, d_sae, k=steps)
    with torch.no_grad():
        sae.W_dec.copy_(W_dec)
        sae.b_pre.copy_(b_dec if subtract_b_dec else torch.zeros_like(b_dec))
    return sae.eval()


def load_saelens(dpath: Path | str, map_location: str | torch.device = "cpu") -> SparseAutoencoder:
    """Our equivalent of the SAELens SAE saved in ``dpath`` (``cfg.json``, ``sae_weights.safetensors``), eval mode."""
    dpath = Path(dpath)
    cfg_fpath = dpath / SAELENS_CFG_FNAME
    config = read_config_file(cfg_fpath, "save the SAE again with SAELens")
    if not (dpath / SAELENS_WEIGHTS_FNAME).is_file():
        raise ExportError(
            f"{dpath / SAELENS_WEIGHTS_FNAME}: not found beside {SAELENS_CFG_FNAME}; a SAELens directory "
            "holds both (SAELens: sae.save_model(DIR))"
        )
    try:
        tensors = load_file(str(dpath / SAELENS_WEIGHTS_FNAME))
    except Exception as exn:  # safetensors raises its own SafetensorError for damaged files
        raise ExportError(
            f"{dpath / SAELENS_WEIGHTS_FNAME}: not a readable safetensors file "
            f"({type(exn).__name__}); save the SAE again with SAELens"
        ) from None
    damaged = sorted(name for name, tensor in tensors.items() if not bool(torch.isfinite(tensor.float()).all()))
    if damaged:
        raise ExportError(f"{dpath}: {', '.join(damaged)} hold NaN or inf; the saved SAE is damaged")
    try:
        sae = sae_from_saelens(config, tensors, where=str(cfg_fpath))
    except ExportError:
        raise
    except (TypeError, ValueError) as exn:  # a constructor's own check of a setting (check_int, ...)
        raise ExportError(f"{cfg_fpath}: {exn}; save the SAE again with SAELens") from None
    return sae.to(map_location)
