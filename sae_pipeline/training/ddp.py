"""DDP's gradient all-reduce at SAE step times: kept overlapped with the backward, optionally halved.

An SAE step is short and its gradient is large. At paper scale (d_in 768, 19 200 atoms) `W_enc` and
`W_dec` hold 2 × 14.7 M parameters: every optimiser step all-reduces 118 MB of float32 gradients,
whatever the batch size, while the step itself aims at about a millisecond on one GPU. So the
all-reduce can cost as much as the step, and what hides or shrinks it matters:

- **Overlap with the backward.** PyTorch DDP all-reduces gradients in buckets, each launched as soon
  as autograd has produced every gradient in it, while the rest of the backward runs. Nothing in the
  product turns this off: `SAEModule` uses Lightning's automatic optimisation; the group's
  `manual_backward` makes Lightning prepare DDP's reducer before the backward, so its hooks still fire
  during it; `find_unused_parameters` stays False (DDP's default and Lightning's `"ddp"`), so no
  search over the graph runs after the forward. After the first step DDP rebuilds its buckets in the
  order the gradients became ready.
- **Bucket size: DDP's default (25 MB).** A tensor larger than a bucket gets a bucket of its own, so at
  paper scale `W_dec` (ready first: the decoder is the last layer of the forward) and `W_enc` are
  all-reduced separately, and `W_dec`'s all-reduce runs while `W_enc`'s gradient is computed. A larger
  cap would merge them and start later; a smaller one cannot split a tensor. What overlap can hide is
  bounded by the backward that is left after `W_dec`'s gradient, which is short in a sparse step: the
  rest is paid, and it shrinks only with fewer bytes (below) or a larger batch per GPU (the bytes do not
  grow with the batch).
- **`gradient_as_bucket_view=True`** (set here unless the strategy says otherwise): the gradients are
  views into DDP's buckets, which saves copying 118 MB into the buckets and back every step and the
  memory of a second copy. Valid because the product changes gradients only in place
  (`remove_parallel_grad`, gradient clipping) and the optimiser's `zero_grad` sets them to None, which
  DDP re-points to the buckets at the next backward.
- **`static_graph` is left False.** Its savings are the unused-parameter search (which does not run
  with `find_unused_parameters=False`) and a bucket order learnt once (DDP's rebuild after the first
  step already gives it); in exchange it holds the first step's all-reduce until the whole backward has
  run, and it is only correct while every step uses the same parameters in the same way, which every
  future variant would have to guarantee.
- **`--ddp.grad_compression bf16`** (or `fp16`): PyTorch's compression hook casts each bucket to 16
  bits (divided by the world size first), all-reduces it and casts the sum back: half the bytes on
  the wire, gradients rounded to 8 (bf16) or 11 (fp16) significant bits. bf16 keeps float32's range;
  fp16 can underflow gradients below about 6e-8. The run is then no longer equal to one process with
  the whole batch, only close to it (`tests/test_ddp_equality.py`). Off by default. Works on NCCL and,
  in torch 2.14, on gloo (CPU) too; Lightning's own `ddp_comm_hook` is registered on CUDA only, so the
  hook is registered here, on the wrapped module, for both.

`DDPSettings` is an always-on callback (the CLI's `--ddp.*` flags); on a single process it does nothing.
"""

from __future__ import annotations

from typing import Any, Literal

import lightning as L
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from sae_pipeline.training import lightning_compat

COMPRESSION_HOOKS = {"bf16": default_hooks.bf16_compress_hook, "fp16": default_hooks.fp16_compress_hook}
# What DDP is built with unless the strategy names the setting itself (see the module docstring).
DDP_DEFAULTS: dict[str, Any] = {"gradient_as_bucket_view": True}


class DDPSettings(L.Callback):
    """DDP's settings for SAE steps (`--ddp.*`).

    Args:
        grad_compression: `none` (float32 gradients on the wire), `bf16` or `fp16` (PyTorch's
            compression hook: half the bytes, gradients rounded to 16 bits; see the module docstring).
    """

    def __init__(self, grad_compression: Literal["none", "bf16", "fp16"] = "none") -> None:
        if grad_compression != "none" and grad_compression not in COMPRESSION_HOOKS:
            raise ValueError(f"--ddp.grad_compression must be none, bf16 or fp16, got {grad_compression!r}")
        self.grad_compression = grad_compression

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Before the strategy wraps the module: DDP's defaults, and a check that no other hook is set."""
        strategy = trainer.strategy
        if stage != "fit" or not isinstance(strategy, DDPStrategy):
            return
        if self.grad_compression != "none" and lightning_compat.ddp_comm_hook(strategy) is not None:
            raise ValueError(
                f"--ddp.grad_compression {self.grad_compression}: the strategy already has a ddp_comm_hook; "
                "drop one of the two"
            )
        kwargs = lightning_compat.ddp_kwargs(strategy)
        for name, value in DDP_DEFAULTS.items():
            kwargs.setdefault(name, value)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """After the wrap, before the first backward: register the compression hook; say what a step sends."""
        model = trainer.strategy.model
        if not isinstance(model, DistributedDataParallel):
            return
        if self.grad_compression != "none":
            model.register_comm_hook(None, COMPRESSION_HOOKS[self.grad_compression])
        rank_zero_info(describe(model, self.grad_compression, trainer.world_size))


def gradient_bytes(model: DistributedDataParallel, grad_compression: str) -> int:
    """Bytes of gradient each rank all-reduces per optimiser step."""
    width = 2 if grad_compression in COMPRESSION_HOOKS else None
    return sum(p.numel() * (width or p.element_size()) for p in model.parameters() if p.requires_grad)


def describe(model: DistributedDataParallel, grad_compression: str, world_size: int) -> str:
    """The line a DDP fit prints once: what each step all-reduces and how (read back from the wrapper)."""
    mb = gradient_bytes(model, grad_compression) / 1e6
    wire = f"{grad_compression} (--ddp.grad_compression)" if grad_compression != "none" else "uncompressed"
    views = ", gradients as bucket views" if model.gradient_as_bucket_view else ""
    return (
        f"DDP over {world_size} processes: {mb:.3g} MB of gradients all-reduced per step, {wire}, "
        f"in buckets overlapping the backward{views}"
    )
