"""SAELens as a contender of benchmarks/peers.py: its training SAEs stepped as its trainer steps them, and the same
with its runner's ``compile_sae`` (``torch.compile`` of the training forward). The interface is
benchmarks/peer_adapters.py's :class:`Contender`; SAELens is imported lazily (the ``bench`` extra).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks.peer_adapters import AUXK_VARIANTS, DEAD_AFTER, SPARSITY_COEFFICIENT, Contender
from sae_pipeline.sae import JumpReLUSAE, MatryoshkaBatchTopKSAE, SparseAutoencoder


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
