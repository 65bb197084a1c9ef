"""Cache a vision backbone's token activations into webdataset shards.

Kept free of Lightning so that extraction nodes need only torch, timm/open_clip and
webdataset.
"""

from feature_extraction.version import __version__

__all__ = ["__version__"]
