"""The shared SAE contract: decoder, pre-bias, dead-latent bookkeeping, loss layout.

Every variant reconstructs ``x_hat = codes @ W_dec + b_pre`` with unit-norm atoms (rows of
``W_dec``), as in the paper's SAE definition (Costa et al. 2025, §2 "Sparse Autoencoders":
``x_hat = D z + b_pre`` with ``‖D_i‖₂ = 1``). Variants differ only in how codes are inferred
(``encode``) and in their named loss terms (``loss_terms``), so the training loop treats them
all alike through :class:`SAEOutput` and :class:`SAELoss`. What the rest of the package needs to
know about a variant (its key, label, sparsity knob, ...) are class attributes of
:class:`SparseAutoencoder`, so a new variant is its file plus one line in the registry
(``sae_pipeline/sae/__init__.py``) plus its configs.

The shallow variants (ReLU, JumpReLU, TopK, BatchTopK) share one linear encoder,
:class:`ShallowSAE`; MP-SAE is weight-tied and has none.

This is the training contract. The sparse codes at inference (``encode_sparse``, what ``predict``
and ``features`` read) come from the mixins of `sae_pipeline/sae/sparse_inference.py`, bases of
both classes.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from feature_extraction.file_hashes import tensors_sha256
from feature_extraction.validate import check_float, check_int
from sae_pipeline.sae.sparse_decode import SparseCodes, sparse_decode, sparse_encode
from sae_pipeline.sae.sparse_inference import ShallowSparseInference, SparseInference
from sae_pipeline.sae.topk_select import top_k_indices


class SAEOutput:
    """What ``forward`` returns: ``x_hat``, ``codes`` and ``pre_acts`` (None for MP), and, on the
    sparse path of the shallow variants, ``sparse`` (:class:`SparseCodes`).

    On that path the dense ``codes [B, d_sae]`` are built only if someone reads them (once,
    then kept): the training step reads ``fired()`` and ``l0()`` from the sparse form instead,
    which saves a ``[B, d_sae]`` allocation and its zero-fill per step. ``pre_acts`` there is
    detached (the gradients flow through ``sparse.values``). Unpacks like the former
    ``(x_hat, codes, pre_acts)`` named tuple.
    """

    __slots__ = ("x_hat", "pre_acts", "sparse", "_codes")

    def __init__(
        self,
        x_hat: Tensor,
        codes: Tensor | None = None,
        pre_acts: Tensor | None = None,
        sparse: SparseCodes | None = None,
    ) -> None:
        if codes is None and sparse is None:
            raise ValueError("SAEOutput needs dense codes or sparse codes")
        self.x_hat, self._codes, self.pre_acts, self.sparse = x_hat, codes, pre_acts, sparse

    @property
    def codes(self) -> Tensor:  # [B, d_sae] dense
        if self._codes is None:
            assert self.sparse is not None
            self._codes = self.sparse.to_dense()
        return self._codes

    def fired(self) -> Tensor:
        """Bool ``[d_sae]``: latents active on some token of the batch."""
        if self.sparse is not None:
            return self.sparse.fired()
        return (self.codes.detach() != 0).any(0)

    def l0(self) -> Tensor:
        """Mean active latents per token, float64."""
        if self.sparse is not None:
            return self.sparse.l0()
        return torch.count_nonzero(self.codes.detach()).to(torch.float64) / max(self.codes.shape[0], 1)

    def __iter__(self) -> Iterator[Tensor | None]:
        return iter((self.x_hat, self.codes, self.pre_acts))

    def __len__(self) -> int:
        return 3

    def __getitem__(self, index: int) -> Tensor | None:
        return (self.x_hat, self.codes, self.pre_acts)[index]


class SAELoss:
    """Named loss terms, each already multiplied by its coefficient, and ``loss``, their sum (what
    backward runs on).

    Every variant has ``mse`` (``F.mse_loss(x_hat, x)``, mean over elements), ``sparsity_loss`` and
    ``aux_loss`` (0 when the variant has none); a variant adds its own terms in
    :meth:`SparseAutoencoder.loss_terms`. The training module logs each term as ``train/<name>``,
    so a new term needs no change to this class or to the module.
    """

    __slots__ = ("terms", "loss")

    def __init__(self, terms: Mapping[str, Tensor]) -> None:
        if not terms or "loss" in terms or not all(isinstance(name, str) and name for name in terms):
            raise ValueError(f"loss terms need non-empty names other than 'loss', got {sorted(map(str, terms))}")
        self.terms: dict[str, Tensor] = dict(terms)
        self.loss: Tensor = sum(self.terms.values())  # type: ignore[assignment]

    @property
    def mse(self) -> Tensor:
        return self.terms["mse"]

    @property
    def sparsity(self) -> Tensor:
        return self.terms["sparsity_loss"]

    @property
    def aux(self) -> Tensor:
        return self.terms["aux_loss"]


def keep_top_k(codes: Tensor, k: int) -> Tensor:
    """Zero all but the ``k`` largest entries of each row (`topk_select.top_k_indices`: on a GPU its kernel, ties
    to the lowest index; else ``torch.topk``)."""
    indices = top_k_indices(codes, k)
    return torch.zeros_like(codes).scatter(-1, indices, codes.gather(-1, indices))


def check_fits_host(d_in: int, d_sae: int) -> None:
    """Refuse sizes whose decoder alone (float32 ``[d_sae, d_in]``) exceeds this machine's memory: it could never
    be built, and asking the allocator would at best fail late and at worst take the machine (a config or file
    saying ``d_sae: 1e12``)."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not a POSIX system: nothing to compare with
        return
    need = 4 * d_in * d_sae
    if total > 0 and need > total:
        raise ValueError(
            f"d_sae {d_sae} x d_in {d_in}: the decoder alone needs {need / 1e9:.3g} GB, more than this machine's "
            f"{total / 1e9:.3g} GB of memory; choose a smaller d_sae"
        )


class SparseAutoencoder(SparseInference, nn.Module):
    """Base of every variant: unit-norm decoder ``W_dec [d_sae, d_in]``, pre-bias ``b_pre``.

    ``tokens_since_fired`` counts, per latent, the tokens seen since it last fired; a latent is
    dead once the count reaches ``dead_after_tokens`` (Gao et al. 2024 use 10 M tokens). It is a
    buffer so that resumed training keeps the dead set.

    Convention: every constructor argument of every variant is kept as an attribute of the
    same name, so export can rebuild the config from ``inspect.signature`` and ``getattr``.

    A registered variant sets the class attributes below (the registry checks them); everything
    outside ``sae/`` (configs checks, evaluation, claims, demo, tests, benchmarks) reads them
    instead of listing variants.
    """

    #: The variant's one name: registry key, ``configs/<key>_<data>.yaml``, ``"variant"`` of an
    #: exported ``config.json``, evaluation runs and claims, the demo's ``--variants``.
    key: ClassVar[str] = ""
    #: Earlier keys still accepted by :func:`sae_pipeline.sae.get_sae_class` (old exports, scripts).
    aliases: ClassVar[tuple[str, ...]] = ()
    #: Display name in figures, reports and the demo ("MP-SAE").
    label: ClassVar[str] = ""
    #: The constructor argument that sets sparsity, for the study planner: ``"k"`` (active latents or
    #: pursuit steps), ``"target_l0"`` or an L1 coefficient (see :meth:`sparsity_init_args`).
    sparsity_knob: ClassVar[str] = "k"
    #: True for a pursuit: codes are built step by step and ``pursuit(x, k)`` returns the selection
    #: order ``(indices [B, k], coefficients [B, k])`` (the concepts study reads it).
    is_pursuit: ClassVar[bool] = False
    #: True when an inference ``k`` may exceed ``d_sae`` (MP picks atoms again); else k <= d_sae.
    k_above_d_sae: ClassVar[bool] = False
    #: Constructor keyword arguments (besides d_in=12, d_sae=48) for the shared contract tests.
    test_kwargs: ClassVar[dict[str, Any]] = {}
    #: Whether a training step avoids every host read of a device value (see `avoids_host_reads`);
    #: None: on every device but the CPU. Not a constructor argument: it changes the cost, not the result.
    sync_free: bool | None = None

    @classmethod
    def sparsity_init_args(cls, k: int, data: str = "digits") -> dict[str, Any]:
        """Constructor arguments that make the mean L0 about ``k`` when training on ``data`` (a data
        source name, for variants whose knob is data dependent). Default: ``{sparsity_knob: k}``."""
        return {cls.sparsity_knob: k}

    k: int | None

    def __init__(self, d_in: int, d_sae: int, dead_after_tokens: int = 10_000_000) -> None:
        super().__init__()
        self.d_in = check_int("d_in", d_in, 1)
        self.d_sae = check_int("d_sae", d_sae, 1)
        self.dead_after_tokens = check_int("dead_after_tokens", dead_after_tokens, 1)
        check_fits_host(self.d_in, self.d_sae)
        self.k = None
        W_dec = torch.randn(d_sae, d_in)
        W_dec /= W_dec.norm(dim=1, keepdim=True).clamp_min(torch.finfo(W_dec.dtype).tiny)
        self.W_dec = nn.Parameter(W_dec)
        self.b_pre = nn.Parameter(torch.zeros(d_in))
        self.register_buffer("tokens_since_fired", torch.zeros(d_sae, dtype=torch.int64))
        self._finite_checked_by_caller = False

    # --- inference ---------------------------------------------------------------------
    def encode(self, x: Tensor, k: int | None = None) -> Tensor:
        """Codes ``[B, d_sae]``; ``k`` overrides the trained sparsity at inference (see variants)."""
        raise NotImplementedError

    def decode(self, codes: Tensor) -> Tensor:
        """``x_hat = codes @ W_dec + b_pre`` (paper §2)."""
        return codes @ self.W_dec + self.b_pre

    def forward(self, x: Tensor) -> SAEOutput:
        raise NotImplementedError

    def codes_from_pursuit(self, indices: Tensor, coefficients: Tensor) -> Tensor:
        """Dense codes ``[B, d_sae]`` of a pursuit's selection order: coefficients summed per atom (an atom
        picked twice adds up)."""
        codes = coefficients.new_zeros(coefficients.shape[0], self.d_sae)
        return codes.scatter_add_(1, indices, coefficients)  # in place: no second [B, d_sae] copy

    # --- loss --------------------------------------------------------------------------
    def loss(self, x: Tensor, output: SAEOutput, step: int = 0) -> SAELoss:
        """The sum of :meth:`loss_terms`, with each term kept by name for logging."""
        return SAELoss(self.loss_terms(x, output, step))

    def loss_terms(self, x: Tensor, output: SAEOutput, step: int) -> dict[str, Tensor]:
        """``mse`` (mean over elements), ``sparsity_loss`` and ``aux_loss``; a variant with more terms
        returns ``{**super().loss_terms(x, output, step), "name": term}`` (each logged as ``train/name``)."""
        return {
            "mse": F.mse_loss(output.x_hat, x),
            "sparsity_loss": self.sparsity_penalty(x, output, step),
            "aux_loss": self.auxiliary_loss(x, output),
        }

    def sparsity_penalty(self, x: Tensor, output: SAEOutput, step: int) -> Tensor:
        """Coefficient-weighted sparsity penalty; zero for variants whose sparsity is structural."""
        return output.x_hat.new_zeros(())

    def auxiliary_loss(self, x: Tensor, output: SAEOutput) -> Tensor:
        """Coefficient-weighted auxiliary loss (AuxK for TopK variants); zero by default."""
        return output.x_hat.new_zeros(())

    def step_dependent(self, step: int) -> bool:
        """Whether the loss at global step ``step`` depends on the step through a host value (ReLU's L1
        warm-up): a step captured as a CUDA graph keeps the value of its capture, so the training module
        runs such steps eagerly (`sae_pipeline.training.graph_step`). Default: never."""
        return False

    # --- host-side bookkeeping around each training step (called by the training module) -----------
    def begin_fit(self) -> None:
        """Before a fit's first training step, on the host (a host read is fine here: once per fit).
        Default: nothing. TopK starts its late dead count (`sae_pipeline.sae.late_count`)."""

    def plan_step(self) -> Hashable:
        """Before each training step, on the host: fix what the step's work depends on that the host knows
        (never a device value read now) and return it as the step's key. Steps of one key queue the same
        kernels on the same shapes: a captured step keeps one CUDA graph per key
        (`sae_pipeline.training.graph_step`). Default: None, one key. TopK: its AuxK slots, 0 for none."""
        return None

    def after_step(self) -> None:
        """After each training step is queued, on the host, outside any captured graph. Default: nothing."""

    def lr_scales(self) -> dict[str, float]:
        """Learning-rate multipliers by parameter name (as in ``named_parameters``) for the parameters
        that must move at another pace than the rest (JumpReLU's threshold); every other parameter
        trains at the module's ``lr``. Default: none."""
        return {}

    # --- dictionary maintenance (called by the training loop) ---------------------------
    @torch.no_grad()
    def init_b_pre(self, mean: Tensor) -> None:
        """Set ``b_pre`` to the data mean ``[d_in]`` so codes model deviations from it."""
        if mean.shape != (self.d_in,):
            raise ValueError(f"mean must have shape [d_in]=[{self.d_in}], got {list(mean.shape)}")
        if not torch.isfinite(mean).all():
            raise ValueError("mean must be finite; recompute the data mean without NaN/inf tokens")
        self.b_pre.copy_(mean)

    @torch.no_grad()
    def normalize_atoms(self) -> None:
        """Rescale rows of ``W_dec`` to unit L2 norm (after each optimiser step)."""
        norms = self.W_dec.norm(dim=1, keepdim=True).clamp_min(torch.finfo(self.W_dec.dtype).tiny)
        self.W_dec.div_(norms)

    @torch.no_grad()
    def remove_parallel_grad(self) -> None:
        """Project out of each row of ``W_dec.grad`` its component along that atom.

        With unit-norm atoms that component only changes the norm, which ``normalize_atoms``
        undoes anyway; removing it keeps Adam's moments from chasing it. Call before
        ``optimizer.step``.
        """
        grad = self.W_dec.grad
        if grad is None:
            return
        W = self.W_dec
        # Row dot products and an in-place update: no [d_sae, d_in] temporary (3 passes, not 7).
        dots = torch.linalg.vecdot(grad, W)
        sq_norms = W.norm(dim=1).square_().clamp_min_(torch.finfo(W.dtype).tiny)
        grad.addcmul_(W, (dots / sq_norms).unsqueeze(1), value=-1)

    @torch.no_grad()
    def record_firing(self, fired: Tensor, n_tokens: int) -> None:
        """Advance the dead-latent clock: ``fired`` bool ``[d_sae]`` (OR over ranks), ``n_tokens``
        tokens in the step (summed over ranks)."""
        if fired.shape != (self.d_sae,):
            raise ValueError(f"fired must be a bool tensor of shape [d_sae]=[{self.d_sae}], got {list(fired.shape)}")
        self.tokens_since_fired.add_(n_tokens)
        self.tokens_since_fired.masked_fill_(fired.to(device=self.tokens_since_fired.device, dtype=torch.bool), 0)

    def dead_mask(self) -> Tensor:
        """Bool ``[d_sae]``: latents that have not fired for ``dead_after_tokens`` tokens."""
        return self.tokens_since_fired >= self.dead_after_tokens

    def content_sha256(self) -> str:
        """Which dictionary this is: a sha256 over the parameters (float32), not the training counters.

        A checkpoint, its export and its SAELens export give the same digest (the input scale folded);
        a feature site records it, so ``features explain`` links only into the site of the same SAE.
        """
        params = {name: p.detach().float() if p.is_floating_point() else p for name, p in self.named_parameters()}
        return tensors_sha256(params)

    @torch.no_grad()
    def fold_input_scale(self, scale: float) -> None:
        """Make an SAE trained on ``scale · x`` take raw ``x`` (export of a normalised run).

        Every variant is positively homogeneous in its input, biases and thresholds: with
        ``b → b / scale`` and ``θ → θ / scale`` (atoms unchanged, still unit-norm) the codes become
        ``codes(scale · x) / scale`` and ``x_hat`` becomes ``x_hat(scale · x) / scale``. Here:
        ``b_pre``; variants extend it to their encoder bias and thresholds. Loss coefficients
        (λ, bandwidth) are training settings and are left as trained.
        """
        scale = check_float("scale", scale, 0.0, strict_minimum=True)
        self.b_pre.div_(scale)

    # --- helpers ---------------------------------------------------------------------------
    def avoids_host_reads(self, x: Tensor) -> bool:
        """Whether the step on ``x``'s device must not read a device value on the host.

        On a GPU such a read (``bool(t)``, ``int(t.sum())``, a size that depends on the data) makes the
        host wait until the GPU has caught up, every step; there a variant computes the same result with
        device-side masks instead (``torch.where``, a fixed-size ``topk``). On the CPU the read is free,
        so the cheaper data-dependent shortcuts stay (skip AuxK while no latent is dead, the sparse path
        of a data-sized support). ``sync_free`` forces either (the tests run the GPU's code on the CPU).
        """
        return x.device.type != "cpu" if self.sync_free is None else self.sync_free

    @contextmanager
    def finite_checked_by_caller(self) -> Iterator[None]:
        """Within it, ``forward`` does not check that the input is finite (a host read): the training
        module checks each batch itself, on the device, and reads the result on logging steps."""
        before, self._finite_checked_by_caller = self._finite_checked_by_caller, True
        try:
            yield
        finally:
            self._finite_checked_by_caller = before

    def resolve_k(self, k: int | None) -> int | None:
        """``k`` validated against ``d_sae``, or the trained ``self.k`` when None."""
        if k is None:
            return self.k
        return check_int("k", k, 1, self.d_sae)

    def check_input(self, x: Tensor) -> None:
        """One-line ValueError unless ``x`` is a finite floating tensor ``[B, d_in]``."""
        if not isinstance(x, Tensor) or x.dim() != 2 or x.shape[1] != self.d_in:
            shape = list(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x must be a tensor of shape [batch, d_in={self.d_in}], got {shape}")
        if not x.is_floating_point():
            raise ValueError(f"x must be a floating-point tensor, got dtype {x.dtype}")
        if not self._finite_checked_by_caller and not torch.isfinite(x).all():
            raise ValueError("x contains NaN or inf; drop or repair non-finite tokens before the SAE")

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_sae={self.d_sae}, k={self.k}"


class ShallowSAE(ShallowSparseInference, SparseAutoencoder):
    """One-step encoder ``pre = (x - b_pre) @ W_enc + b_enc``, then a variant's nonlinearity.

    ``W_enc [d_in, d_sae]`` starts as ``W_dec.T`` (tied at init, as in Gao et al. 2024), which
    makes the first codes the atoms' correlations with the centred input; ``b_enc`` starts at 0.
    """

    def __init__(self, d_in: int, d_sae: int, dead_after_tokens: int = 10_000_000) -> None:
        super().__init__(d_in, d_sae, dead_after_tokens)
        self.W_enc = nn.Parameter(self.W_dec.detach().T.clone())
        self.b_enc = nn.Parameter(torch.zeros(d_sae))

    @torch.no_grad()
    def fold_input_scale(self, scale: float) -> None:
        """``b_pre`` and ``b_enc`` divided by ``scale`` (see :meth:`SparseAutoencoder.fold_input_scale`)."""
        super().fold_input_scale(scale)
        self.b_enc.div_(scale)

    def pre_activations(self, x: Tensor) -> Tensor:
        """``(x - b_pre) @ W_enc + b_enc`` ``[B, d_sae]`` (one ``addmm``: one ``[B, d_sae]`` allocation)."""
        return torch.addmm(self.b_enc, x - self.b_pre, self.W_enc)

    def activate(self, pre: Tensor, k: int | None) -> Tensor:
        """The variant's nonlinearity; ``k`` is the validated inference-time override or None."""
        raise NotImplementedError

    # --- the sparse path (see sae_pipeline/sae/sparse_decode.py) ----------------------------------
    #: Largest fraction of nonzero codes for which forward decodes sparsely; above it the dense
    #: path (``codes @ W_dec``) is cheaper. An instance attribute of 0 forces the dense path,
    #: 1 the sparse one (the tests compare the two).
    sparse_max_density: float = 1 / 8

    def select_support(self, pre: Tensor) -> SparseCodes | None:
        """The (token, latent) entries forward needs, from the detached ``pre``; None: decode densely."""
        return None

    def sparse_activate(self, pre_values: Tensor, support: SparseCodes) -> Tensor:
        """The nonlinearity on the gathered ``pre`` at ``support``'s entries ``[nnz]``."""
        raise NotImplementedError

    def encode(self, x: Tensor, k: int | None = None) -> Tensor:
        self.check_input(x)
        k = None if k is None else self.resolve_k(k)
        return self.activate(self.pre_activations(x), k)

    def forward(self, x: Tensor) -> SAEOutput:
        self.check_input(x)
        pre = self.pre_activations(x)
        support = self.select_support(pre.detach()) if self.sparse_max_density > 0 else None
        if support is None:
            codes = self.activate(pre, None)
            return SAEOutput(x_hat=self.decode(codes), codes=codes, pre_acts=pre)
        pre = pre.detach()  # its graph is dropped: the gradients go through the gathered entries
        values = self.sparse_activate(sparse_encode(x, self.b_pre, self.W_enc, self.b_enc, pre, support), support)
        codes = support.with_values(values)
        return SAEOutput(x_hat=sparse_decode(codes, self.W_dec, self.b_pre), pre_acts=pre, sparse=codes)

    def fits_sparse(self, nnz: int, batch: int) -> bool:
        """Whether ``nnz`` entries over ``batch`` tokens are sparse enough for the sparse path."""
        return nnz <= self.sparse_max_density * batch * self.d_sae
