"""Interventions in the backbone: a layer's tokens replaced by the SAE's reconstruction with chosen atoms removed or
scaled, the rest of the vision model run, and its own output measured (`evaluate intervene`).

Why in the backbone: `evaluate causal` measures what a probe fitted on the reconstructions loses; this measures
what the *model* downstream of the layer does with the atoms, on the user's images.

How: the SAE's recorded backbone is rebuilt as `features explain` rebuilds it (registry entry, layer, weights,
preprocessing; `sae_pipeline.features.explain_backbone`), and a forward hook on the module whose output the
extraction stored (a block, or the final norm for the last layer) replaces that output x by

    x' = x̂' + (x − x̂) = x + (s − 1) Σ_{j ∈ atoms} z_j d_j        (z = encode(x), x̂ = z D + b_pre)

on every token of the layer: the reconstruction with atoms j scaled by s (s = 0: removed), the SAE's error term
x − x̂ kept. So with no atom changed x' is x exactly and the output is the model's own (the baseline: any change is
the atoms', not the SAE's error); the figure "x̂ only" replaces x by x̂ (the error dropped), for scale. Written as
x + Δ, not x̂' + (x − x̂), so that "no change" is bit for bit the model's output, not a rounding away from it.

The output: class logits where the model keeps a classifier (a timm model with `num_classes` > 0), measured by the
KL divergence of the class distributions and whether the top class changes; otherwise (every registry backbone,
built without its head) the final embedding (timm's pooled features, CLIP's projected image embedding), measured by
the cosine distance 1 − cos(e, e').
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn


def hooked_module(backbone: Any) -> nn.Module:
    """The module whose output is the extracted tokens ``[B, n_tokens, d]`` (one line when there is none)."""
    model, layer, name = backbone.model, backbone.layer, backbone.spec.name
    if backbone.spec.library == "timm":
        return model.norm if backbone.final_norm else model.blocks[layer]
    visual = model
    if not backbone.final_norm:
        return visual.transformer.resblocks[layer]
    if visual.attn_pool is not None or visual.final_ln_after_pool:
        raise ValueError(
            f"backbone {name!r}: its final norm is applied after pooling, so its last layer's tokens are not "
            "computed in a forward pass; use an SAE trained on an earlier layer"
        )
    return visual.ln_post


def _token_first(backbone: Any) -> bool:
    """Whether the hooked output is [tokens, batch, d] (open_clip's blocks without ``batch_first``)."""
    return (
        backbone.spec.library == "open_clip"
        and not backbone.final_norm
        and not getattr(backbone.model.transformer, "batch_first", True)
    )


@contextmanager
def replaced_tokens(backbone: Any, replace: Callable[[Tensor], Tensor]) -> Any:
    """Within the block, the hooked module's output tokens ``[B, T, d]`` are ``replace(tokens)``."""
    token_first = _token_first(backbone)

    def hook(module: nn.Module, inputs: Any, output: Tensor) -> Tensor:
        x = output.transpose(0, 1) if token_first else output
        x = replace(x)
        return x.transpose(0, 1) if token_first else x

    handle = hooked_module(backbone).register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def has_head(model: nn.Module) -> bool:
    return int(getattr(model, "num_classes", 0) or 0) > 0


def model_output(model: nn.Module, pixels: Tensor) -> Tensor:
    """The model's own output, float: logits with a classifier, else the final embedding."""
    out = model(pixels)
    return (out[0] if isinstance(out, tuple) else out).float()


def scaled_atoms(sae: Any, atoms: Tensor, scale: float) -> Callable[[Tensor], Tensor]:
    """x ↦ x + (s − 1) Σ_{j ∈ atoms} z_j d_j, per token (see the module docstring)."""
    W = sae.W_dec.detach()[atoms]

    def replace(x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1]).float()
        z = sae.encode(flat)[:, atoms]
        return (flat + (scale - 1.0) * (z @ W)).reshape(x.shape).to(x.dtype)

    return replace


def reconstruction_only(sae: Any) -> Callable[[Tensor], Tensor]:
    """x ↦ x̂ = decode(encode(x)): the SAE's error dropped."""

    def replace(x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1]).float()
        return sae.decode(sae.encode(flat)).reshape(x.shape).to(x.dtype)

    return replace


def change(before: Tensor, after: Tensor, head: bool) -> Tensor:
    """Per image: KL(p ‖ p') of the class distributions (head), else the cosine distance of the embeddings."""
    if head:
        log_p, log_q = before.log_softmax(-1), after.log_softmax(-1)
        return (log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0.0)  # identical: 0 exactly
    cosine = torch.nn.functional.cosine_similarity(before.double(), after.double(), dim=-1)
    same = (before == after).all(-1)  # identical outputs: 0, not a rounding away from it
    return torch.where(same, 0.0, (1.0 - cosine).clamp_min(0.0)).float()


@torch.no_grad()
def intervene(sae: Any, backbone: Any, pixels: Tensor, atoms: list[int], scale: float) -> dict[str, Tensor]:
    """One batch: the model's output as it is, with the atoms scaled (error kept), and with x̂ only; the changes."""
    model = backbone.model
    head = has_head(model)
    index = torch.as_tensor(atoms, dtype=torch.long, device=sae.W_dec.device)
    seen: dict[str, Tensor] = {}

    def keep(x: Tensor) -> Tensor:
        seen["tokens"] = x
        return x

    with replaced_tokens(backbone, keep):
        original = model_output(model, pixels)
    with replaced_tokens(backbone, scaled_atoms(sae, index, scale)):
        intervened = model_output(model, pixels)
    with replaced_tokens(backbone, reconstruction_only(sae)):
        xhat_only = model_output(model, pixels)
    tokens = seen["tokens"]
    z = sae.encode(tokens.reshape(-1, tokens.shape[-1]).float())[:, index].reshape(*tokens.shape[:2], -1)
    found = {
        "tokens": tokens,
        "original": original,
        "intervened": intervened,
        "change": change(original, intervened, head),
        "xhat_change": change(original, xhat_only, head),
        "active_tokens": (z != 0).any(-1).sum(-1),
        "code_sum": z.abs().sum((1, 2)),
    }
    if head:
        found["top_before"], found["top_after"] = original.argmax(-1), intervened.argmax(-1)
    return found


def intervene_images(
    sae: Any, backbone: Any, records: list[Any], atoms: list[int], scale: float, batch_size: int, device: str
) -> dict[str, Any]:
    """Every decodable image's figures (``rows``) and the images skipped with the reason (``skipped``)."""
    from feature_extraction.images import ImageDataset
    from sae_pipeline.training.interrupts import raise_if_interrupted

    torch_device = torch.device(device)
    backbone.to(torch_device)
    sae = sae.to(torch_device).eval()
    head = has_head(backbone.model)
    dataset = ImageDataset(records, backbone.preprocess, log_skips=False)
    rows, skipped = [], []
    for start in range(0, len(records), batch_size):
        raise_if_interrupted()
        items = [dataset[i] for i in range(start, min(start + batch_size, len(records)))]
        skipped += [(records[i].image_id, why) for i, pixels, why in items if pixels is None]
        ok = [(i, pixels) for i, pixels, _ in items if pixels is not None]
        if not ok:
            continue
        found = intervene(sae, backbone, torch.stack([p for _, p in ok]).to(torch_device), atoms, scale)
        for b, (i, _) in enumerate(ok):
            row = {
                "id": records[i].image_id,
                "change": float(found["change"][b]),
                "xhat_change": float(found["xhat_change"][b]),
                "active_tokens": int(found["active_tokens"][b]),
                "code_sum": float(found["code_sum"][b]),
            }
            if head:
                row["top_before"], row["top_after"] = int(found["top_before"][b]), int(found["top_after"][b])
            rows.append(row)
    return {"output": "class logits" if head else "final embedding", "rows": rows, "skipped": skipped}


def summary(result: dict[str, Any]) -> str:
    rows = result["rows"]
    measure = "KL divergence of the class distribution" if result["output"] == "class logits" else "cosine distance"
    mean = sum(r["change"] for r in rows) / len(rows) if rows else math.nan
    base = sum(r["xhat_change"] for r in rows) / len(rows) if rows else math.nan
    return (
        f"atoms {' '.join(map(str, result['atoms']))} scaled by {result['scale']:g} at layer {result['layer']} of "
        f"{result['backbone']}: mean {measure} of the {result['output']} {mean:.6g} over {len(rows)} images "
        f"(x̂ only, the SAE's error dropped: {base:.6g}; no atom changed: 0 exactly, the error term is kept)"
    )
