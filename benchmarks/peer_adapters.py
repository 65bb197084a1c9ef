"""One training step of each contender in benchmarks/peers.py, behind one small interface.

A :class:`Contender` owns a model started from *our* SAE's weights (so every contender begins
from the same dictionary, encoder and biases) and from our dead-latent set (each library's own
firing bookkeeping counts the same latents dead), an Adam with the same settings for all
(``torch.optim.Adam(lr, fused=True)``: the optimiser is not what is compared), and:

- ``step(x)``: what the library's own training loop does per step: zero grads, its training
  forward and loss, its firing bookkeeping, backward, its decoder-norm maintenance, Adam;
- ``forward(x) -> (codes [B, d_sae] dense, x_hat)`` for the equality check, and ``grads(x)``:
  gradients of the common loss ``mean((x_hat − x)²)`` in our names (``W_enc [d_in, d_sae]``,
  ``b_enc``, ``W_dec`` with its parallel component removed, ``b_pre``; MP-SAE has no encoder);
- ``kept_bytes()``: scratch the contender keeps between steps besides its parameters and
  optimiser state (our MP-SAE's :class:`Workspace`), counted in its memory;
- ``dead_mask()``: the latents its own bookkeeping counts dead now, None where its step has no
  AuxK (the table's "dead" column).

This module holds the interface and ours (:class:`Ours`); each peer's adapter is a module of its own:
benchmarks/peer_saelens.py (SAELens, and SAELens compiled), benchmarks/peer_overcomplete.py,
benchmarks/peer_sparsify.py and benchmarks/peer_dictionary_learning.py; the registry of all of them is in
benchmarks/peers.py. The peers are imported lazily (the ``bench`` extra: ``pip install -e ".[bench]"``); a
missing one is reported and skipped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.fit_hooks import FitHooks
from sae_pipeline.sae import SparseAutoencoder, TopKSAE
from sae_pipeline.sae.mp_autograd import Workspace

LR = 5e-4
SPARSITY_COEFFICIENT = 1e-3  # λ of ReLU's L1 and JumpReLU's L0, the same for every library
AUXK_VARIANTS = ("topk", "batchtopk", "matryoshka")  # ours: TopKSAE and its subclasses
DEAD_AFTER = 10_000_000  # the peers' firing counters: a latent is dead beyond it (their units: tokens or steps)


def make_adam(module: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam([p for p in module.parameters() if p.requires_grad], lr=LR, fused=True)


def project_out_parallel(grad: Tensor, W_dec: Tensor) -> Tensor:
    """``grad`` without its component along each row of ``W_dec`` (what every library's update keeps)."""
    W = W_dec.detach()
    return grad - ((grad * W).sum(1, keepdim=True) / (W * W).sum(1, keepdim=True)) * W


class Contender:
    library = "?"
    #: Untimed steps before the first timed round at least (a compiled step compiles in them).
    min_warmup = 0

    def __init__(self, variant: str, template: SparseAutoencoder, batch_size: int, k: int) -> None:
        self.variant, self.batch_size, self.k = variant, batch_size, k
        self.model = self.build(template)
        self.optimizer = self.make_optimizer()
        dead = template.dead_mask()
        if bool(dead.any()):
            self.mark_dead(dead.to(template.W_dec.device))

    @property
    def name(self) -> str:
        return f"{self.library} {self.variant}"

    @classmethod
    def has_pre_bias(cls, variant: str) -> bool:
        """Whether the library's SAE subtracts a pre-bias from the input as ours does (``x − b_pre``); where it
        does not, the equality check compares with ``b_pre = 0`` and leaves ``b_pre``'s gradient out."""
        return True

    def build(self, template: SparseAutoencoder) -> nn.Module:
        raise NotImplementedError

    def make_optimizer(self) -> torch.optim.Optimizer:
        return make_adam(self.model)

    def mark_dead(self, dead: Tensor) -> None:
        """Count the latents of ``dead`` (bool ``[d_sae]``) dead in the library's own firing bookkeeping."""

    def dead_mask(self) -> Tensor | None:
        """The latents the library's bookkeeping counts dead now; None where its step has no AuxK."""
        return None

    def kept_bytes(self) -> int:
        return 0

    def step(self, x: Tensor) -> None:
        raise NotImplementedError

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def named_grads(self) -> dict[str, Tensor | None]:
        raise NotImplementedError

    def grads(self, x: Tensor) -> dict[str, Tensor]:
        self.optimizer.zero_grad(set_to_none=True)
        _, x_hat = self.forward(x)
        F.mse_loss(x_hat, x).backward()
        grads = {name: g.detach().clone() for name, g in self.named_grads().items() if g is not None}
        grads["W_dec"] = project_out_parallel(grads["W_dec"], self.W_dec())
        self.optimizer.zero_grad(set_to_none=True)
        return grads

    def W_dec(self) -> Tensor:
        raise NotImplementedError


# --- ours -------------------------------------------------------------------------------------
class Ours(Contender):
    """Our SAE, stepped as ``SAEModule`` steps it, its host-side hooks included (`benchmarks.fit_hooks`: TopK's
    AuxK plan, so that on a GPU AuxK costs nothing while no latent is dead). Its dead latents are the template's."""

    library = "ours"

    def build(self, template: SparseAutoencoder) -> nn.Module:
        import copy

        sae = copy.deepcopy(template).train()
        self.hooks = FitHooks(sae)
        return sae

    def dead_mask(self) -> Tensor | None:
        return self.model.dead_mask() if isinstance(self.model, TopKSAE) else None

    def kept_bytes(self) -> int:
        workspaces = [m.workspace for m in self.model.modules() if isinstance(getattr(m, "workspace", None), Workspace)]
        return sum(t.untyped_storage().nbytes() for w in workspaces for t in w.tensors.values())

    def step(self, x: Tensor) -> None:
        sae = self.model
        with self.hooks.step():
            self.optimizer.zero_grad(set_to_none=True)
            output = sae(x)
            sae.loss(x, output).loss.backward()
            sae.record_firing(output.fired(), x.shape[0])
            sae.remove_parallel_grad()
            self.optimizer.step()
            sae.normalize_atoms()

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        output = self.model(x)
        return output.codes, output.x_hat

    def named_grads(self) -> dict[str, Tensor | None]:
        names = ("W_dec", "b_pre") if self.variant == "mpsae" else ("W_enc", "b_enc", "W_dec", "b_pre")
        return {n: self.model.get_parameter(n).grad for n in names}

    def W_dec(self) -> Tensor:
        return self.model.W_dec
