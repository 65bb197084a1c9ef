"""Cache a vision backbone's token activations into webdataset shards.

Kept free of Lightning so that extraction nodes need only torch, timm/open_clip and
webdataset.
"""

__version__ = "0.1.0"
