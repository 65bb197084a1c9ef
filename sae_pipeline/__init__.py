"""Train and evaluate sparse autoencoders on vision-model token activations."""

from feature_extraction.version import __version__  # one version for both packages (pyproject.toml)

__all__ = ["__version__"]
