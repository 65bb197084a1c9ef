"""saprmarks's ``dictionary_learning`` (PyPI ``dictionary-learning``) as a contender of benchmarks/peers.py.

Each variant is its trainer (``TopKTrainer``, ``BatchTopKTrainer``, ``MatryoshkaBatchTopKTrainer``,
``JumpReluTrainer``, ``StandardTrainer`` for ReLU), built with our shape and learning rate, its SAE's weights
replaced by ours, and stepped by its own ``update(step, x)``, which is what its ``trainSAE`` loop calls per
batch: its loss (the MSE summed over d_in; AuxK on dead latents for the TopK family, its firing bookkeeping),
backward, gradient parallel to the atoms removed, Adam, its learning-rate schedule, unit-norm atoms; all but
ReLU's also clip the gradient norm at 1 and return ``loss.item()`` (a host read per step). Its optimiser is
replaced by everyone's (fused Adam, lr 5e-4; ReLU: its ``ConstrainedAdam``, whose step removes the parallel
gradient and renormalises, made fused), its schedule by a constant one (warm-up 0: its own schedule is then
constant too). ``trainSAE`` wraps ``update`` in bf16 autocast when given ``autocast_dtype=torch.bfloat16``
("a significant speedup", its docstring says): benchmarks/peers.py's ``--autocast`` does the same for everyone.

The step index passed to ``update`` starts past its initialisations (step 0 sets ``b_dec`` to the batch's
geometric median: ours is copied in instead) and its threshold's start (step 1000: the TopK family then
updates its inference threshold every step): the step of a run in its steady state. Sparsity: JumpReLU's loss
is its own, ``λ · (L0 / target_l0 − 1)²`` with ``target_l0 = k``; ReLU's the L1 norm of the codes, λ the
same as the others'; no sparsity warm-up.

Definitions as ours: the TopK family's codes (per token, or over the batch), ``x_hat = codes W_dec + b_dec``
with ``b_dec`` our ``b_pre`` subtracted from the input first; ReLU likewise. Its JumpReLU's encoder has no
pre-bias (``pre = x W_enc + b_enc``): its ``b_enc`` is ours minus ``b_pre W_enc`` (the same pre-activations),
and the equality check compares with ``b_pre = 0`` (its ``b_dec`` then gets the decoder's gradient only).

Its package's ``__init__`` imports nnsight (for its activation buffer, which the trainers do not use), and
nnsight patches torch for the whole process when imported (``torch.autocast.__init__`` replaced by its own
copy, ``FakeTensor.__bool__`` and ``FakeTensor.tolist``, ``one_hot``, einops and math functions wrapped),
which would change every other contender's step. So the import below stands a stub in for nnsight, for that
import only; nothing of nnsight is imported.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks.peer_adapters import AUXK_VARIANTS, LR, SPARSITY_COEFFICIENT, Contender
from sae_pipeline.sae import JumpReLUSAE, MatryoshkaBatchTopKSAE, SparseAutoencoder

STEADY_STEP = 1001  # past the geometric-median init (step 0) and the threshold's start (1000)
VARIANTS = ("topk", "batchtopk", "matryoshka", "jumprelu", "relu")
N_STEPS = 10**9  # the trainers' total steps: only their schedules read it (constant here)


def import_trainers() -> Any:
    """``dictionary_learning.trainers``, imported with a stub for nnsight (see the module docstring)."""
    if "dictionary_learning.trainers.matryoshka_batch_top_k" in sys.modules:
        return sys.modules["dictionary_learning.trainers"]
    stub = types.ModuleType("nnsight")
    stub.LanguageModel = None  # what dictionary_learning.buffer imports; the trainers never use it
    real = sys.modules.get("nnsight")
    sys.modules["nnsight"] = stub
    try:
        import dictionary_learning.trainers
        import dictionary_learning.trainers.matryoshka_batch_top_k  # not re-exported by trainers/__init__
    finally:
        if real is None:
            del sys.modules["nnsight"]
        else:
            sys.modules["nnsight"] = real
    return dictionary_learning.trainers


def fused_constrained_adam(params: Any, constrained: Any) -> torch.optim.Optimizer:
    """Its ``ConstrainedAdam`` (the step removes the parallel gradient and renormalises the atoms) on torch's
    fused Adam, the same update as everyone's."""
    from dictionary_learning.trainers.trainer import ConstrainedAdam

    class FusedConstrainedAdam(ConstrainedAdam):
        def __init__(self) -> None:
            torch.optim.Adam.__init__(self, params, lr=LR, fused=True)
            self.constrained_params = list(constrained)

    return FusedConstrainedAdam()


def group_fractions(widths: tuple[int, ...], d_sae: int) -> list[float]:
    """``group_fractions`` whose ``int(f · d_sae)`` are the groups between our prefix widths (the last takes the
    rest), robust to the rounding of ``f · d_sae``."""
    sizes = [high - low for low, high in zip((0, *widths[:-1]), widths)]
    fractions = [(size + 0.5) / d_sae for size in sizes[:-1]]
    return [*fractions, 1.0 - sum(fractions)]


class DictionaryLearning(Contender):
    """One of dictionary_learning's trainers, stepped by its ``update`` (see the module docstring)."""

    library = "dictionary_learning"

    @classmethod
    def has_pre_bias(cls, variant: str) -> bool:
        return variant != "jumprelu"

    def __init__(self, variant: str, template: SparseAutoencoder, batch_size: int, k: int) -> None:
        super().__init__(variant, template, batch_size, k)
        self.trainer.optimizer = self.optimizer
        self.trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda _: 1.0)
        self.step_index = STEADY_STEP

    def build(self, template: SparseAutoencoder) -> nn.Module:
        trainers = import_trainers()
        d_in, d_sae, device = template.d_in, template.d_sae, str(template.W_dec.device)
        common: dict[str, Any] = dict(
            steps=N_STEPS, activation_dim=d_in, dict_size=d_sae, layer=0, lm_name="benchmark", lr=LR, device=device
        )
        common["warmup_steps"] = 0
        W_enc, b_enc, W_dec, b_pre = (
            t.detach() for t in (template.W_enc, template.b_enc, template.W_dec, template.b_pre)
        )
        if self.variant in ("topk", "batchtopk"):
            cls = trainers.TopKTrainer if self.variant == "topk" else trainers.BatchTopKTrainer
            self.trainer = cls(k=self.k, **common)
            ae = self.trainer.ae
            linear = {"encoder.weight": W_enc.T, "encoder.bias": b_enc, "decoder.weight": W_dec.T, "b_dec": b_pre}
        elif self.variant == "matryoshka":
            assert isinstance(template, MatryoshkaBatchTopKSAE)
            fractions = group_fractions(template.prefix_widths, d_sae)
            weights = [1.0] * len(fractions)
            self.trainer = trainers.matryoshka_batch_top_k.MatryoshkaBatchTopKTrainer(
                k=self.k, group_fractions=fractions, group_weights=weights, **common
            )
            ae = self.trainer.ae
            ends = [int(end) for end in ae.group_indices[1:]]
            if ends != list(template.prefix_widths):
                raise RuntimeError(f"its groups end at {ends}, our prefixes at {list(template.prefix_widths)}")
            linear = {"W_enc": W_enc, "b_enc": b_enc, "W_dec": W_dec, "b_dec": b_pre}
        elif self.variant == "jumprelu":
            assert isinstance(template, JumpReLUSAE)
            self.trainer = trainers.JumpReluTrainer(
                bandwidth=template.bandwidth,
                sparsity_penalty=SPARSITY_COEFFICIENT,
                sparsity_warmup_steps=None,
                target_l0=float(self.k),
                **common,
            )
            ae = self.trainer.ae
            folded = b_enc - b_pre @ W_enc  # its encoder takes x, not x − b_pre: the same pre-activations
            linear = {"W_enc": W_enc, "b_enc": folded, "W_dec": W_dec, "b_dec": b_pre}
            linear["threshold"] = template.threshold.detach()
        else:
            self.trainer = trainers.StandardTrainer(
                l1_penalty=SPARSITY_COEFFICIENT, sparsity_warmup_steps=None, **common
            )
            ae = self.trainer.ae
            linear = {"encoder.weight": W_enc.T, "encoder.bias": b_enc, "decoder.weight": W_dec.T, "bias": b_pre}
        with torch.no_grad():
            for name, value in linear.items():
                ae.get_parameter(name).copy_(value)
        return ae.to(template.W_dec.dtype).train()

    def make_optimizer(self) -> torch.optim.Optimizer:
        if self.variant == "relu":  # the decoder-norm maintenance lives in its optimiser's step
            return fused_constrained_adam(self.model.parameters(), self.model.decoder.parameters())
        return super().make_optimizer()

    def mark_dead(self, dead: Tensor) -> None:
        if self.variant in AUXK_VARIANTS:
            self.trainer.num_tokens_since_fired[dead] = self.trainer.dead_feature_threshold

    def dead_mask(self) -> Tensor | None:
        if self.variant not in AUXK_VARIANTS:
            return None
        return self.trainer.num_tokens_since_fired >= self.trainer.dead_feature_threshold

    def step(self, x: Tensor) -> None:
        self.trainer.update(self.step_index, x)
        self.step_index += 1

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        ae = self.model
        if self.variant in ("batchtopk", "matryoshka"):
            codes = ae.encode(x, use_threshold=False)  # training's batch top-k, not the inference threshold
        else:
            codes = ae.encode(x)
        return codes, ae.decode(codes)

    def named_grads(self) -> dict[str, Tensor | None]:
        ae = self.model
        if self.variant in ("matryoshka", "jumprelu"):
            grads = {"W_enc": ae.W_enc.grad, "b_enc": ae.b_enc.grad, "W_dec": ae.W_dec.grad, "b_pre": ae.b_dec.grad}
            if self.variant == "jumprelu":
                del grads["b_pre"]  # its b_dec is not in its encoder: another parameter than our b_pre
            return grads
        W_enc = None if ae.encoder.weight.grad is None else ae.encoder.weight.grad.T
        W_dec = None if ae.decoder.weight.grad is None else ae.decoder.weight.grad.T
        b_pre = ae.bias.grad if self.variant == "relu" else ae.b_dec.grad
        return {"W_enc": W_enc, "b_enc": ae.encoder.bias.grad, "W_dec": W_dec, "b_pre": b_pre}

    def W_dec(self) -> Tensor:
        return self.model.W_dec if self.variant in ("matryoshka", "jumprelu") else self.model.decoder.weight.T
