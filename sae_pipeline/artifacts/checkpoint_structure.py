"""What a checkpoint's readers index, checked before any of them does (`checkpoint.py` reads the file): its
nesting, the sections that must be mappings, the weights as named tensors, each SAE's config sized as its weights.

A forged checkpoint is data from someone else: a part of the wrong kind or size is one `CheckpointError` naming
it, before a reader walks it (recursion) or builds an SAE from it (an allocation the file does not hold).
"""

from __future__ import annotations

from typing import Any

import torch

from feature_extraction.file_checks import shown
from sae_pipeline.sae.config import ExportError, check_sae_config, check_sae_size

MAX_NESTING = 64  # what fit writes nests under 10 deep (optimizer and loop states)
DAMAGED = "the checkpoint is damaged or not from this package; pass one written by `fit`"


class CheckpointError(ExportError):
    """A ``--ckpt_path`` that cannot be used; the message names the file and the fix.

    An :class:`~sae_pipeline.sae.config.ExportError`, so a caller that handles an unreadable export
    handles an unreadable checkpoint the same way.
    """


def nesting_depth(value: object) -> int:
    """How deeply containers nest in ``value`` (tensors and scalars are leaves); iterative, so any depth is measured
    without the recursion the readers below use (a forged checkpoint may nest thousands deep)."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, (list, tuple, set, frozenset)):
            children = node
        else:
            continue
        deepest = max(deepest, depth + 1)
        if deepest > MAX_NESTING:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest


def check_structure(checkpoint: dict[str, Any], where: str) -> None:
    """The parts of a checkpoint its readers index, checked before any of them does (one CheckpointError naming
    the part): the sections that are mappings, ``state_dict`` names mapped to tensors, each SAE's ``sae_config``
    (``{class_path, init_args}`` of plain values) sized as the ``W_dec`` its weights hold (building the SAE then
    allocates no more than the file holds), and the model's saved ``sae`` of the same size."""
    for key in ("hyper_parameters", "datamodule_hyper_parameters", "data", "sae_group", "callbacks"):
        if checkpoint.get(key) is not None and not isinstance(checkpoint[key], dict):
            raise CheckpointError(f"{where}: {key} is {type(checkpoint[key]).__name__}, not a mapping; {DAMAGED}")
    state = checkpoint["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()):
        raise CheckpointError(f"{where}: state_dict does not map parameter names to tensors; {DAMAGED}")
    models = [("", "sae.", checkpoint, [])] if "sae_config" in checkpoint else []
    group_members = (checkpoint.get("hyper_parameters") or {}).get("members")
    for name, entry in (checkpoint.get("sae_group") or {}).items():
        if not isinstance(entry, dict):
            raise CheckpointError(f"{where}: member {name!r} is {type(entry).__name__}, not a mapping; {DAMAGED}")
        # the group's own hyper-parameters hold each member's sae too: LightningCLI builds the group from those
        saved = group_members.get(name) if isinstance(group_members, dict) else None
        models.append((f"member {name}: ", f"members.{name}.sae.", entry, [saved] if isinstance(saved, dict) else []))
    for label, prefix, entry, more in models:
        try:
            config = check_sae_config(entry.get("sae_config"), f"{where}: {label}sae_config")
            init_args = config.get("init_args") or {}
            w_dec = state.get(prefix + "W_dec")
            check_sae_size(init_args, None if w_dec is None else list(w_dec.shape), f"{where}: {label}sae_config")
        except ExportError as exn:
            raise CheckpointError(f"{exn}; {DAMAGED}") from None
        hparams = entry.get("hyper_parameters")
        if hparams is not None and not isinstance(hparams, dict):
            raise CheckpointError(f"{where}: {label}hyper_parameters is not a mapping; {DAMAGED}")
        for saved in [(hparams or {}).get("sae"), *(member.get("sae") for member in more)]:
            saved_args = saved.get("init_args") if isinstance(saved, dict) else None
            for size in ("d_in", "d_sae") if isinstance(saved_args, dict) else ():
                if saved_args.get(size) is not None and saved_args[size] != init_args.get(size):
                    raise CheckpointError(
                        f"{where}: {label}its saved model's sae has {size} = {shown(saved_args[size])}, its "
                        f"sae_config {shown(init_args.get(size))}; {DAMAGED}"
                    )
