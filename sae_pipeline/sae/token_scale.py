"""The per-token scale that a token-scaled threshold (JumpReLU, BatchTopK) is measured against.

Why: a threshold is one number per latent (JumpReLU) or per model (BatchTopK), compared with
pre-activations whose size grows with the token's norm. Vision transformers' CLS and register
tokens hold a few massive dimensions (DINOv2: values ~50x the typical coordinate), so after the
input normalisation (E‖x‖² = d_in) they set the threshold's scale: on synthetic ViT-like tokens
(``benchmarks/vit_like_tokens.py``) register-like tokens used L0 ~160-180 while ordinary tokens got
~11-21 and were poorly reconstructed. With ``token_scaled_threshold=True`` the gate compares
``pre / s(x)`` with θ, where ``s(x) = ‖x − b_pre‖ / √d_in`` (the centred token's RMS), i.e.
``codes = pre · H(pre − θ·s(x))``: the codes, the decoder and the loss are the paper's, only
the gate is measured in units of each token's own size (as a cosine is), so every token
gets a comparable number of atoms whatever its norm. ``s`` is treated as data (no gradient),
and scaling the input scales ``s``, so θ is unitless: exporting a normalised run
(``fold_input_scale``) leaves it as trained.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def token_scale(x: Tensor, b_pre: Tensor) -> Tensor:
    """``‖x − b_pre‖ / √d_in`` per token, ``[B, 1]``, float32 (or float64 for float64 input), detached,
    floored at the dtype's tiny so a token equal to ``b_pre`` divides safely."""
    x = x.detach()
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    with torch.autocast(device_type=x.device.type, enabled=False):
        centred = x.to(dtype) - b_pre.detach().to(dtype)
        scale = centred.norm(dim=1, keepdim=True) / math.sqrt(x.shape[1])
    return scale.clamp_min(torch.finfo(dtype).tiny)
