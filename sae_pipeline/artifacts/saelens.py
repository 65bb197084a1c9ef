"""SAELens 6.x's on-disk format, both ways: ``cfg.json`` + ``sae_weights.safetensors``.

SAELens's format is what the field's tools load (SAEBench, SAE dashboards, Neuronpedia's
pipeline), so ``python -m sae_pipeline export --format saelens`` writes it and
:func:`sae_pipeline.artifacts.load_sae` reads it back. SAELens itself is *not* needed for either:
the format is plain JSON and safetensors (the tests check both directions against the real
``sae-lens`` package, the ``saelens`` extra).

How each variant maps (SAELens's inference classes, ``sae_lens.saes.*``; ``sae_in = x − b_dec``
when ``apply_b_dec_to_input``, which we always write as true, and ``x_hat = acts @ W_dec + b_dec``):

==============  =====================  ==========================================================
ours            SAELens architecture   what makes it compute our function
==============  =====================  ==========================================================
ReLU            ``standard``           ``relu(sae_in @ W_enc + b_enc)``: the same formula
JumpReLU        ``jumprelu``           ``threshold = exp(log_threshold)`` per latent (θ > 0, so
                                       SAELens's extra ReLU changes nothing)
TopK            ``topk``               ``k``; ``rescale_acts_by_decoder_norm = false`` (atoms are
                                       unit-norm anyway). SAELens takes the top k of the
                                       pre-activations, then the ReLU; we the top k of the ReLU:
                                       the same non-zero codes
BatchTopK       ``jumprelu``           the learned global θ repeated per latent, as SAELens saves
                                       its own BatchTopK (``metadata.training_architecture``)
MP-SAE          ``matching_pursuit``   ``max_iterations = k``, ``residual_threshold = 0`` (never
                                       stop early), ``stop_on_duplicate_support = false`` (atoms
                                       may be picked again, as in ours)
==============  =====================  ==========================================================

MP-SAE needs one more condition. SAELens picks ``argmax relu(r·D)`` and adds ``relu(<r, d>)``;
ours picks the signed ``argmax r·D`` and adds it. The two agree exactly when every selected
correlation is ≥ 0 (a negative maximum means every atom anti-correlates with the residual:
SAELens then adds 0 and stops moving, ours adds the negative coefficient). So the export runs
our pursuit over a probe set (the run's own validation split by default, or ``--probe``) and
refuses, in one line, when any step selects a negative correlation; that check *is* the
comparison, with no need for SAELens at export time.

The input normalisation survives because the export folds it into the weights first
(:meth:`SparseAutoencoder.fold_input_scale`, as the native export does): the SAELens model takes
raw activations and ``normalize_activations`` is ``"none"``.

Reading a SAELens directory builds the same classes back: ``standard`` → :class:`ReLUSAE`,
``jumprelu`` → :class:`JumpReLUSAE` (or :class:`BatchTopKSAE` when SAELens marks it as a
trained BatchTopK with one global threshold), ``topk`` → :class:`TopKSAE`,
``matching_pursuit`` → :class:`MatchingPursuitSAE`. Settings our classes cannot compute
(run-time ``layer_norm`` / ``constant_norm_rescale``, MP's early stopping, TopK's decoder-norm
rescaling with non-unit atoms, other architectures) are refused with the field and the fix,
never approximated. Atoms are loaded as saved (our formulas do not need unit norm; Babel
normalises them itself).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor

import sae_pipeline
from feature_extraction.shards import peek_manifest
from sae_pipeline.artifacts.checkpoint import checkpoint_input_scale, read_checkpoint, sae_from_checkpoint
from sae_pipeline.artifacts.export_files import (
    SAELENS_CFG_FNAME,
    SAELENS_WEIGHTS_FNAME,
    TRAINING_LIBRARY,
    check_export_out,
    export_data,
    write_export_files,
)
from sae_pipeline.sae import (
    BatchTopKSAE,
    JumpReLUSAE,
    MatchingPursuitSAE,
    ReLUSAE,
    SparseAutoencoder,
    TopKSAE,
    variant_key,
)
from sae_pipeline.sae.config import ExportError, sae_config

__all__ = [
    "ExportError",
    "SAELENS_CFG_FNAME",
    "SAELENS_WEIGHTS_FNAME",
    "export_checkpoint_saelens",
    "load_saelens",
    "pursuit_sign_violations",
    "sae_from_saelens",
    "saelens_architecture",
    "saelens_config",
    "saelens_tensors",
    "write_saelens",
]

# metadata.sae_lens_version: SAELens converts configs older than 6.0 from its previous layout,
# so the version of the format we write (verified against sae-lens 6.54) must say 6.x.
SAELENS_FORMAT_VERSION = "6.0.0"
ARCHITECTURES = ("standard", "jumprelu", "topk", "matching_pursuit")
RUNTIME_IDENTITY_NORMALIZATIONS = ("none", "expected_average_only_in")  # SAELens applies neither at inference
DEFAULT_PROBE_TOKENS = 65_536
NEGATIVE_TOLERANCE = 1e-6  # relative to the probe's RMS residual norm: float32 round-off, not a real sign


# --- ours -> SAELens -------------------------------------------------------------------------
def saelens_architecture(sae: SparseAutoencoder) -> str:
    """The SAELens architecture that computes ``sae``'s function; ExportError for other classes.

    Exact class match: a user's subclass may change ``encode``, and SAELens would not follow.
    """
    architecture = {
        ReLUSAE: "standard",
        JumpReLUSAE: "jumprelu",
        TopKSAE: "topk",
        BatchTopKSAE: "jumprelu",
        MatchingPursuitSAE: "matching_pursuit",
    }.get(type(sae))
    if architecture is None:
        raise ExportError(
            f"{type(sae).__name__} has no SAELens architecture (SAELens 6 represents ReLU, JumpReLU, "
            "TopK, BatchTopK and MP-SAE); export it with --format native"
        )
    if getattr(sae, "token_scaled_threshold", False):  # SAELens compares pre with θ itself, not pre / ‖x − b‖
        raise ExportError(
            f"{type(sae).__name__} was trained with token_scaled_threshold, which SAELens cannot "
            "represent; export it with --format native"
        )
    return architecture


def saelens_tensors(sae: SparseAutoencoder) -> dict[str, Tensor]:
    """SAELens's state dict for ``sae`` (float32, contiguous): ``W_dec``, ``b_dec`` and per architecture
    ``W_enc``, ``b_enc``, ``threshold``."""
    tensors = {"W_dec": sae.W_dec, "b_dec": sae.b_pre}
    if isinstance(sae, (ReLUSAE, JumpReLUSAE, TopKSAE)):  # the shallow ones (BatchTopK is a TopKSAE)
        tensors.update(W_enc=sae.W_enc, b_enc=sae.b_enc)
    if isinstance(sae, JumpReLUSAE):
        tensors["threshold"] = sae.threshold
    elif isinstance(sae, BatchTopKSAE):
        tensors["threshold"] = sae.threshold.expand(sae.d_sae)
    return {name: tensor.detach().float().cpu().contiguous().clone() for name, tensor in tensors.items()}


def saelens_config(sae: SparseAutoencoder, metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    """SAELens 6's ``cfg.json`` for ``sae`` (fields as ``SAEConfig.to_dict`` writes them)."""
    architecture = saelens_architecture(sae)
    config: dict[str, Any] = {
        "d_in": sae.d_in,
        "d_sae": sae.d_sae,
        "dtype": "float32",
        "device": "cpu",
        "apply_b_dec_to_input": True,
        "normalize_activations": "none",
        "reshape_activations": "none",
    }
    if architecture == "topk":
        config.update(k=sae.k, rescale_acts_by_decoder_norm=False)
    if architecture == "matching_pursuit":
        config.update(residual_threshold=0.0, max_iterations=sae.k, stop_on_duplicate_support=False)
    config["metadata"] = {
        "sae_lens_version": SAELENS_FORMAT_VERSION,
        "sae_lens_training_version": None,
        "training_library": TRAINING_LIBRARY,
        "sae_pipeline_version": sae_pipeline.__version__,
        "training_architecture": variant_key(type(sae)),
        "training_architecture_details": sae_config(sae)["init_args"],
        **(metadata or {}),
    }
    config["architecture"] = architecture
    return config


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


def data_metadata(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """What SAELens's metadata can say about the data: source (absolute for shards), backbone and layer (from
    a shard manifest), and the extraction record ``features explain`` runs (as the native ``data.extraction``)."""
    data = export_data(checkpoint) or {}
    source = data.get("source")
    metadata: dict[str, Any] = {"dataset_path": source, "manifest_sha256": data.get("manifest_sha256")}
    if isinstance(data.get("extraction"), dict):
        metadata["extraction"] = data["extraction"]
    manifest = peek_manifest(str(source)) if source else None
    if manifest is not None:
        backbone = manifest.get("backbone") or {}
        name = backbone.get("model_name") or backbone.get("name") if isinstance(backbone, dict) else backbone
        metadata.update(model_name=name, hook_name=f"layer_{manifest.get('layer')}")
    return metadata


def write_saelens(sae: SparseAutoencoder, out_dpath: Path | str, metadata: dict[str, Any] | None = None) -> Path:
    """Write ``sae`` (raw-activation units) as SAELens's ``cfg.json`` + ``sae_weights.safetensors``."""
    config = saelens_config(sae, metadata)
    tensors = saelens_tensors(sae)
    return write_export_files(out_dpath, SAELENS_WEIGHTS_FNAME, tensors, None, SAELENS_CFG_FNAME, config)


def export_checkpoint_saelens(
    ckpt_fpath: Path | str,
    out_dpath: Path | str,
    probe: str | None = None,
    n_probe_tokens: int = DEFAULT_PROBE_TOKENS,
    name: str | None = None,
) -> Path:
    """``export --format saelens``: fold the input scale, check MP-SAE's agreement, write SAELens's format.

    Everything is checked before anything is written, so a refused export leaves ``out_dpath`` as it was.
    """
    check_export_out(out_dpath, (SAELENS_WEIGHTS_FNAME, SAELENS_CFG_FNAME))  # before the (slow) probe
    checkpoint = read_checkpoint(ckpt_fpath, need=("input_scale",), name=name)
    sae = sae_from_checkpoint(checkpoint).eval()
    input_scale = checkpoint_input_scale(checkpoint, f"--ckpt_path {ckpt_fpath}")
    sae.fold_input_scale(input_scale)
    saelens_architecture(sae)
    metadata = {
        **data_metadata(checkpoint),
        "input_scale_folded": input_scale,
        "global_step": checkpoint.get("global_step"),
        "checkpoint": str(Path(ckpt_fpath).resolve()),
    }
    if isinstance(sae, MatchingPursuitSAE):
        x, probe_name = checkpoint_probe(checkpoint, probe, n_probe_tokens)
        check_pursuit_agrees(sae, x, probe_name)
        metadata["saelens_agreement_checked_on"] = {"data": probe_name, "n_tokens": int(x.shape[0])}
    return write_saelens(sae, out_dpath, metadata)


# --- SAELens -> ours -------------------------------------------------------------------------
def _require(config: dict[str, Any], name: str, allowed: tuple, fix: str, where: str) -> None:
    value = config.get(name, allowed[0])
    if value not in allowed:
        raise ExportError(
            f"{where}: {name} = {value!r} is not supported (our SAEs compute it only with "
            f"{' or '.join(map(repr, allowed))}); {fix}"
        )


def _tensor(tensors: dict[str, Tensor], name: str, shape: tuple[int, ...], where: str) -> Tensor:
    if name not in tensors:
        raise ExportError(
            f"{where}: {SAELENS_WEIGHTS_FNAME} has no {name!r} (has {', '.join(sorted(tensors))}); "
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
            f"{where}: architecture {architecture!r} has no equivalent here; supported: {', '.join(ARCHITECTURES)}"
        )
    _require(
        config,
        "normalize_activations",
        RUNTIME_IDENTITY_NORMALIZATIONS,
        "fold the normalisation into the weights before saving",
        where,
    )
    try:
        d_in, d_sae = int(config["d_in"]), int(config["d_sae"])
    except (KeyError, TypeError, ValueError):
        raise ExportError(f"{where}: cfg.json needs integer d_in and d_sae") from None
    W_dec = _tensor(tensors, "W_dec", (d_sae, d_in), where)
    b_dec = _tensor(tensors, "b_dec", (d_in,), where)
    subtract_b_dec = bool(config.get("apply_b_dec_to_input", True))
    metadata = dict(config.get("metadata") or {})
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
            raise ExportError(f"{where}: topk needs an integer k in [1, d_sae={d_sae}], got {k!r}")
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
        details = dict(metadata.get("training_architecture_details") or {})
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
            f"{where}: residual_threshold = {threshold!r} stops each token early, which our MP-SAE "
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
            f"{where}: max_iterations = {steps!r}; ours needs an integer number of steps in [1, d_sae={d_sae}]; {fix}"
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
    try:
        config = json.loads(cfg_fpath.read_text())
    except (OSError, json.JSONDecodeError) as exn:
        raise ExportError(f"{cfg_fpath}: not readable JSON ({exn}); save the SAE again with SAELens") from None
    if not isinstance(config, dict):
        raise ExportError(f"{cfg_fpath}: expected a JSON object, got {type(config).__name__}")
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
    return sae_from_saelens(config, tensors, where=str(dpath)).to(map_location)
