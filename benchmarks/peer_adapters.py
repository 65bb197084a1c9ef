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

The peers are imported lazily (the ``bench`` extra: ``pip install -e ".[bench]"``); a missing
one is reported and skipped. overcomplete imports ``matplotlib.cm.get_cmap``, which
matplotlib 3.9 removed: the shim below restores it for that import only. dictionary_learning's
adapter is in benchmarks/peer_dictionary_learning.py; the registry of all of them, in benchmarks/peers.py.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.fit_hooks import FitHooks
from sae_pipeline.sae import JumpReLUSAE, MatryoshkaBatchTopKSAE, SparseAutoencoder, TopKSAE
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


# --- SAELens -----------------------------------------------------------------------------------
class SAELens(Contender):
    """SAELens 6 training SAEs, stepped as ``SAETrainer._train_step`` does (without its gradient
    clipping, which only dictionary_learning's trainers share). TopK, BatchTopK and Matryoshka rescale the
    codes by the decoder norms (their default; 1 here, the atoms being unit-norm). Matryoshka is
    ``MatryoshkaBatchTopKTrainingSAE`` with our prefix widths (``matryoshka_widths``): the same BatchTopK
    codes, one inner MSE per inner width. AuxK (TopK family) runs while its dead mask is not empty.

    MP-SAE is ``matching_pursuit`` with our definition's settings (docs/formats.md): k steps
    (``max_iterations``), no early stop (``residual_threshold = 0``,
    ``stop_on_duplicate_support = False``). It still takes ``argmax relu(<r, d>)`` and clips the
    coefficient at zero where ours takes the signed argmax: the two coincide while every step's
    best correlation is positive, which the equality check verifies first. Its pursuit runs a
    dense correlation matmul per step (no grad) and its codes are a dense ``[B, d_sae]`` tensor
    decoded by a dense matmul."""

    library = "SAELens"

    def build(self, template: SparseAutoencoder) -> nn.Module:
        import sae_lens

        dtype = str(template.W_dec.dtype).removeprefix("torch.")
        device = template.W_dec.device
        common: dict[str, Any] = dict(d_in=template.d_in, d_sae=template.d_sae, dtype=dtype, device=str(device))
        if self.variant == "mpsae":
            from sae_lens import MatchingPursuitTrainingSAE, MatchingPursuitTrainingSAEConfig

            config = MatchingPursuitTrainingSAEConfig(
                max_iterations=self.k, residual_threshold=0.0, stop_on_duplicate_support=False, **common
            )
            sae = MatchingPursuitTrainingSAE(config)
            with torch.no_grad():
                sae.W_dec.copy_(template.W_dec)
                sae.b_dec.copy_(template.b_pre)
            self.coefficients = {}
            self.since_fired = torch.zeros(template.d_sae, device=device)
            return sae.train()
        if self.variant == "topk":
            sae = sae_lens.TopKTrainingSAE(sae_lens.TopKTrainingSAEConfig(k=self.k, **common))
        elif self.variant == "batchtopk":
            sae = sae_lens.BatchTopKTrainingSAE(sae_lens.BatchTopKTrainingSAEConfig(k=self.k, **common))
        elif self.variant == "matryoshka":
            assert isinstance(template, MatryoshkaBatchTopKSAE)
            config = sae_lens.MatryoshkaBatchTopKTrainingSAEConfig(
                k=self.k, matryoshka_widths=list(template.prefix_widths), **common
            )
            sae = sae_lens.MatryoshkaBatchTopKTrainingSAE(config)
        elif self.variant == "jumprelu":
            assert isinstance(template, JumpReLUSAE)
            sae = sae_lens.JumpReLUTrainingSAE(
                sae_lens.JumpReLUTrainingSAEConfig(
                    jumprelu_bandwidth=template.bandwidth, l0_coefficient=SPARSITY_COEFFICIENT, **common
                )
            )
        else:
            sae = sae_lens.StandardTrainingSAE(
                sae_lens.StandardTrainingSAEConfig(l1_coefficient=SPARSITY_COEFFICIENT, **common)
            )
        with torch.no_grad():
            sae.W_enc.copy_(template.W_enc)
            sae.b_enc.copy_(template.b_enc)
            sae.W_dec.copy_(template.W_dec)
            sae.b_dec.copy_(template.b_pre)
            if self.variant == "jumprelu":
                sae.threshold.copy_(template.threshold)
        self.coefficients = {name: c.value if hasattr(c, "value") else c for name, c in sae.get_coefficients().items()}
        self.since_fired = torch.zeros(template.d_sae, device=device)
        return sae.train()

    @property
    def training_forward(self) -> Callable[..., Any]:
        """The training forward its runner calls (`SAELensCompiled`: through ``torch.compile``)."""
        return self.model.training_forward_pass

    def mark_dead(self, dead: Tensor) -> None:
        self.since_fired[dead] = DEAD_AFTER + 1

    def dead_mask(self) -> Tensor | None:
        return self.since_fired > DEAD_AFTER if self.variant in AUXK_VARIANTS else None

    def step(self, x: Tensor) -> None:
        from sae_lens.saes.sae import TrainStepInput

        self.optimizer.zero_grad(set_to_none=True)
        out = self.training_forward(
            TrainStepInput(
                sae_in=x,
                coefficients=self.coefficients,
                dead_neuron_mask=self.since_fired > DEAD_AFTER,
                n_training_steps=0,
                is_logging_step=False,
            )
        )
        with torch.no_grad():  # SAETrainer's firing bookkeeping
            did_fire = out.feature_acts.bool().float().sum(-2).bool()
            self.since_fired += 1
            self.since_fired[did_fire] = 0
        out.loss.backward()
        self.optimizer.step()

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        codes, _ = self.model.encode_with_hidden_pre(x)
        return codes, self.model.decode(codes)

    def named_grads(self) -> dict[str, Tensor | None]:
        m = self.model
        if self.variant == "mpsae":  # tied: its W_enc is W_decᵀ
            return {"W_dec": m.W_dec.grad, "b_pre": m.b_dec.grad}
        return {"W_enc": m.W_enc.grad, "b_enc": m.b_enc.grad, "W_dec": m.W_dec.grad, "b_pre": m.b_dec.grad}

    def W_dec(self) -> Tensor:
        return self.model.W_dec


class SAELensCompiled(SAELens):
    """SAELens with its runner's ``compile_sae=True``: the training forward through ``torch.compile`` (inductor,
    ``sae_compilation_mode`` None: torch's default mode), as ``LanguageModelSAETrainingRunner`` wraps it; the
    rest of the step (firing bookkeeping, backward, Adam) as :class:`SAELens`. The first steps compile (the
    graphs around its host read of the dead count, for the branch the step takes): they are the untimed warm-up
    (at least ``min_warmup``), so its figures are after compilation. Dynamo's recompile limit is raised: each
    contender is a new module (one compile each), which the default limit of 8 per function would turn back
    into eager steps."""

    library = "SAELens+compile"
    min_warmup = 3

    def build(self, template: SparseAutoencoder) -> nn.Module:
        import torch._dynamo

        logging.getLogger("torch._dynamo").setLevel(logging.ERROR)  # its graph breaks (host reads) by name, per step
        for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 256))
        sae = super().build(template)
        self.compiled = torch.compile(sae.training_forward_pass, mode=None, backend="inductor")
        return sae

    @property
    def training_forward(self) -> Callable[..., Any]:
        return self.compiled


# --- overcomplete ------------------------------------------------------------------------------
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


# --- sparsify ----------------------------------------------------------------------------------
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
