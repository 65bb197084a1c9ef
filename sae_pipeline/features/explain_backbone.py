"""Which backbone an SAE was trained on, and that backbone rebuilt for `features explain`.

Why a module of its own: explain must run an image through exactly the backbone the extraction ran
(same registry entry, layer, preprocessing and weights), or its tokens, and so its atoms, are not the
ones the SAE learned from. Finding that record and refusing anything else is one concern, apart from
running the images (`explain_images.py`) and writing their pages (`explain_pages.py`).

Where the backbone comes from: the SAE's `config.json` keeps the extraction's record
(`data.extraction`: backbone spec and preprocessing, layer, pretrained flag, checkpoint path,
the random weights' seed, token selection; `feature_extraction.shards.extraction_record`),
copied from the shard manifest by `fit` and `export` (a SAELens export: `metadata.extraction`),
so explain needs neither the shards nor the folder the export was made in: moved or deleted
shards change nothing. Exports from before that record fall back to `manifest.json` in the
recorded `data.source`, if its sha256 still matches the one the SAE records (a SAELens export:
its `metadata.dataset_path` and `manifest_sha256`); when it is not there (the shards moved, or
the path was relative to the folder the export ran in) one line names it, and exporting the
checkpoint again stores the record (taken from the manifest when the checkpoint predates it).
Nothing the artifact names is imported: the backbone is looked up by name in
the registry (`feature_extraction.backbones.BACKBONES`) and must match the recorded spec.
Random weights (test backbones) are drawn from the recorded seed as the extraction drew them, so
an image's tokens here equal the extraction's (the tests check it). Weights other than the
extraction's (the record's `weights_sha256`: same architecture, other tokens) are refused; a
record from before that hash is used with one warning.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from feature_extraction.file_checks import load_json, shown


def read_json(fpath: Path) -> dict:
    """A JSON object from ``fpath`` (read bounded: `feature_extraction.file_checks`); {} when it is missing or not
    one (`load_sae` then names what is wrong with the export)."""
    try:
        return load_json(fpath, what="export config", fix="export it again", max_bytes=16 << 20, kind=dict)
    except (OSError, ValueError):
        return {}


def _optional(kind: type | tuple[type, ...]) -> Any:
    return lambda value: value is None or isinstance(value, kind) and not (kind is int and isinstance(value, bool))


#: The fields of an extraction record (`feature_extraction.shards.extraction_record`) that explain reads, and
#: what each must be; checked before any is used, so a record edited in an export is one line, not a TypeError.
RECORD_FIELDS = {
    "backbone": lambda v: isinstance(v, dict) and isinstance(v.get("name"), str),
    "layer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "d": _optional(int),
    "weights": _optional(dict),
    "token_selection": _optional(dict),
}
WEIGHTS_FIELDS = {"pretrained": _optional(bool), "checkpoint_path": _optional(str), "seed": _optional(int)}


def check_record(record: dict, sae_dpath: Path) -> dict:
    """``record`` when every field explain reads has its kind; else one ValueError naming the field and the fix."""
    weights = record.get("weights") if isinstance(record.get("weights"), dict) else {}
    fields = [(name, record.get(name), test) for name, test in RECORD_FIELDS.items()]
    fields += [(f"weights.{name}", weights.get(name), test) for name, test in WEIGHTS_FIELDS.items()]
    for name, value, test in fields:
        if not test(value):
            raise ValueError(
                f"--sae {sae_dpath}: its extraction record's {name} is {shown(value)}, not what the extraction "
                "writes (edited or damaged); export the SAE's checkpoint again"
            )
    return record


def recorded_extraction(sae_dpath: Path) -> dict:
    """The extraction record of the SAE in ``sae_dpath`` (see the module docstring); one line when there is none."""
    from feature_extraction.shards import extraction_record, manifest_sha256, peek_manifest
    from sae_pipeline.artifacts.export_files import CONFIG_FNAME, SAELENS_CFG_FNAME

    config, data = read_json(sae_dpath / CONFIG_FNAME), {}
    if isinstance(config.get("data"), dict):
        data = config["data"]
    elif isinstance(metadata := read_json(sae_dpath / SAELENS_CFG_FNAME).get("metadata"), dict):
        data = {key: metadata.get(key) for key in ("extraction", "manifest_sha256")}
        data["source"] = metadata.get("dataset_path")
    if isinstance(data.get("extraction"), dict):
        return check_record(data["extraction"], sae_dpath)
    source, sha = data.get("source"), data.get("manifest_sha256") or config.get("manifest_sha256")
    source = source if isinstance(source, str) else None
    why = "records no backbone (trained on digits, MNIST, an .h5 cache or shards without one)"
    if source and sha:
        manifest = peek_manifest(source)
        if manifest is None:
            where = "" if Path(source).is_absolute() else ", a path relative to the folder it was exported in"
            why = f"records no backbone and its shards' manifest {Path(source) / 'manifest.json'} is not there{where}"
        elif manifest_sha256(manifest) != sha:
            why = f"records no backbone and the manifest at {source} is not the one it was trained on (sha256 differs)"
        elif (record := extraction_record(manifest)) is not None:
            return check_record(record, sae_dpath)
    raise ValueError(
        f"--sae {sae_dpath}: {why}; explain needs an SAE trained on shards of python -m feature_extraction "
        "(an export from before this version: export its checkpoint again, which stores the backbone in the export)"
    )


def build_backbone(record: dict, checkpoint_path: str | None, d_in: int) -> Any:
    """The recorded backbone, rebuilt from the registry with the recorded (or given) weights."""
    from feature_extraction.backbones import get_backbone_spec, load_backbone

    recorded = record["backbone"]
    name = str(recorded.get("name"))
    try:
        spec = get_backbone_spec(name)
    except ValueError as exn:
        raise ValueError(f"the SAE's backbone: {exn}") from None
    differs = [k for k, v in spec.to_json().items() if recorded.get(k) != json.loads(json.dumps(v))]
    if differs:
        raise ValueError(
            f"backbone {name!r}: the registry's entry differs from the one the SAE was trained on in {differs}; "
            "use the package version that extracted its shards"
        )
    if int(record.get("d") or spec.d) != d_in:
        raise ValueError(
            f"backbone {name!r} gives {record.get('d') or spec.d}-d tokens but the SAE takes d_in = {d_in}; "
            "pass the SAE trained on this backbone"
        )
    weights = record.get("weights") or {}
    fpath = checkpoint_path or weights.get("checkpoint_path")
    pretrained = bool(weights.get("pretrained")) and checkpoint_path is None
    if fpath is not None and not Path(fpath).is_file():
        raise ValueError(
            f"backbone {name!r}: its weights file {fpath} is not here; pass --checkpoint_path FILE, "
            "the weights the extraction used (.safetensors or state dict)"
        )
    if not pretrained and fpath is None and weights.get("seed") is None:
        raise ValueError(
            f"backbone {name!r}: random weights whose seed was not recorded; pass --checkpoint_path FILE "
            "with the extraction's weights"
        )
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(weights.get("seed") or 0))
            backbone = load_backbone(name, pretrained=pretrained, checkpoint_path=fpath, layer=int(record["layer"]))
    except RuntimeError as exn:  # a failed download (feature_extraction.backbones.hub)
        raise ValueError(
            f"backbone {name!r}: pretrained weights not available offline ({str(exn).split(':')[0]}); pass "
            "--checkpoint_path FILE (the same weights as a local .safetensors or state dict), or set "
            "HF_HUB_OFFLINE=1 with them in the Hugging Face cache"
        ) from None
    check_weights(backbone, recorded, checkpoint_path, fpath)
    if json.loads(json.dumps(backbone.preprocess_config)) != recorded.get("preprocess"):
        raise ValueError(
            f"backbone {name!r}: its preprocessing now differs from the recorded one ({recorded.get('preprocess')}); "
            "use the library versions that extracted the shards"
        )
    return backbone


def check_weights(backbone: Any, recorded: dict, checkpoint_path: str | None, fpath: str | None) -> None:
    """Refuse weights other than the extraction's (same architecture, other numbers: other tokens).

    A record from before ``weights_sha256`` cannot tell: a ``--checkpoint_path`` then gets one warning.
    """
    from feature_extraction.file_hashes import short_digest

    name, expected = recorded.get("name"), recorded.get("weights_sha256")
    if not expected:
        if checkpoint_path is not None:
            print(
                f"warning: --checkpoint_path {checkpoint_path}: not checked, the SAE's extraction record predates "
                "weights hashes (re-extract and retrain to have it checked)",
                file=sys.stderr,
                flush=True,
            )
        return
    actual = backbone.weights_sha256()
    if actual == expected:
        return
    theirs, ours = short_digest(expected), short_digest(actual)
    if checkpoint_path is not None:
        raise ValueError(
            f"--checkpoint_path {checkpoint_path}: other weights than the extraction's (sha256 {ours}, the extraction "
            f"used {theirs}); pass the weights file the extraction of backbone {name!r} used"
        )
    source = f"the weights file {fpath}" if fpath else "the recorded weights (download or seed)"
    raise ValueError(
        f"backbone {name!r}: {source} are not the extraction's now (sha256 {ours}, the extraction used {theirs}); "
        "pass --checkpoint_path FILE with the extraction's weights"
    )
