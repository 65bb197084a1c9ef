"""`encode_sparse`: how an SAE gives its codes at inference as canonical sparse entries.

Training reads codes through `forward` (`sae_pipeline/sae/base.py`); `predict` and `features` read
only the non-zero codes of `encode(x)`, as the canonical entries of `sae_pipeline/sae/inference_codes.py`.
This module is the SAE's side of that: which entries each kind of variant can build without dense
`[B, d_sae]` codes (a pursuit from its selection order, a shallow variant from its support), and
the fallback to the dense codes' non-zeros. It is kept apart from the training contract because
nothing in a training step calls it.

The two mixins are bases of `SparseAutoencoder` and `ShallowSAE`, so `encode_sparse` stays a
method of every variant. They rely on their host class for `encode`, `d_sae`, `is_pursuit` and
`pursuit` (a pursuit), and, for the shallow one, `check_input`, `pre_activations`, `activate` and
`sparse_max_density`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sae_pipeline.sae.inference_codes import from_dense, from_token_lists
from sae_pipeline.sae.sparse_decode import SparseCodes


class SparseInference:
    """`encode_sparse` of every variant: a pursuit's selection order, else the dense codes' non-zeros."""

    @torch.no_grad()
    def encode_sparse(self, x: Tensor) -> SparseCodes:
        """The non-zero codes of ``encode(x)`` as canonical entries (`sae_pipeline/sae/inference_codes.py`),
        what ``predict`` and ``features`` read: from a pursuit's selection order without dense codes, else
        from the dense codes. The shallow variants build them from their support (`ShallowSAE`)."""
        if self.is_pursuit:
            return self.sparse_from_pursuit(*self.pursuit(x))
        return from_dense(self.encode(x))

    def sparse_from_pursuit(self, indices: Tensor, coefficients: Tensor) -> SparseCodes:
        """`codes_from_pursuit` as canonical entries (index -1, a step not taken, carries 0, as there)."""
        return from_token_lists(indices.clamp_min(0), coefficients, self.d_sae)


class ShallowSparseInference(SparseInference):
    """`encode_sparse` of the shallow variants: one encoder pass, then the entries a variant can read off
    its pre-activations (`inference_entries`: TopK's top k, BatchTopK's threshold) or the dense codes'."""

    def inference_entries(self, pre: Tensor) -> SparseCodes | None:
        """The non-zero codes of ``activate(pre, None)`` as canonical entries, without dense codes; None
        where the variant has no such path (then `encode_sparse` reads them off the dense codes). May
        overwrite ``pre`` (no graph; it is not used again) when it returns entries."""
        return None

    @torch.no_grad()
    def encode_sparse(self, x: Tensor) -> SparseCodes:
        """As `SparseAutoencoder.encode_sparse`, from `inference_entries` where the variant has it and
        ``sparse_max_density`` > 0 (0 forces the dense codes, as for forward)."""
        self.check_input(x)
        pre = self.pre_activations(x)
        codes = self.inference_entries(pre) if self.sparse_max_density > 0 else None
        return codes if codes is not None else from_dense(self.activate(pre, None))
