"""Export a trained SAE out of a Lightning checkpoint: ``sae.safetensors`` + ``config.json``.

The export is what downstream users load: no Lightning, no optimiser state, no pickle
(safetensors for tensors, JSON for everything else), and it works on *raw* activations.
Training may scale inputs by ``input_scale`` (so that E‖x‖² = d_in, see
:class:`sae_pipeline.training.module.SAEModule`); every variant is positively homogeneous in its
biases and thresholds (``f(s·x; b, θ) = s·f(x; b/s, θ/s)``), so the scale is folded into
``b_pre``, ``b_enc`` and the thresholds by ``SparseAutoencoder.fold_input_scale`` and the
exported model's ``x_hat`` on raw ``x`` equals the trained model's ``x_hat`` on ``s·x``
divided by ``s``. Its codes are in raw units, i.e. the trained codes divided by ``s``.

The SAE's config (``{"class_path", "init_args"}``) is read and built by
:mod:`sae_pipeline.sae.config`, which the training module uses too.

Command line: ``python -m sae_pipeline export --ckpt_path FILE --out DIR [--format saelens] [--name NAME]``
(``--name``: one member of a group's checkpoint; without it a group exports every member into ``DIR/NAME``)
(SAELens's format: :mod:`sae_pipeline.artifacts.saelens_export`). Both files are replaced together or not at all
(:mod:`sae_pipeline.artifacts.export_files`, which also keeps one SAE per export folder and refuses an
``--out`` holding any file it did not write): a full disk
ends with one ``no space left on device`` line (exit 1) and leaves a previous export in ``--out``
whole. The files get the user's umask (e.g. 0644 under umask 022).

The checkpoint is read by :mod:`sae_pipeline.artifacts.checkpoint`, as every command reads one.
Reading an export back is :func:`load_native` here; :func:`sae_pipeline.artifacts.load_sae` picks the
format of a folder and is what users call. ``config.json``'s ``format`` is ``sae_pipeline.export/1``:
a name of the format, not of this module (exports written between the layout move and its fix say
``sae_pipeline.artifacts.export/1``; the two are the same format).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

import sae_pipeline
from feature_extraction.exit_status import run_cli
from feature_extraction.file_checks import terminal_text
from feature_extraction.file_hashes import file_sha256
from feature_extraction.output_lock import output_lock
from sae_pipeline.artifacts.checkpoint import (
    checkpoint_input_scale,
    member_names,
    read_checkpoint,
    sae_from_checkpoint,
)
from sae_pipeline.artifacts.export_files import (
    CONFIG_FNAME,
    EXPORT_FORMAT,
    SAELENS_CFG_FNAME,
    SAELENS_WEIGHTS_FNAME,
    WEIGHTS_FNAME,
    check_export_out,
    check_group_out,
    export_data,
    read_config_file,
    weight_shapes,
    write_export_files,
)
from sae_pipeline.artifacts.saelens_export import export_checkpoint_saelens
from sae_pipeline.sae import SparseAutoencoder, variant_key
from sae_pipeline.sae.config import ExportError, build_sae, check_sae_config, check_sae_size, sae_config

__all__ = ["EXPORT_FORMAT", "ExportError", "build_parser", "check_export", "export_checkpoint", "load_native", "main"]


def export_checkpoint(ckpt_fpath: Path | str, out_dpath: Path | str, name: str | None = None) -> Path:
    """Write ``sae.safetensors`` and ``config.json`` for a checkpoint into ``out_dpath``; return it.

    The input scale is folded into the weights (``input_scale_folded`` in the config), so the
    exported SAE takes raw activations. ``config.json`` also records the variant, sizes, the
    module's hyper-parameters, the data (source, manifest sha256 for shard data), the
    training progress and the package version. ``name`` picks a member of a group's checkpoint.
    """
    ckpt_fpath, out_dpath = Path(ckpt_fpath), Path(out_dpath)
    check_export_out(out_dpath, (WEIGHTS_FNAME, CONFIG_FNAME))
    checkpoint = read_checkpoint(ckpt_fpath, need=("input_scale",), name=name)
    sae = sae_from_checkpoint(checkpoint, f"--ckpt_path {ckpt_fpath}")
    input_scale = checkpoint_input_scale(checkpoint, f"--ckpt_path {ckpt_fpath}")
    sae.fold_input_scale(input_scale)
    hyper_parameters = {
        key: value
        for key, value in dict(checkpoint.get("hyper_parameters") or {}).items()
        if not key.startswith("_") and key != "sae"
    }
    data = export_data(checkpoint)
    config = {
        "format": EXPORT_FORMAT,
        "variant": variant_key(type(sae)),
        **sae_config(sae),
        "d_in": sae.d_in,
        "d_sae": sae.d_sae,
        "k": sae.k,
        "input_scale": input_scale,
        "input_scale_folded": True,
        "hyper_parameters": hyper_parameters,
        "data": data,
        "manifest_sha256": (data or {}).get("manifest_sha256"),
        "global_step": checkpoint.get("global_step"),
        "epoch": checkpoint.get("epoch"),
        "checkpoint": str(ckpt_fpath.resolve()),
        **({"group_member": name} if name is not None else {}),
        "package_version": sae_pipeline.__version__,
        "trained_with_package_version": checkpoint.get("sae_pipeline_version"),
    }
    tensors = {key: value.detach().contiguous() for key, value in sae.state_dict().items()}
    write_export_files(
        out_dpath, WEIGHTS_FNAME, tensors, {"format": EXPORT_FORMAT}, CONFIG_FNAME, config, record_sha256=True
    )
    return out_dpath


def check_export(dpath: Path | str) -> None:
    """Raise a one-line ExportError when ``dpath`` is not a whole native export (cheap: no SAE is built)."""
    from safetensors import safe_open

    dpath = Path(dpath)
    config_fpath, weights_fpath = dpath / CONFIG_FNAME, dpath / WEIGHTS_FNAME
    fix = f"re-export it, or delete {dpath} and rerun what wrote it"
    config = read_config_file(config_fpath, fix)
    if "weights_sha256" in config:
        if not weights_fpath.is_file() or file_sha256(weights_fpath) != config["weights_sha256"]:
            raise ExportError(
                f"{weights_fpath}: missing or its sha256 differs from {CONFIG_FNAME}'s "
                f"'weights_sha256' (damaged); {fix}"
            )
        return
    try:
        with safe_open(str(weights_fpath), framework="pt") as f:
            list(f.keys())
    except Exception as exn:  # safetensors raises SafetensorError (no common base) for damaged files
        raise ExportError(f"{weights_fpath}: not a readable safetensors file ({type(exn).__name__}); {fix}") from None


def load_native(dpath: Path | str, map_location: str | torch.device = "cpu") -> SparseAutoencoder:
    """Rebuild a native export from ``dpath`` (``config.json`` + ``sae.safetensors``), in eval mode
    (:func:`sae_pipeline.artifacts.load_sae` reads either format)."""
    dpath = Path(dpath)
    config_fpath, weights_fpath = dpath / CONFIG_FNAME, dpath / WEIGHTS_FNAME
    for fpath in (config_fpath, weights_fpath):
        if not fpath.is_file():
            raise ExportError(
                f"{fpath}: not found; export a checkpoint first "
                "(python -m sae_pipeline export --ckpt_path FILE --out DIR)"
            )
    config = read_config_file(config_fpath, "re-export the checkpoint")
    checkpoint = config.get("checkpoint")
    shown_ckpt = terminal_text(checkpoint, 200) if isinstance(checkpoint, str) and checkpoint else "FILE"
    fix = f"re-export it (python -m sae_pipeline export --ckpt_path {shown_ckpt} --out {dpath})"
    if "weights_sha256" in config and file_sha256(weights_fpath) != config["weights_sha256"]:
        raise ExportError(
            f"{weights_fpath}: sha256 differs from {CONFIG_FNAME}'s 'weights_sha256' (a damaged or mixed export); {fix}"
        )
    check_sae_config(config, str(config_fpath))
    # sized from the weights' header first: the SAE built is never larger than the file's W_dec
    check_sae_size(config.get("init_args") or {}, weight_shapes(weights_fpath, fix).get("W_dec"), str(config_fpath))
    try:
        sae = build_sae(config)
    except ExportError as exn:
        raise ExportError(f"{config_fpath}: {exn}") from None
    except (TypeError, ValueError) as exn:  # a constructor's own check of an argument (check_int, ...)
        raise ExportError(f"{config_fpath}: does not describe an SAE ({exn}); {fix}") from None
    try:
        state = load_file(str(weights_fpath), device=str(map_location))
    except Exception as exn:  # safetensors raises SafetensorError (no common base) for damaged files
        raise ExportError(
            f"{weights_fpath}: not a readable safetensors file ({type(exn).__name__}: "
            f"{str(exn).splitlines()[0] if str(exn) else ''}); {fix}"
        ) from None
    try:
        sae.load_state_dict(state, strict=True)
    except RuntimeError as exn:
        raise ExportError(f"{weights_fpath}: weights do not match {CONFIG_FNAME}: {str(exn).splitlines()[0]}") from None
    return sae.to(map_location).eval()


def build_parser() -> Any:
    """The flags of ``python -m sae_pipeline export`` (jsonargparse: ``--config FILE`` sets any of them)."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    from feature_extraction.help_format import DefaultsHelpFormatter

    parser = ArgumentParser(
        prog="python -m sae_pipeline export",
        formatter_class=DefaultsHelpFormatter,
        exit_on_error=False,
        description="Export a trained SAE (Lightning checkpoint) to DIR/sae.safetensors + DIR/config.json, "
        "with the input normalisation folded in so it runs on raw activations.",
    )
    parser.add_argument("--config", action=ActionConfigFile, help="YAML file setting any of the options below")
    parser.add_argument(
        "--ckpt_path",
        required=True,
        help="checkpoint written by `fit`, e.g. runs/NAME/version_N/checkpoints/last.ckpt "
        "(fit prints its path; each fit run has its own version_N)",
    )
    parser.add_argument("--out", required=True, help="output directory (created if missing)")
    parser.add_argument(
        "--name",
        default=None,
        help="a group's checkpoint (fit of model.members): the member to export into --out; "
        "without it every member is exported, each into --out/NAME",
    )
    parser.add_argument(
        "--format",
        choices=("native", "saelens"),
        default="native",
        help="native: sae.safetensors + config.json; saelens: SAELens 6's cfg.json + "
        "sae_weights.safetensors (SAEBench, dashboards, Neuronpedia)",
    )
    parser.add_argument(
        "--probe",
        default=None,
        help="saelens format, MP-SAE only: data whose validation split checks that SAELens computes "
        "the same codes (default: the data the run was trained on)",
    )
    return parser


def run(args: Any) -> None:
    """Export ``args.ckpt_path`` into ``args.out`` in ``args.format`` and say where the files are; a group's
    checkpoint without ``--name``: every member, into ``args.out/NAME``."""
    names = [args.name] if args.name is not None else member_names(read_checkpoint(args.ckpt_path, mmap=True))
    outs = {
        name: Path(args.out) / name if name is not None and args.name is None else Path(args.out)
        for name in names or [None]
    }
    files = (SAELENS_WEIGHTS_FNAME, SAELENS_CFG_FNAME) if args.format == "saelens" else (WEIGHTS_FNAME, CONFIG_FNAME)
    with output_lock(args.out, "export"):
        if Path(args.out) not in outs.values():  # a group's members, each in its folder: nothing else beside them
            check_group_out(args.out)
        for out in outs.values():  # every member's folder before the first is written
            check_export_out(out, files)
        for name, out in outs.items():
            if args.format == "saelens":
                out_dpath = export_checkpoint_saelens(args.ckpt_path, out, probe=args.probe, name=name)
            else:
                out_dpath = export_checkpoint(args.ckpt_path, out, name=name)
            what = f"{args.ckpt_path} ({name})" if name is not None else args.ckpt_path
            print(f"exported {what} -> {out_dpath / files[0]}, {out_dpath / files[1]}")


def main(argv: list[str] | None = None) -> int:
    """``python -m sae_pipeline export --ckpt_path FILE --out DIR``; returns the exit status (``exit_status``)."""
    return run_cli(
        build_parser(),
        sys.argv[1:] if argv is None else argv,
        run,
        error_type=True,
        interrupted=lambda args: (
            f"nothing was written to {args.out} (exports are written whole or not at all); rerun the command"
        ),
    )[0]
