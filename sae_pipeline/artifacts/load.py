"""``load_sae(DIR)``: an exported SAE back as a module, whichever format the folder holds.

Every ``--sae DIR`` (``features``, ``evaluate sae``, the studies) and users' own code load through
here, so both formats are accepted everywhere: the native export (``config.json`` +
``sae.safetensors``, :func:`sae_pipeline.artifacts.export.load_native`) and a SAELens directory
(``cfg.json`` + ``sae_weights.safetensors``, :func:`sae_pipeline.artifacts.saelens_load.load_saelens`,
which builds our equivalent module). Neither reader imports what the folder names
(`sae_pipeline.sae.config`). The folder ``export`` fills with a group's members (one export per
member, ``DIR/NAME``) holds no export itself: it is refused naming the member folders to pass instead.
"""

from __future__ import annotations

from pathlib import Path

import torch

from sae_pipeline.artifacts.export import load_native
from sae_pipeline.artifacts.export_files import CONFIG_FNAME, SAELENS_CFG_FNAME, export_format
from sae_pipeline.artifacts.saelens_load import load_saelens
from sae_pipeline.sae import SparseAutoencoder
from sae_pipeline.sae.config import ExportError

__all__ = ["load_sae"]


def load_sae(dpath: Path | str, map_location: str | torch.device = "cpu") -> SparseAutoencoder:
    """The SAE exported in ``dpath``, in eval mode, taking raw activations (the input scale is folded in).

    A native export (``config.json`` + ``sae.safetensors``) or a SAELens directory (``cfg.json`` +
    ``sae_weights.safetensors``); a folder that holds neither, or a damaged one, raises a one-line
    :class:`~sae_pipeline.sae.config.ExportError` naming the file and the fix.
    """
    if export_format(dpath) == "saelens":
        return load_saelens(dpath, map_location)
    if not (Path(dpath) / CONFIG_FNAME).exists() and (members := _member_exports(dpath)):
        raise ExportError(
            f"{dpath}: holds no export but {len(members)} in its folders {', '.join(members)} (a group's members, "
            f"as export writes them without --name); pass one of them, e.g. {Path(dpath) / members[0]}"
        )
    return load_native(dpath, map_location)


def _member_exports(dpath: Path | str) -> list[str]:
    """The sub-folders of ``dpath`` that hold an export (either format), sorted by name."""
    dpath = Path(dpath)
    if not dpath.is_dir():
        return []
    return sorted(
        sub.name
        for sub in dpath.iterdir()
        if sub.is_dir() and ((sub / CONFIG_FNAME).is_file() or (sub / SAELENS_CFG_FNAME).is_file())
    )
