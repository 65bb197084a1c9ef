"""Local backbone weights: read without unpickling objects, load strictly, fail in one line.

`--checkpoint_path` is a safetensors file or a torch state dict read with
`weights_only=True` (no pickle, as everywhere in the pipeline), in the library's own key
format; the adapter maps keys (e.g. timm's DINOv2 filter, open_clip's `visual.` prefix)
before `load_strict`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn


def read_state_dict(checkpoint_path: str) -> dict[str, Tensor]:
    """Tensors from a safetensors file or a torch state dict, never unpickling objects."""
    fpath = Path(checkpoint_path)
    if not fpath.is_file():
        raise ValueError(
            f"checkpoint_path {checkpoint_path!r} is not a file; give a local .safetensors file or torch state dict"
        )
    try:
        if fpath.suffix == ".safetensors":
            from safetensors.torch import load_file

            obj: Any = load_file(fpath)
        else:
            obj = torch.load(fpath, map_location="cpu", weights_only=True)
    except Exception as error:
        raise ValueError(
            f"checkpoint_path {checkpoint_path!r} could not be read as safetensors "
            f"or a weights-only torch state dict ({type(error).__name__}); convert "
            f"it to .safetensors"
        ) from error
    for wrapper in ("state_dict", "model", "module"):  # common training-checkpoint nestings
        if isinstance(obj, dict) and isinstance(obj.get(wrapper), dict):
            obj = obj[wrapper]
    if not isinstance(obj, dict) or not any(isinstance(v, Tensor) for v in obj.values()):
        raise ValueError(f"checkpoint_path {checkpoint_path!r} holds no state dict of tensors")
    return {k.removeprefix("module."): v for k, v in obj.items() if isinstance(v, Tensor)}


def load_strict(model: nn.Module, state_dict: dict[str, Tensor], checkpoint_path: str | None) -> None:
    """Strict load whose failure is one line naming the file and a few offending keys."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    mismatched = sorted(k for k in set(own) & set(state_dict) if own[k].shape != state_dict[k].shape)
    if missing or unexpected or mismatched:
        raise ValueError(
            f"checkpoint_path {checkpoint_path!r} does not fit the architecture: "
            f"missing {missing[:3]} ({len(missing)}), unexpected {unexpected[:3]} "
            f"({len(unexpected)}), shape mismatch {mismatched[:3]} "
            f"({len(mismatched)})"
        )
    model.load_state_dict(state_dict, strict=True)
