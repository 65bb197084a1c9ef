"""EleutherAI sparsify as a contender of benchmarks/peers.py: its ``SparseCoder`` stepped as its ``Trainer`` steps
it. The interface is benchmarks/peer_adapters.py's :class:`Contender`; sparsify is imported lazily (the
``bench`` extra).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn

from benchmarks.peer_adapters import DEAD_AFTER, Contender
from sae_pipeline.sae import SparseAutoencoder


class Sparsify(Contender):
    """EleutherAI sparsify's ``SparseCoder`` (TopK only), stepped as its ``Trainer`` does: FVU +
    AuxK (on dead latents), gradient parallel to the atoms removed, unit-norm atoms after Adam.
    On a CPU its decoder is ``F.embedding_bag`` (Triton off) and its encoder backward an
    ``index_add_`` over the top-k columns; on CUDA its own Triton kernels, as its trainer runs there
    (``SPARSIFY_DISABLE_TRITON`` is read once, at import: benchmarks/peers.py sets it for a CPU run only).

    ``SparseCoder.forward`` carries its own ``torch.autocast("cuda", bfloat16)`` decorator: on a GPU it
    always runs in bf16, whatever its caller asks. Called as such, it was the one peer that "differed"
    (3.9e-01) and ran 2.7x faster in the float32 table of an H200 (2026-11-28): a bf16 step against
    float32 ones. So the forward below is the undecorated function under the caller's autocast state:
    float32 in the float32 table, bf16 with everyone else's under ``--autocast``, which is its decorator's
    setting ("improves performance by almost 2x", its comment says): its fastest, as it trains on a GPU."""

    library = "sparsify"

    def build(self, template: SparseAutoencoder) -> nn.Module:
        device = template.W_dec.device
        if device.type == "cpu":
            os.environ.setdefault("SPARSIFY_DISABLE_TRITON", "1")
        from sparsify import SparseCoder, SparseCoderConfig

        coder = SparseCoder(
            template.d_in, SparseCoderConfig(num_latents=template.d_sae, k=self.k), device=device, dtype=torch.float32
        )
        with torch.no_grad():
            coder.encoder.weight.copy_(template.W_enc.T)
            coder.encoder.bias.copy_(template.b_enc)
            coder.W_dec.copy_(template.W_dec)
            coder.b_dec.copy_(template.b_pre)
        self.since_fired = torch.zeros(template.d_sae, dtype=torch.long, device=device)
        forward = type(coder).forward
        self.run = getattr(forward, "__wrapped__", forward).__get__(coder)  # without its own autocast
        return coder.train()

    def mark_dead(self, dead: Tensor) -> None:
        self.since_fired[dead] = DEAD_AFTER + 1

    def dead_mask(self) -> Tensor | None:
        return self.since_fired > DEAD_AFTER

    def step(self, x: Tensor) -> None:
        coder = self.model
        self.optimizer.zero_grad(set_to_none=True)
        out = self.run(x, dead_mask=self.since_fired > DEAD_AFTER)
        (out.fvu + out.auxk_loss / 32).backward()
        with torch.no_grad():  # Trainer's firing bookkeeping
            self.since_fired += x.shape[0]
            self.since_fired[out.latent_indices.flatten()] = 0
        coder.remove_gradient_parallel_to_decoder_directions()
        self.optimizer.step()
        coder.set_decoder_norm_to_unit_norm()

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        out = self.run(x)
        codes = torch.zeros(x.shape[0], self.model.num_latents, dtype=out.latent_acts.dtype, device=x.device)
        codes = codes.scatter(1, out.latent_indices, out.latent_acts)
        return codes, out.sae_out

    def named_grads(self) -> dict[str, Tensor | None]:
        c = self.model
        W_enc = None if c.encoder.weight.grad is None else c.encoder.weight.grad.T
        return {"W_enc": W_enc, "b_enc": c.encoder.bias.grad, "W_dec": c.W_dec.grad, "b_pre": c.b_dec.grad}

    def W_dec(self) -> Tensor:
        return self.model.W_dec
