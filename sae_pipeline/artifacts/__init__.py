"""What training leaves behind and other programs read: checkpoints, exported SAEs, codes files.

The public API, importable from here::

    from sae_pipeline.artifacts import load_sae, read_codes, export_checkpoint

- :mod:`.checkpoint`: the one reader of ``fit``'s checkpoints (every command's ``--ckpt_path``).
- :mod:`.export`: the native export (``sae.safetensors`` + ``config.json``) and the ``export`` command.
- :mod:`.saelens_export`: SAELens 6's format written (`export --format saelens`), with the MP-SAE check in
  :mod:`.saelens_probe`; :mod:`.saelens_load`: a SAELens directory read back.
- :mod:`.export_files`: what the two formats share (file names, whole-or-nothing writes).
- :mod:`.load`: :func:`load_sae`, either format back as a module.
- :mod:`.codes`: the HDF5 codes file ``predict`` writes.

This package sits above :mod:`sae_pipeline.sae` and :mod:`sae_pipeline.data` (and ``feature_extraction``)
and below training and the commands.
"""

from sae_pipeline.artifacts.checkpoint import CheckpointError, read_checkpoint, sae_from_checkpoint
from sae_pipeline.artifacts.codes import read_codes
from sae_pipeline.artifacts.export import export_checkpoint
from sae_pipeline.artifacts.load import load_sae
from sae_pipeline.artifacts.saelens_export import export_checkpoint_saelens
from sae_pipeline.sae.config import ExportError

__all__ = [
    "CheckpointError",
    "ExportError",
    "export_checkpoint",
    "export_checkpoint_saelens",
    "load_sae",
    "read_checkpoint",
    "read_codes",
    "sae_from_checkpoint",
]
