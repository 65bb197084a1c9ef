"""Shared test settings: small thread counts keep the suite stable on a 2-core machine."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

torch.set_num_threads(2)

REPO_DPATH = Path(__file__).resolve().parents[1]
REFERENCE_DPATH = REPO_DPATH.parent / "shared" / "reference"


@pytest.fixture(scope="session")
def reference_dictionary_fpath() -> Path:
    """The paper authors' released MNIST MP-SAE (CI clones the repo with shared/ beside it)."""
    fpath = REFERENCE_DPATH / "mpsae_mnist_p1000_k10.npz"
    if not fpath.exists():
        pytest.fail(f"missing {fpath}: the reference dictionary ships in shared/reference beside the repo")
    return fpath
