"""The features pass as a LightningModule: ``trainer.predict`` streams the data, each rank fills a table.

Why Lightning: the pass then runs wherever ``predict`` runs (one CPU, every GPU of a node,
``srun`` across nodes) with the same ``--trainer.*`` flags and the same data split per rank
(``ActivationDataModule.predict_dataloader``: each rank a contiguous part of the whole
dataset, each token once, with its global ``token_index``). Nothing is returned per batch
(``return_predictions`` is off); the table is the state. At the end of the pass
(``on_predict_end``, every rank) the tables are merged on every rank
(:func:`sae_pipeline.features.merge.gather_merge`; the per-atom label counts of
:mod:`sae_pipeline.features.labels` alongside, from each token's ``labels``, and the activation
distributions of `sae_pipeline.features.distribution`, whose quantile bands are chosen then),
each rank re-reads its share of the top images and of the bands' example images
(:func:`sae_pipeline.features.heatmaps.collect_images`), and rank 0 receives the
shares (``torch.distributed.gather_object``) for the site writer.

The SAE works on raw activations: a checkpoint's input scale is folded into its biases as
``export`` does, so codes are in the units ``predict`` writes.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import Tensor
from tqdm import tqdm

from sae_pipeline.features.distribution import DistributionTable, bands, gather_merge_distribution
from sae_pipeline.features.heatmaps import Layout, collect_images, image_keys, merge_collections
from sae_pipeline.features.labels import LabelCounts
from sae_pipeline.features.merge import gather_merge, gather_merge_labels
from sae_pipeline.features.topn import TopNTable
from sae_pipeline.sae import SparseAutoencoder
from sae_pipeline.sae.sparse_decode import SparseCodes


class FeaturesModule(L.LightningModule):
    """Run ``sae`` over the predict split and keep the per-atom top-``n`` table.

    Args:
        sae: the SAE, on raw activations (input scale folded).
        n: top entries per atom.
        layout: how tokens map to images (:func:`sae_pipeline.features.heatmaps.layout_of`).
        data_dpath: where MNIST lives (its labels), as ``--data.data_dpath``.
    """

    def __init__(self, sae: SparseAutoencoder, n: int, layout: Layout, data_dpath: str = "data") -> None:
        super().__init__()
        self.sae = sae.eval()
        self.n, self.layout, self.data_dpath = int(n), layout, data_dpath
        self.table: TopNTable | None = None
        self.label_counts: LabelCounts | None = None
        self.distribution: DistributionTable | None = None
        self.state: dict[str, Tensor] | None = None
        self.collection: dict[str, Any] | None = None

    def on_predict_start(self) -> None:
        self.trainer.predict_loop.return_predictions = False
        self.table = TopNTable(self.sae.d_sae, self.n, self.device)
        self.label_counts = LabelCounts(self.sae.d_sae, self.layout.tokens_per_image, self.device)
        self.distribution = DistributionTable(self.sae.d_sae, self.device)

    @torch.no_grad()
    def encode(self, x: Tensor) -> tuple[SparseCodes, tuple[Tensor, Tensor] | None]:
        """The codes' non-zero entries (`SparseAutoencoder.encode_sparse`: no ``[B, d_sae]`` codes for the
        k-sparse variants) and, for a pursuit (MP-SAE), the selection order ``(indices, steps)``."""
        if self.sae.is_pursuit:
            indices, coefficients = self.sae.pursuit(x)
            steps = torch.arange(1, indices.shape[1] + 1, device=indices.device)[None, :]
            return self.sae.sparse_from_pursuit(indices, coefficients), (indices, steps)
        return self.sae.encode_sparse(x), None

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        x = batch["x"]
        if not torch.isfinite(x).all():
            raise ValueError(
                f"a batch from shards {list(batch.get('shards', []))} holds NaN/Inf values; "
                "re-extract or drop those shards"
            )
        codes, steps = self.encode(x)
        token = batch["token_index"].to(self.device)
        assert self.table is not None and self.label_counts is not None and codes.values is not None
        image = image_keys(token, self.layout)
        position = batch["token_positions"].to(self.device)
        assert self.distribution is not None
        self.distribution.update(codes.rows, codes.indices, codes.values, token, image, position)
        rows, atoms = self.table.update_entries(
            codes.rows,
            codes.indices,
            codes.values,
            codes.batch_size,
            token,
            image,
            position,
            steps,
        )
        self.label_counts.update(rows, atoms, codes.values, image, batch["labels"].to(self.device))

    def on_predict_end(self) -> None:
        assert self.table is not None
        strategy = self.trainer.strategy
        assert self.label_counts is not None
        self.state = {name: value.cpu() for name, value in gather_merge(self.table, strategy).items()}
        self.state.update({k: v.cpu() for k, v in gather_merge_labels(self.label_counts, strategy).items()})
        assert self.distribution is not None
        distribution = {k: v.cpu() for k, v in gather_merge_distribution(self.distribution, strategy).items()}
        self.state.update({k: v for k, v in distribution.items() if k.startswith("hist_")})
        self.state.update(bands(distribution))
        self.table = self.label_counts = self.distribution = None
        rank, world_size = self.trainer.global_rank, self.trainer.world_size
        d_sae = self.state["token"].shape[0]  # the band examples' images are read with the top images
        shown = {
            key: torch.cat([self.state[key], self.state[f"band_{key}"].reshape(d_sae, -1)], 1)
            for key in ("token", "image")
        }
        n_images = int(torch.unique(shown["image"][shown["token"] >= 0]).numel())
        bar = tqdm(
            total=n_images, desc="top images", unit="img", disable=rank != 0 or n_images == 0, dynamic_ncols=True
        )
        part = collect_images(
            shown,
            self.trainer.datamodule.data_source,
            self.layout,
            lambda x: self.encode(x.to(self.device))[0],
            rank,
            world_size,
            progress=lambda k: bar.update(k * world_size),
            data_dpath=self.data_dpath,
        )
        bar.close()
        if world_size > 1 and dist.is_available() and dist.is_initialized():
            parts: list | None = [None] * world_size if rank == 0 else None
            dist.gather_object(part, parts, dst=0)
            self.collection = merge_collections(parts) if rank == 0 else None
        else:
            self.collection = part


# The pass returns nothing per batch on purpose (the table is the state).
warnings.filterwarnings("ignore", message=r"predict returned None if it was on purpose")
