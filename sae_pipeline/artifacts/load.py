"""``load_sae(DIR)``: an exported SAE back as a module, whichever format the folder holds.

Every ``--sae DIR`` (``features``, ``evaluate sae``, the studies) and users' own code load through
here, so both formats are accepted everywhere: the native export (``config.json`` +
``sae.safetensors``, :func:`sae_pipeline.artifacts.export.load_native`) and a SAELens directory
(``cfg.json`` + ``sae_weights.safetensors``, :func:`sae_pipeline.artifacts.saelens.load_saelens`,
which builds our equivalent module). Neither reader imports what the folder names
(:mod:`sae_pipeline.sae.config`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from sae_pipeline.artifacts.export import load_native
from sae_pipeline.artifacts.export_files import export_format
from sae_pipeline.artifacts.saelens import load_saelens
from sae_pipeline.sae import SparseAutoencoder

__all__ = ["load_sae"]


def load_sae(dpath: Path | str, map_location: str | torch.device = "cpu") -> SparseAutoencoder:
    """The SAE exported in ``dpath``, in eval mode, taking raw activations (the input scale is folded in).

    A native export (``config.json`` + ``sae.safetensors``) or a SAELens directory (``cfg.json`` +
    ``sae_weights.safetensors``); a folder that holds neither, or a damaged one, raises a one-line
    :class:`~sae_pipeline.sae.config.ExportError` naming the file and the fix.
    """
    if export_format(dpath) == "saelens":
        return load_saelens(dpath, map_location)
    return load_native(dpath, map_location)
