"""The public Python API imports from the places the docs name, and ``load_sae`` reads both export formats.

docs/reference/api.md renders its ``:::`` entries with mkdocstrings and docs/training.md shows the
import lines users copy; each documented package lists its public names in ``__all__``. An export
in either format, loaded with the one ``load_sae``, encodes raw activations as the trained module
encodes them scaled (codes back in raw units).
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from test_export import raw_data, trained_checkpoint

REPO_DPATH = Path(__file__).resolve().parents[1]
PUBLIC = {
    "sae_pipeline.artifacts": [
        "CheckpointError",
        "ExportError",
        "export_checkpoint",
        "export_checkpoint_saelens",
        "load_sae",
        "read_checkpoint",
        "read_codes",
    ],
    "sae_pipeline.sae": [
        "BatchTopKSAE",
        "JumpReLUSAE",
        "MatchingPursuitSAE",
        "MatryoshkaBatchTopKSAE",
        "OMPSAE",
        "ReLUSAE",
        "SparseAutoencoder",
        "TopKSAE",
        "get_sae_class",
    ],
    "sae_pipeline.data": ["ActivationDataModule", "validation_tokens"],
    "feature_extraction.shards": ["decode_sample", "iter_shard_samples", "iter_shard_tokens", "load_manifest"],
}


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_public_names_import_from_their_package(package: str) -> None:
    module = importlib.import_module(package)
    exported = set(module.__all__)
    assert set(PUBLIC[package]) <= exported, sorted(set(PUBLIC[package]) - exported)
    assert [name for name in module.__all__ if not hasattr(module, name)] == []  # __all__ names only what is there


def resolve(dotted: str) -> tuple[Any, str]:
    """The object a ``:::`` entry names and the module it is taken from (longest importable prefix)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj, ".".join(parts[:cut])
    raise AssertionError(f"{dotted}: nothing of it imports")


API_ENTRIES = re.findall(
    r"^::: (\S+)", (REPO_DPATH / "docs" / "reference" / "api.md").read_text(encoding="utf-8"), re.M
)


@pytest.mark.parametrize("entry", API_ENTRIES)
def test_api_page_names_objects_where_users_import_them(entry: str) -> None:
    obj, module_name = resolve(entry)
    if not inspect.ismodule(obj):
        module = importlib.import_module(module_name)
        assert entry == f"{module_name}.{entry.rpartition('.')[2]}" and entry.rpartition(".")[2] in module.__all__, (
            f"{entry}: document it where its package exports it (in __all__)"
        )


def test_api_page_lists_the_loading_api_from_its_package() -> None:
    assert {
        "sae_pipeline.artifacts.load_sae",
        "sae_pipeline.artifacts.read_codes",
        "sae_pipeline.artifacts.export_checkpoint",
    } <= set(API_ENTRIES)


@pytest.mark.parametrize("name", ["topk", "jumprelu"])
def test_load_sae_reads_native_and_saelens_exports_as_the_trained_sae(name: str, tmp_path: Path) -> None:
    from sae_pipeline.artifacts import export_checkpoint, export_checkpoint_saelens, load_sae

    module, ckpt_fpath = trained_checkpoint(name, tmp_path)
    scale = float(module.input_scale)
    native = load_sae(export_checkpoint(ckpt_fpath, tmp_path / "native"))
    saelens = load_sae(export_checkpoint_saelens(ckpt_fpath, tmp_path / "saelens"))
    assert type(native) is type(module.sae) and type(saelens) is type(module.sae)
    x = raw_data(64, seed=5)
    with torch.no_grad():
        expected = module.sae.encode(module.preprocess(x)) / scale  # trained on scaled inputs, back in raw units
        assert (expected != 0).any()
        for sae in (native, saelens):
            torch.testing.assert_close(sae.encode(x), expected, rtol=1e-4, atol=1e-3)
