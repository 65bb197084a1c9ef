"""Our SAE as SAELens 6's directory: `cfg.json` + `sae_weights.safetensors` (`export --format saelens`).

SAELens's format is what the field's tools load (SAEBench, SAE dashboards, Neuronpedia's
pipeline), so `python -m sae_pipeline export --format saelens` writes it and
`sae_pipeline.artifacts.load_sae` reads it back (`saelens_load.py`). SAELens itself is *not*
needed for either: the format is plain JSON and safetensors (the tests check both directions
against the real `sae-lens` package, the `saelens` extra). This module is the writing direction:
which SAELens architecture and config fields compute each variant's function, and the export of a
checkpoint into them.

How each variant maps (SAELens's inference classes, `sae_lens.saes.*`; `sae_in = x − b_dec`
when `apply_b_dec_to_input`, which we always write as true, and `x_hat = acts @ W_dec + b_dec`):

- ReLU → `standard`: `relu(sae_in @ W_enc + b_enc)`, the same formula.
- JumpReLU → `jumprelu`: `threshold = exp(log_threshold)` per latent (θ > 0, so SAELens's extra
  ReLU changes nothing).
- TopK → `topk`: `k`; `rescale_acts_by_decoder_norm = false` (atoms are unit-norm anyway).
  SAELens takes the top k of the pre-activations, then the ReLU; we the top k of the ReLU: the
  same non-zero codes.
- BatchTopK → `jumprelu`: the learned global θ repeated per latent, as SAELens saves its own
  BatchTopK (`metadata.training_architecture`).
- MP-SAE → `matching_pursuit`: `max_iterations = k`, `residual_threshold = 0` (never stop early),
  `stop_on_duplicate_support = false` (atoms may be picked again, as in ours).

MP-SAE needs one more condition, checked on a probe set before writing (`saelens_probe.py`).

The input normalisation survives because the export folds it into the weights first
(`SparseAutoencoder.fold_input_scale`, as the native export does): the SAELens model takes
raw activations and `normalize_activations` is `"none"`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
from sae_pipeline.artifacts.saelens_probe import DEFAULT_PROBE_TOKENS, check_pursuit_agrees, checkpoint_probe
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
    "export_checkpoint_saelens",
    "saelens_architecture",
    "saelens_config",
    "saelens_tensors",
    "write_saelens",
]

# metadata.sae_lens_version: SAELens converts configs older than 6.0 from its previous layout,
# so the version of the format we write (verified against sae-lens 6.54) must say 6.x.
SAELENS_FORMAT_VERSION = "6.0.0"


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
    weights_metadata = {"training_library": TRAINING_LIBRARY}  # how a later export knows the file is ours
    return write_export_files(out_dpath, SAELENS_WEIGHTS_FNAME, tensors, weights_metadata, SAELENS_CFG_FNAME, config)


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
    sae = sae_from_checkpoint(checkpoint, f"--ckpt_path {ckpt_fpath}").eval()
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
