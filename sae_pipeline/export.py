"""Export a trained SAE out of a Lightning checkpoint: ``sae.safetensors`` + ``config.json``.

The export is what downstream users load: no Lightning, no optimiser state, no pickle
(safetensors for tensors, JSON for everything else), and it works on *raw* activations.
Training may scale inputs by ``input_scale`` (so that E‖x‖² = d_in, see
:class:`sae_pipeline.module.SAEModule`); every variant is positively homogeneous in its
biases and thresholds (``f(s·x; b, θ) = s·f(x; b/s, θ/s)``), so the scale is folded into
``b_pre``, ``b_enc`` and the thresholds by ``SparseAutoencoder.fold_input_scale`` and the
exported model's ``x_hat`` on raw ``x`` equals the trained model's ``x_hat`` on ``s·x``
divided by ``s``. Its codes are in raw units, i.e. the trained codes divided by ``s``.

The SAE's config (``{"class_path", "init_args"}``) is read and built by
:mod:`sae_pipeline.sae.config`, which the training module uses too.

Command line: ``python -m sae_pipeline export --ckpt_path FILE --out DIR [--format saelens]``
(SAELens's format: :mod:`sae_pipeline.saelens`).
"""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

import sae_pipeline
from feature_extraction.atomic_files import atomic_path
from feature_extraction.exit_status import run_cli
from feature_extraction.shards.integrity import file_sha256
from sae_pipeline.help_format import DefaultsHelpFormatter
from sae_pipeline.sae import SparseAutoencoder, variant_key
from sae_pipeline.sae.config import ExportError, build_sae, check_class_paths, sae_config

CONFIG_FNAME = "config.json"
WEIGHTS_FNAME = "sae.safetensors"
EXPORT_FORMAT = "sae_pipeline.export/1"


def variant_name(cls: type) -> str | None:
    """The registry key of a variant class (``"mpsae"``, ``"topk"``, ...), None when unregistered."""
    return variant_key(cls)


def load_checkpoint(ckpt_fpath: Path | str) -> dict[str, Any]:
    """``torch.load(..., weights_only=True)`` of a Lightning checkpoint written by ``SAEModule``."""
    ckpt_fpath = Path(ckpt_fpath)
    if not ckpt_fpath.is_file():
        raise ExportError(f"--ckpt_path {ckpt_fpath}: file not found; pass a .ckpt written by `fit` "
                          "(e.g. runs/NAME/version_N/checkpoints/last.ckpt, which fit prints)")
    try:
        checkpoint = torch.load(ckpt_fpath, map_location="cpu", weights_only=True)
    except Exception as exn:  # torch raises UnpicklingError, RuntimeError, EOFError, ... for bad files
        # Not torch's message: it suggests weights_only=False, which this product never does.
        raise ExportError(f"--ckpt_path {ckpt_fpath}: not a readable weights-only checkpoint "
                          f"({type(exn).__name__}); pass a .ckpt written by `fit`") from None
    missing = [key for key in ("state_dict", "sae_config", "input_scale") if key not in checkpoint]
    if not isinstance(checkpoint, dict) or missing:
        raise ExportError(f"--ckpt_path {ckpt_fpath}: missing {', '.join(missing) or 'content'}; "
                          "it was not written by sae_pipeline's SAEModule")
    check_class_paths({key: checkpoint.get(key) for key in ("sae_config", "hyper_parameters")},
                      f"--ckpt_path {ckpt_fpath}")
    return checkpoint


def sae_from_checkpoint(checkpoint: dict[str, Any]) -> SparseAutoencoder:
    """The trained SAE of a loaded checkpoint (input scale *not* folded)."""
    sae = build_sae(checkpoint["sae_config"])
    prefix = "sae."
    state = {key[len(prefix):]: value for key, value in checkpoint["state_dict"].items() if key.startswith(prefix)}
    try:
        sae.load_state_dict(state, strict=True)
    except RuntimeError as exn:
        raise ExportError(f"checkpoint weights do not match its sae_config: {str(exn).splitlines()[0]}") from None
    return sae


def export_checkpoint(ckpt_fpath: Path | str, out_dpath: Path | str) -> Path:
    """Write ``sae.safetensors`` and ``config.json`` for a checkpoint into ``out_dpath``; return it.

    The input scale is folded into the weights (``input_scale_folded`` in the config), so the
    exported SAE takes raw activations. ``config.json`` also records the variant, sizes, the
    module's hyper-parameters, the data (source, manifest sha256 for shard data), the
    training progress and the package version.
    """
    ckpt_fpath, out_dpath = Path(ckpt_fpath), Path(out_dpath)
    checkpoint = load_checkpoint(ckpt_fpath)
    sae = sae_from_checkpoint(checkpoint)
    input_scale = float(checkpoint["input_scale"])
    if not (math.isfinite(input_scale) and input_scale > 0):
        raise ExportError(f"--ckpt_path {ckpt_fpath}: input_scale is {input_scale}, must be finite and > 0")
    sae.fold_input_scale(input_scale)
    hyper_parameters = {key: value for key, value in dict(checkpoint.get("hyper_parameters") or {}).items()
                        if not key.startswith("_") and key != "sae"}
    config = {
        "format": EXPORT_FORMAT,
        "variant": variant_name(type(sae)),
        **sae_config(sae),
        "d_in": sae.d_in,
        "d_sae": sae.d_sae,
        "k": sae.k,
        "input_scale": input_scale,
        "input_scale_folded": True,
        "hyper_parameters": hyper_parameters,
        "data": checkpoint.get("data"),
        "manifest_sha256": (checkpoint.get("data") or {}).get("manifest_sha256"),
        "global_step": checkpoint.get("global_step"),
        "epoch": checkpoint.get("epoch"),
        "checkpoint": str(ckpt_fpath.resolve()),
        "package_version": sae_pipeline.__version__,
        "trained_with_package_version": checkpoint.get("sae_pipeline_version"),
    }
    tensors = {key: value.detach().contiguous() for key, value in sae.state_dict().items()}
    write_export_files(out_dpath, WEIGHTS_FNAME, tensors, {"format": EXPORT_FORMAT}, CONFIG_FNAME, config,
                       record_sha256=True)
    return out_dpath


def write_export_files(out_dpath: Path | str, weights_fname: str, tensors: dict[str, torch.Tensor],
                       weights_metadata: dict[str, str] | None, config_fname: str, config: dict[str, Any],
                       record_sha256: bool = False) -> Path:
    """Write an export's weights and config so that a failure never leaves a half-written export.

    Both files are written whole under temporary names (fsynced) and only then renamed over the
    old ones, weights first, config last; a failure before the renames (disk full, Ctrl-C) leaves
    the previous export as it was and no temporary file. ``record_sha256`` stores the weights'
    sha256 in the config, so the one instant between the two renames (a kill -9 there) shows up as a
    mismatch that ``load_sae`` names, instead of a silent mix of two exports.
    """
    from feature_extraction.output_dirs import prepare_output_dir

    out_dpath = prepare_output_dir(out_dpath, "--out")
    weights_tmp = out_dpath / f".{weights_fname}.{os.getpid()}.tmp"
    config_tmp = out_dpath / f".{config_fname}.{os.getpid()}.tmp"
    try:  # the inner (weights) is renamed first, the config last
        with atomic_path(out_dpath / config_fname, config_tmp) as config_tmp, \
                atomic_path(out_dpath / weights_fname, weights_tmp) as weights_tmp:
            save_file(tensors, str(weights_tmp), metadata=weights_metadata)
            if record_sha256:
                config = {**config, "weights_sha256": file_sha256(weights_tmp)}
            config_tmp.write_text(json.dumps(config, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    except OSError as exn:
        raise OSError(f"--out {out_dpath}: could not write the export ({exn.strerror or exn}); free space or "
                      "choose another --out (the previous export there, if any, is unchanged)") from None
    return out_dpath


def check_export(dpath: Path | str) -> None:
    """Raise a one-line ExportError when ``dpath`` is not a whole native export (cheap: no SAE is built)."""
    from safetensors import safe_open

    dpath = Path(dpath)
    config_fpath, weights_fpath = dpath / CONFIG_FNAME, dpath / WEIGHTS_FNAME
    fix = f"re-export it, or delete {dpath} and rerun what wrote it"
    try:
        config = json.loads(config_fpath.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exn:
        raise ExportError(f"{config_fpath}: unreadable ({type(exn).__name__}); {fix}") from None
    if not isinstance(config, dict):
        raise ExportError(f"{config_fpath}: not a JSON object; {fix}")
    if "weights_sha256" in config:
        if not weights_fpath.is_file() or file_sha256(weights_fpath) != config["weights_sha256"]:
            raise ExportError(f"{weights_fpath}: missing or its sha256 differs from {CONFIG_FNAME}'s "
                              f"'weights_sha256' (damaged); {fix}")
        return
    try:
        with safe_open(str(weights_fpath), framework="pt") as f:
            list(f.keys())
    except Exception as exn:  # safetensors raises SafetensorError (no common base) for damaged files
        raise ExportError(f"{weights_fpath}: not a readable safetensors file ({type(exn).__name__}); {fix}") from None


def load_sae(dpath: Path | str, map_location: str | torch.device = "cpu") -> SparseAutoencoder:
    """Rebuild an exported SAE from ``dpath`` (``config.json`` + ``sae.safetensors``), in eval mode.

    A SAELens directory (``cfg.json`` + ``sae_weights.safetensors``) gives our equivalent module
    (:func:`sae_pipeline.saelens.load_saelens`), so every ``--sae DIR`` accepts both formats.
    """
    from sae_pipeline import saelens  # imports this module: load it on use

    dpath = Path(dpath)
    if not (dpath / CONFIG_FNAME).is_file() and (dpath / saelens.SAELENS_CFG_FNAME).is_file():
        return saelens.load_saelens(dpath, map_location)
    config_fpath, weights_fpath = dpath / CONFIG_FNAME, dpath / WEIGHTS_FNAME
    for fpath in (config_fpath, weights_fpath):
        if not fpath.is_file():
            raise ExportError(f"{fpath}: not found; export a checkpoint first "
                              "(python -m sae_pipeline export --ckpt_path FILE --out DIR)")
    try:
        config = json.loads(config_fpath.read_text())
    except json.JSONDecodeError as exn:
        raise ExportError(f"{config_fpath}: invalid JSON ({exn}); re-export the checkpoint") from None
    if not isinstance(config, dict):
        raise ExportError(f"{config_fpath}: not a JSON object; re-export the checkpoint")
    fix = f"re-export it (python -m sae_pipeline export --ckpt_path {config.get('checkpoint') or 'FILE'} --out {dpath})"
    if "weights_sha256" in config and file_sha256(weights_fpath) != config["weights_sha256"]:
        raise ExportError(f"{weights_fpath}: sha256 differs from {CONFIG_FNAME}'s 'weights_sha256' (a damaged or "
                          f"mixed export); {fix}")
    try:
        sae = build_sae(config)
    except ExportError as exn:
        raise ExportError(f"{config_fpath}: {exn}") from None
    except TypeError as exn:
        raise ExportError(f"{config_fpath}: does not describe an SAE ({exn}); {fix}") from None
    try:
        state = load_file(str(weights_fpath), device=str(map_location))
    except Exception as exn:  # safetensors raises SafetensorError (no common base) for damaged files
        raise ExportError(f"{weights_fpath}: not a readable safetensors file ({type(exn).__name__}: "
                          f"{str(exn).splitlines()[0] if str(exn) else ''}); {fix}") from None
    try:
        sae.load_state_dict(state, strict=True)
    except RuntimeError as exn:
        raise ExportError(f"{weights_fpath}: weights do not match {CONFIG_FNAME}: {str(exn).splitlines()[0]}") from None
    return sae.to(map_location).eval()


def build_parser() -> Any:
    """The flags of ``python -m sae_pipeline export`` (jsonargparse: ``--config FILE`` sets any of them)."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    parser = ArgumentParser(
        prog="python -m sae_pipeline export", formatter_class=DefaultsHelpFormatter, exit_on_error=False,
        description="Export a trained SAE (Lightning checkpoint) to DIR/sae.safetensors + DIR/config.json, "
                    "with the input normalisation folded in so it runs on raw activations.")
    parser.add_argument("--config", action=ActionConfigFile, help="YAML file setting any of the options below")
    parser.add_argument("--ckpt_path", required=True,
                        help="checkpoint written by `fit`, e.g. runs/NAME/version_N/checkpoints/last.ckpt "
                             "(fit prints its path; each fit run has its own version_N)")
    parser.add_argument("--out", required=True, help="output directory (created if missing)")
    parser.add_argument("--format", choices=("native", "saelens"), default="native",
                        help="native: sae.safetensors + config.json; saelens: SAELens 6's cfg.json + "
                             "sae_weights.safetensors (SAEBench, dashboards, Neuronpedia)")
    parser.add_argument("--probe", default=None,
                        help="saelens format, MP-SAE only: data whose validation split checks that SAELens computes "
                             "the same codes (default: the data the run was trained on)")
    return parser


def run(args: Any) -> None:
    """Export ``args.ckpt_path`` into ``args.out`` in ``args.format`` and say where the files are."""
    if args.format == "saelens":
        from sae_pipeline import saelens

        out_dpath = saelens.export_checkpoint_saelens(args.ckpt_path, args.out, probe=args.probe)
        files = (saelens.SAELENS_WEIGHTS_FNAME, saelens.SAELENS_CFG_FNAME)
    else:
        out_dpath = export_checkpoint(args.ckpt_path, args.out)
        files = (WEIGHTS_FNAME, CONFIG_FNAME)
    print(f"exported {args.ckpt_path} -> {out_dpath / files[0]}, {out_dpath / files[1]}")


def main(argv: list[str] | None = None) -> int:
    """``python -m sae_pipeline export --ckpt_path FILE --out DIR``; returns the exit status (``exit_status``)."""
    return run_cli(build_parser(), sys.argv[1:] if argv is None else argv, run, error_type=True,
                   interrupted=lambda args: f"nothing was written to {args.out} (exports are written whole or not "
                                            "at all); rerun the command")[0]
