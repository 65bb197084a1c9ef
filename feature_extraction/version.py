"""The project's one version number: ``[project] version`` of ``pyproject.toml``.

Read once, through the installed distribution's metadata (``importlib.metadata``), and exported
as ``feature_extraction.__version__`` and ``sae_pipeline.__version__``: a release bumps one line
of ``pyproject.toml`` and every artifact that records a version (shard manifests, checkpoints,
exports, the feature site) follows. An uninstalled checkout (``PYTHONPATH=.``, a copied tree)
has no metadata; it reads the ``pyproject.toml`` beside the package instead, and says
``0+unknown`` when there is none rather than failing to import.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

DIST_NAME = "sae-pipeline"
UNKNOWN = "0+unknown"
PYPROJECT_FPATH = Path(__file__).resolve().parents[1] / "pyproject.toml"


def read_version(dist_name: str = DIST_NAME, pyproject_fpath: Path = PYPROJECT_FPATH) -> str:
    """The installed distribution's version, else the checkout's ``pyproject.toml``, else ``0+unknown``."""
    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        pass
    try:
        import tomllib
    except ImportError:  # Python 3.10: the tomli backport, a dependency there
        import tomli as tomllib
    try:
        with open(pyproject_fpath, "rb") as f:
            return str(tomllib.load(f)["project"]["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return UNKNOWN


__version__ = read_version()
