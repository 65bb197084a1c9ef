"""Shared test settings: small thread counts keep the suite stable on a 2-core machine."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

torch.set_num_threads(2)

REPO_DPATH = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def reference_dictionary_fpath() -> Path:
    """The paper authors' released MNIST MP-SAE, shipped inside the package."""
    from sae_pipeline.evaluate.external import REFERENCE_NPZ_FPATH

    assert REFERENCE_NPZ_FPATH.is_file(), f"missing {REFERENCE_NPZ_FPATH}: it ships with the package"
    return REFERENCE_NPZ_FPATH
