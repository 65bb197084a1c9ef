"""What the two export formats share: their file names, the whole-or-nothing write, one SAE per folder.

The native export (:mod:`sae_pipeline.artifacts.export`) and SAELens's format
(:mod:`sae_pipeline.artifacts.saelens_export`) both write through here, and :func:`export_format` tells a
reader which of the two a folder holds. Both modules sit above this one and neither imports the
other, so each can be loaded (and changed) alone.

One export folder holds one SAE. Exporting again in the same format replaces that export whole
(:func:`write_export_files`); exporting into a folder that holds the *other* format's files is
refused before anything is written (:func:`refuse_other_export`: exit 2, one line naming the files
and the fix: another ``--out``, or remove the folder first). Replacing would leave a reader of the
folder, or a ``--sae DIR`` that prefers one format, with an SAE the user did not mean, and deleting
a user's files is not the exporter's call. For the same reason an ``--out`` holding any file this
package did not write is refused the same way, whatever its name: another program's ``config.json``
(``cfg.json``) or weights file, which the export would replace, and any other file or folder, which would
end up beside an SAE it does not belong to. Ours say so: a config by its ``"format"``
(``metadata.training_library`` in SAELens's), a weights file by its safetensors header's metadata (the
same two keys; a SAELens export of before that mark by the ``cfg.json`` of ours beside it); the export's
lock and the temporary files of a killed export are ours by name. So re-exporting over our own export
works (`check_export_out`, which both exporters call before their work; `write_export_files`, the plain
writer, judges no file's content).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from feature_extraction.atomic_files import DiskFullError, atomic_path
from feature_extraction.file_checks import load_json
from feature_extraction.file_hashes import file_sha256
from feature_extraction.shards import extraction_record, manifest_sha256, peek_manifest
from sae_pipeline.sae.config import ExportError

__all__ = [
    "CONFIG_FNAME",
    "EXPORT_FORMAT",
    "EXPORT_FORMATS",
    "SAELENS_CFG_FNAME",
    "SAELENS_WEIGHTS_FNAME",
    "WEIGHTS_FNAME",
    "check_export_out",
    "check_group_out",
    "export_data",
    "export_format",
    "read_config_file",
    "refuse_other_export",
    "weight_shapes",
    "write_export_files",
]

CONFIG_FNAME = "config.json"  # native
WEIGHTS_FNAME = "sae.safetensors"  # native
SAELENS_CFG_FNAME = "cfg.json"
SAELENS_WEIGHTS_FNAME = "sae_weights.safetensors"
EXPORT_FORMAT = "sae_pipeline.export/1"  # native config.json's "format": the format's name, not a module's
EXPORT_FORMATS = (EXPORT_FORMAT, "sae_pipeline.artifacts.export/1")  # the second: exports of just after the move
TRAINING_LIBRARY = "sae_pipeline"  # what our SAELens cfg.json's metadata.training_library says
CONFIG_MAX_BYTES = 16 << 20  # an export's config is a few kB; its extraction record the largest part
FORMAT_FILES = {"native": (WEIGHTS_FNAME, CONFIG_FNAME), "SAELens": (SAELENS_WEIGHTS_FNAME, SAELENS_CFG_FNAME)}
SCRATCH_PREFIXES = (".lock", ".write-test-")  # the export's lock (output_lock), prepare_output_dir's probe


def export_format(dpath: Path | str) -> str:
    """``"native"`` or ``"saelens"``: the format of the export in ``dpath``, by its config file (native
    when both or neither are there, so that a missing export is reported with the native files' names)."""
    dpath = Path(dpath)
    if not (dpath / CONFIG_FNAME).is_file() and (dpath / SAELENS_CFG_FNAME).is_file():
        return "saelens"
    return "native"


def read_config_file(fpath: Path, fix: str) -> dict[str, Any]:
    """An export's ``config.json`` (or SAELens's ``cfg.json``) as a dict, read bounded (size, nesting, no NaN:
    `feature_extraction.file_checks.load_json`); anything else is one ExportError naming the file and ``fix``."""
    try:
        return load_json(fpath, what="export config", fix=fix, max_bytes=CONFIG_MAX_BYTES, kind=dict, error=ExportError)
    except OSError as exn:
        raise ExportError(f"{fpath}: not readable ({exn.strerror or type(exn).__name__}); {fix}") from None


def weight_shapes(fpath: Path, fix: str) -> dict[str, list[int]]:
    """``{tensor name: shape}`` from a safetensors file's header, no tensor read (to size an SAE before building
    it); one ExportError naming the file when it is not a readable safetensors file."""
    from safetensors import safe_open

    try:
        with safe_open(str(fpath), framework="pt") as f:
            return {name: list(f.get_slice(name).get_shape()) for name in f.keys()}
    except Exception as exn:  # noqa: BLE001 -- safetensors raises SafetensorError (no common base) for damaged files
        raise ExportError(f"{fpath}: not a readable safetensors file ({type(exn).__name__}); {fix}") from None


def export_data(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    """The checkpoint's record of its data (``data``: source, manifest sha256, extraction), as an export keeps it.

    An export is read from other folders than the one ``fit`` ran in, and ``features explain`` needs the
    backbone behind the tokens: a shard folder found from here is stored as an absolute path, and a
    checkpoint that predates the extraction record gets it from that folder's manifest when its sha256 is
    the one the checkpoint was trained on. The export then needs the shards no more.
    """
    data = checkpoint.get("data")
    if not isinstance(data, dict):
        return data
    data = dict(data)
    source = data.get("source")
    manifest = peek_manifest(str(source)) if source else None
    if manifest is not None:
        data["source"] = os.path.abspath(str(source))
        if not isinstance(data.get("extraction"), dict) and data.get("manifest_sha256") == manifest_sha256(manifest):
            data["extraction"] = extraction_record(manifest)
    return data


def write_export_files(
    out_dpath: Path | str,
    weights_fname: str,
    tensors: dict[str, torch.Tensor],
    weights_metadata: dict[str, str] | None,
    config_fname: str,
    config: dict[str, Any],
    record_sha256: bool = False,
) -> Path:
    """Write an export's weights and config so that a failure never leaves a half-written export.

    Both files are written whole under temporary names (fsynced) and only then renamed over the
    old ones, weights first, config last; a failure before the renames (disk full, Ctrl-C) leaves
    the previous export as it was and no temporary file. ``record_sha256`` stores the weights'
    sha256 in the config, so the one instant between the two renames (a kill -9 there) shows up as a
    mismatch that ``load_sae`` names, instead of a silent mix of two exports.
    """
    from feature_extraction.output_dirs import prepare_output_dir

    refuse_other_export(out_dpath, (weights_fname, config_fname))
    out_dpath = prepare_output_dir(out_dpath, "--out")
    weights_tmp = out_dpath / f".{weights_fname}.{os.getpid()}.tmp"
    config_tmp = out_dpath / f".{config_fname}.{os.getpid()}.tmp"
    previous = (out_dpath / config_fname).exists() or (out_dpath / weights_fname).exists()
    kept = f"the previous export in {out_dpath}, unchanged" if previous else f"no export in {out_dpath}"
    try:  # the inner (weights) is renamed first, the config last
        with (
            atomic_path(out_dpath / config_fname, config_tmp, kept=kept) as config_tmp,
            atomic_path(out_dpath / weights_fname, weights_tmp, kept=kept) as weights_tmp,
        ):
            save_file(tensors, str(weights_tmp), metadata=weights_metadata)
            if record_sha256:
                config = {**config, "weights_sha256": file_sha256(weights_tmp)}
            config_tmp.write_text(json.dumps(config, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    except DiskFullError:
        raise
    except OSError as exn:
        raise OSError(
            f"--out {out_dpath}: could not write the export ({exn.strerror or exn}); free space or "
            "choose another --out (the previous export there, if any, is unchanged)"
        ) from None
    return out_dpath


def check_export_out(out_dpath: Path | str, own_files: tuple[str, ...]) -> None:
    """The checks of an ``--out`` before an export is made (see the module docstring): no other format's export
    (`refuse_other_export`), no file by ``own_files``' names that this package did not write, and nothing else."""
    refuse_other_export(out_dpath, own_files)
    out_dpath = Path(out_dpath)
    config_fname = next(fname for fname in own_files if fname in (CONFIG_FNAME, SAELENS_CFG_FNAME))
    config_ours = (out_dpath / config_fname).exists() and _written_by_us(out_dpath / config_fname)
    for fname in own_files:
        fpath = out_dpath / fname
        ours = config_ours if fname == config_fname else _weights_by_us(fpath, config_ours)
        if fpath.exists() and not ours:
            raise ExportError(
                f"--out {out_dpath} holds a {fname} that this package did not write (another program's file, "
                f"which the export would replace); pass another --out, or move {fpath} away first"
            )
    others = [path.name for path in _entries(out_dpath) if not _own_name(path.name, own_files)]
    if others:
        raise ExportError(
            f"--out {out_dpath} holds {_names(others)}, which this package did not write (an export folder holds "
            "its export's files only); pass another --out (a new or empty folder), or move them away first"
        )


def check_group_out(out_dpath: Path | str) -> None:
    """A group's ``--out``, whose members are exported into ``--out/NAME`` (each checked by `check_export_out`):
    no file of someone else's beside their folders."""
    others = [path.name for path in _entries(Path(out_dpath)) if not path.is_dir() and not _own_name(path.name, ())]
    if others:
        raise ExportError(
            f"--out {out_dpath} holds {_names(others)}, which this package did not write (a group's export folder "
            "holds a folder per member); pass another --out (a new or empty folder), or move them away first"
        )


def _entries(dpath: Path) -> list[Path]:
    """What ``dpath`` holds, by name (nothing when it is not a folder: a file there is prepare_output_dir's line)."""
    return sorted(dpath.iterdir()) if dpath.is_dir() else []


def _names(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _own_name(name: str, own_files: tuple[str, ...]) -> bool:
    """Whether ``name`` in an export folder is one an export writes there: its files, their temporary files
    (``.NAME.PID.tmp``, left by a killed export), its lock."""
    if name in own_files or name.startswith(SCRATCH_PREFIXES):
        return True
    return any(name.startswith(f".{fname}.") and name.endswith(".tmp") for fname in own_files)


def refuse_other_export(out_dpath: Path | str, own_files: tuple[str, ...]) -> None:
    """Raise a one-line ExportError when ``out_dpath`` holds files of another export format than ``own_files``'
    (see the module docstring: an export folder holds one SAE)."""
    out_dpath = Path(out_dpath)
    for name, files in FORMAT_FILES.items():
        found = [fname for fname in files if fname not in own_files and (out_dpath / fname).exists()]
        if found:
            raise ExportError(
                f"--out {out_dpath} holds a {name} export ({', '.join(found)}) and one folder holds one "
                f"SAE; pass another --out, or remove {out_dpath} first to replace it"
            )


def _weights_by_us(fpath: Path, config_ours: bool) -> bool:
    """Whether an export's weights file is one this package wrote, by its safetensors header's metadata (module
    docstring); an unreadable file is not."""
    from safetensors import safe_open

    try:
        with safe_open(str(fpath), framework="pt") as f:
            metadata = f.metadata() or {}
    except Exception:  # noqa: BLE001 -- safetensors raises SafetensorError (no common base) for damaged files
        return False
    if fpath.name == WEIGHTS_FNAME:
        return metadata.get("format") in EXPORT_FORMATS
    return metadata.get("training_library") == TRAINING_LIBRARY or (not metadata and config_ours)


def _written_by_us(config_fpath: Path) -> bool:
    """Whether an export config file is one this package wrote (see the module docstring)."""
    try:
        config = read_config_file(config_fpath, "")
    except ExportError:
        return False
    if config_fpath.name == CONFIG_FNAME:
        return config.get("format") in EXPORT_FORMATS
    metadata = config.get("metadata")
    return isinstance(metadata, dict) and metadata.get("training_library") == TRAINING_LIBRARY
