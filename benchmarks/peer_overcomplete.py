"""overcomplete as a contender of benchmarks/peers.py: its SAEs trained as its ``train_sae`` does. The interface is
benchmarks/peer_adapters.py's :class:`Contender`; overcomplete is imported lazily (the ``bench`` extra).
overcomplete imports ``matplotlib.cm.get_cmap``, which matplotlib 3.9 removed: :func:`import_overcomplete`
restores it for that import only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks.peer_adapters import SPARSITY_COEFFICIENT, Contender
from sae_pipeline.sae import JumpReLUSAE, SparseAutoencoder


def import_overcomplete() -> Any:
    import matplotlib
    import matplotlib.cm

    if not hasattr(matplotlib.cm, "get_cmap"):
        matplotlib.cm.get_cmap = matplotlib.colormaps.get_cmap  # removed in matplotlib 3.9
    import overcomplete.sae

    return overcomplete.sae


class Overcomplete(Contender):
    """overcomplete's SAEs with their default linear encoder, trained as ``train_sae`` does, as shipped (its
    ``train_sae_amp`` is float16 with a gradient scaler; under ``--autocast`` its step runs in everyone's bf16).

    overcomplete has no pre-bias: ``pre = x W + b``, ``x_hat = z D`` (so the equality check sets
    our ``b_pre`` to 0), and it renormalises the dictionary inside every training forward.
    Criterion: the MSE (TopK, BatchTopK: its ``top_k_auxiliary_loss`` is another definition,
    an AuxK over the top half of the unselected latents at every step), so its TopK family has no AuxK
    and no dead-latent bookkeeping: the table's "no AuxK"; ``mse_l1`` for ReLU;
    MSE + λ·L0 through its ``heaviside`` straight-through function for JumpReLU (rectangle kernel).
    BatchTopK's ``top_k`` counts over the batch: B·k. MP-SAE is ``MpSAE`` (identity encoder, k
    steps, signed argmax, an atom may be picked again: our definition, without b_pre), trained on
    the MSE; each step runs a dense correlation matmul and a dense one-hot decode, both under autograd.
    """

    library = "overcomplete"

    @classmethod
    def has_pre_bias(cls, variant: str) -> bool:
        return False

    def build(self, template: SparseAutoencoder) -> nn.Module:
        oc = import_overcomplete()
        d_in, d_sae = template.d_in, template.d_sae
        device = template.W_dec.device  # overcomplete keeps it and allocates its codes there in every forward
        if self.variant == "mpsae":
            model = oc.MpSAE(d_in, d_sae, k=self.k, device=str(device)).to(template.W_dec.dtype)
            with torch.no_grad():
                model.dictionary._weights.copy_(template.W_dec)
            self.criterion: Callable[..., Tensor] = lambda x, x_hat, z_pre, z, D: (x - x_hat).square().mean()
            self.since_fired = torch.zeros(d_sae, device=device)
            return model.train()
        on = str(device)
        if self.variant == "topk":
            model = oc.TopKSAE(d_in, d_sae, top_k=self.k, device=on)
        elif self.variant == "batchtopk":
            model = oc.BatchTopKSAE(d_in, d_sae, top_k=self.k * self.batch_size, device=on)
        elif self.variant == "jumprelu":
            assert isinstance(template, JumpReLUSAE)
            model = oc.JumpSAE(d_in, d_sae, kernel="rectangle", bandwidth=template.bandwidth, device=on)
        else:
            model = oc.SAE(d_in, d_sae, device=on)
        linear = model.encoder.final_block[0]
        with torch.no_grad():
            linear.weight.copy_(template.W_enc.T)
            linear.bias.copy_(template.b_enc)  # no b_pre: see above
            model.dictionary._weights.copy_(template.W_dec)
            if self.variant == "jumprelu":
                model.thresholds.copy_(template.log_threshold)
        if self.variant == "relu":
            self.criterion = lambda x, x_hat, z_pre, z, D: oc.losses.mse_l1(
                x, x_hat, z_pre, z, D, penalty=SPARSITY_COEFFICIENT
            )
        elif self.variant == "jumprelu":

            def criterion(x: Tensor, x_hat: Tensor, z_pre: Tensor, z: Tensor, D: Tensor) -> Tensor:
                steps = oc.heaviside(torch.relu(z_pre), torch.exp(model.thresholds), model.kernel_fn, model.bandwidth)
                return (x - x_hat).square().mean() + SPARSITY_COEFFICIENT * steps.sum(-1).mean()

            self.criterion = criterion
        else:
            self.criterion = lambda x, x_hat, z_pre, z, D: (x - x_hat).square().mean()
        self.since_fired = torch.zeros(d_sae, device=device)
        return model.train()

    def step(self, x: Tensor) -> None:
        model = self.model
        self.optimizer.zero_grad(set_to_none=True)
        z_pre, z, x_hat = model(x)
        loss = self.criterion(x, x_hat, z_pre, z, model.get_dictionary())
        with torch.no_grad():  # train_sae's DeadCodeTracker
            self.since_fired[(z > 0).any(0)] = 0
        loss.backward()
        self.optimizer.step()

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        _, z, x_hat = self.model(x)
        return z, x_hat

    def named_grads(self) -> dict[str, Tensor | None]:
        if self.variant == "mpsae":
            return {"W_dec": self.model.dictionary._weights.grad}
        linear = self.model.encoder.final_block[0]
        W_enc = None if linear.weight.grad is None else linear.weight.grad.T
        return {"W_enc": W_enc, "b_enc": linear.bias.grad, "W_dec": self.model.dictionary._weights.grad}

    def W_dec(self) -> Tensor:
        return self.model.dictionary._weights
