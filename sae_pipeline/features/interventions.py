"""`features --intervene`: each measured atom removed inside the backbone on its own top images, the model's own
output change, against a matched removal (the section "Removed inside the backbone" of its page).

Why on the atom pages: the top images say what makes an atom fire; this says what the vision model downstream of
the layer does without it, on those same images. The intervention is `evaluate intervene`'s
(`sae_pipeline.evaluate.intervene`: the hook on the extracted layer, x' = x + (s − 1) z_j d_j on every token with the
SAE's error x − x̂ kept, the change as KL with a class head, 1 − cos of the final embedding otherwise), run here per
(image, atom) pair, batched.

Why a matched removal: removing any active code moves the output somewhat, so a change alone has no scale. On each
image, the baseline removes *another* atom active on the same image, the one whose summed |code| over the image's
tokens is closest to this atom's (`sae_pipeline.evaluate.causal_stats.matched_entries`, the rule of
`evaluate causal`): both remove something present, of the same size. Per atom: the mean change over its images, the
matched removal's, their paired difference, each with a 95 % t interval over images, and the change of x̂ alone (the
SAE's error dropped: the cost of the SAE itself, for scale).

Why the images' batches are fixed: a forward's numbers for one image may depend on what else is in the batch
(the kernels a batch shape selects). The outputs without intervention and every intervened forward of an image are
run in the same batch of the same images, so an atom whose removal changes nothing (scale 1) gives 0 exactly.

The backbone is the one that made `--data.source`'s tokens (its manifest's extraction record), rebuilt as
`features explain` rebuilds an SAE's (`explain_backbone.py`), before the pass: what cannot be rebuilt is one line.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

INTERVENE_ATOMS = 32  # atoms measured by default: the most frequent among those with a page
IMAGES_PER_FORWARD = 16


def backbone_of_data(datamodule: Any, checkpoint_path: str | None, d_in: int) -> Any:
    """The backbone that made ``datamodule``'s tokens, rebuilt (one line when it cannot be)."""
    from feature_extraction.shards import extraction_record
    from sae_pipeline.data.sources import ShardSource
    from sae_pipeline.evaluate.intervene import hooked_module
    from sae_pipeline.features.explain_backbone import build_backbone, check_record

    source = datamodule.data_source
    where = f"--data.source {datamodule.source}"
    if not isinstance(source, ShardSource):
        raise ValueError(
            f"--intervene: {where} has no backbone (digits, MNIST or an .h5 token cache: tokens without the model "
            "that made them); it needs shards of python -m feature_extraction, or leave out --intervene"
        )
    record = extraction_record(source.manifest)
    if record is None:
        raise ValueError(
            f"--intervene: {where}: its manifest records no backbone that can be rebuilt (shards of an older "
            "extraction or written by hand); re-extract with python -m feature_extraction, or leave out --intervene"
        )
    try:
        check_record(record, Path(str(datamodule.source)))
        backbone = build_backbone(record, checkpoint_path, d_in)
        hooked_module(backbone)  # a layer that cannot be hooked: one line now
    except ValueError as exn:
        text = (
            str(exn)
            .replace(f"--sae {datamodule.source}", where)
            .replace("export the SAE's checkpoint again", "re-extract")
        )
        raise ValueError(f"--intervene: {text}") from None
    return backbone.eval()


def measured_atoms(state: dict[str, Tensor], atoms: Sequence[int] | None, m: int) -> list[int]:
    """The ``m`` atoms with a page that fire on most tokens (ties: the lower id), ascending; 0: all of them."""
    d_sae = state["value"].shape[0]
    pages = sorted(set(atoms)) if atoms else list(range(d_sae))
    fire = state["fire_count"].double().numpy()
    ranked = sorted(pages, key=lambda a: (-fire[a], a))
    return sorted(ranked if m == 0 else ranked[:m])


def top_images(state: dict[str, Tensor], atoms: list[int]) -> dict[int, list[tuple[int, int]]]:
    """Each atom's top images as ``(slot, image key)``, in page order."""
    token, image = state["token"].numpy(), state["image"].numpy()
    return {a: [(r, int(image[a, r])) for r in range(token.shape[1]) if token[a, r] >= 0] for a in atoms}


def image_pixels(
    collection: dict[str, Any], keys: set[int], images_dpath: str | None, preprocess: Any
) -> tuple[dict[int, Tensor], dict[int, str]]:
    """The backbone's input for each image key, and why for those not measured (changed since extraction)."""
    from sae_pipeline.features.images import ImageChangedError, SourceImages

    images = SourceImages(images_dpath)
    pixels, skipped = {}, {}
    for key in sorted(keys):
        try:
            pixels[key] = preprocess(images.open(collection["images"][key]))
        except ImageChangedError:
            skipped[key] = "changed since extraction"
    return pixels, skipped


@dataclass
class Measured:
    """Per (image, atom) removal: the change, and (with a head) whether the top class changed; per image, x̂ only's."""

    head: bool
    change: dict[tuple[int, int], float] = field(default_factory=dict)
    top_changed: dict[tuple[int, int], bool] = field(default_factory=dict)
    xhat: dict[int, float] = field(default_factory=dict)
    xhat_top_changed: dict[int, bool] = field(default_factory=dict)
    matched: dict[tuple[int, int], int] = field(default_factory=dict)  # (image, atom) -> matched atom


def _groups(tops: dict[int, list[tuple[int, int]]], keys: list[int], size: int) -> list[list[int]]:
    """Images in batches of ``size``, those with as many removals together (less padding in the rounds)."""
    count = {key: 0 for key in keys}
    for pairs in tops.values():
        for _, key in pairs:
            if key in count:
                count[key] += 1
    ordered = sorted(keys, key=lambda k: (-count[k], k))
    return [ordered[i : i + size] for i in range(0, len(ordered), size)]


def _kept(seen: list[Tensor]) -> Any:
    """The tokens unchanged, kept in ``seen`` (the codes the matching compares are theirs)."""

    def keep(x: Tensor) -> Tensor:
        seen.append(x)
        return x

    return keep


def _one_atom_per_row(sae: Any, atoms: list[int], scale: float) -> Any:
    """Row b's tokens with atom ``atoms[b]`` scaled (`evaluate intervene`'s replacement); rows with -1 unchanged."""
    from sae_pipeline.evaluate.intervene import scaled_atoms

    device = sae.W_dec.device
    replace = {a: scaled_atoms(sae, torch.tensor([a], device=device), scale) for a in set(atoms) if a >= 0}
    return lambda x: torch.stack([replace[a](x[b : b + 1])[0] if a >= 0 else x[b] for b, a in enumerate(atoms)])


@torch.no_grad()
def measure(
    sae: Any,
    backbone: Any,
    tops: dict[int, list[tuple[int, int]]],
    pixels: dict[int, Tensor],
    scale: float = 0.0,
    device: str = "cpu",
    batch_size: int = IMAGES_PER_FORWARD,
) -> Measured:
    """Every atom of ``tops`` scaled by ``scale`` on each of its images that has ``pixels``, and its matched atom."""
    from sae_pipeline.evaluate.causal_stats import matched_entries
    from sae_pipeline.evaluate.intervene import change, has_head, model_output, reconstruction_only, replaced_tokens
    from sae_pipeline.training.interrupts import raise_if_interrupted

    torch_device = torch.device(device)
    backbone.to(torch_device)
    sae = sae.to(torch_device).eval()
    model = backbone.model
    found = Measured(has_head(model))
    groups = _groups(tops, sorted(pixels), batch_size)
    original: dict[int, Tensor] = {}
    entries: list[tuple[int, int, float]] = []  # (image, atom, Σ |z| over its tokens): what the matching compares
    for group in groups:
        raise_if_interrupted()
        batch = torch.stack([pixels[k] for k in group]).to(torch_device)
        seen: list[Tensor] = []
        with replaced_tokens(backbone, _kept(seen)):
            before = model_output(model, batch)
        with replaced_tokens(backbone, reconstruction_only(sae)):
            xhat = model_output(model, batch)
        xhat_change = change(before, xhat, found.head)
        for b, key in enumerate(group):
            original[key] = before[b]
            found.xhat[key] = float(xhat_change[b])
            found.xhat_top_changed[key] = bool(before[b].argmax() != xhat[b].argmax())
            sums = sae.encode(seen[0][b].float()).abs().sum(0)
            entries += [(key, int(a), float(sums[a])) for a in torch.nonzero(sums)[:, 0].tolist()]
    i, j, z = (np.array([e[n] for e in entries], dtype) for n, dtype in ((0, np.int64), (1, np.int64), (2, float)))
    matched = matched_entries(i, j, z) if len(entries) else np.zeros(0, np.int64)
    entry = {(int(a), int(b)): n for n, (a, b) in enumerate(zip(i, j))}
    todo: dict[int, set[int]] = {key: set() for key in pixels}
    for atom, pairs in tops.items():
        for _, key in pairs:
            if key not in pixels:
                continue
            todo[key].add(atom)
            n = entry.get((key, atom), -1)
            if n >= 0 and matched[n] >= 0:
                found.matched[(key, atom)] = int(j[matched[n]])
                todo[key].add(int(j[matched[n]]))
    for group in groups:
        lists = [sorted(todo[key]) for key in group]
        for r in range(max(map(len, lists), default=0)):  # round r: each image's r-th removal, the same batch
            raise_if_interrupted()
            atoms = [atoms[r] if r < len(atoms) else -1 for atoms in lists]
            batch = torch.stack([pixels[k] for k in group]).to(torch_device)
            with replaced_tokens(backbone, _one_atom_per_row(sae, atoms, scale)):
                after = model_output(model, batch)
            before = torch.stack([original[k] for k in group])
            moved = change(before, after, found.head)
            for b, (key, atom) in enumerate(zip(group, atoms)):
                if atom >= 0:
                    found.change[(key, atom)] = float(moved[b])
                    found.top_changed[(key, atom)] = bool(before[b].argmax() != after[b].argmax())
    return found


def atom_arrays(found: Measured, tops: dict[int, list[tuple[int, int]]], d_sae: int, n_top: int) -> dict[str, Any]:
    """``features.npz``'s ``intervene_*`` arrays: per atom and per (atom, top slot), NaN (-1) where not measured."""
    from sae_pipeline.evaluate.causal_stats import per_atom_t

    shape = (d_sae, n_top)
    image = {name: np.full(shape, np.nan) for name in ("effect", "matched", "xhat")}
    image["matched_atom"] = np.full(shape, -1, np.int64)
    flags = {name: np.full(shape, np.nan) for name in ("top", "matched_top", "xhat_top")}
    for atom, pairs in tops.items():
        for slot, key in pairs:
            if (key, atom) not in found.change:
                continue
            image["effect"][atom, slot] = found.change[(key, atom)]
            image["xhat"][atom, slot] = found.xhat[key]
            flags["top"][atom, slot] = found.top_changed[(key, atom)]
            flags["xhat_top"][atom, slot] = found.xhat_top_changed[key]
            other = found.matched.get((key, atom), -1)
            if other >= 0:
                image["matched_atom"][atom, slot] = other
                image["matched"][atom, slot] = found.change[(key, other)]
                flags["matched_top"][atom, slot] = found.top_changed[(key, other)]
    rows = np.broadcast_to(np.arange(d_sae)[:, None], shape)
    measured, paired = np.isfinite(image["effect"]), np.isfinite(image["matched"])
    out: dict[str, Any] = {"intervene_measured": np.zeros(d_sae, bool)}
    out["intervene_measured"][list(tops)] = True
    stats = {
        "effect": per_atom_t(image["effect"][measured], rows[measured], d_sae),
        "matched": per_atom_t(image["matched"][paired], rows[paired], d_sae),
        "excess": per_atom_t((image["effect"] - image["matched"])[paired], rows[paired], d_sae),
        "xhat": per_atom_t(image["xhat"][measured], rows[measured], d_sae),
    }
    for name, values in stats.items():
        out[f"intervene_{name}"], out[f"intervene_{name}_low"] = values["mean"], values["low"]
        out[f"intervene_{name}_high"] = values["high"]
    out["intervene_n"], out["intervene_n_matched"] = stats["effect"]["n"], stats["matched"]["n"]
    for name, values in flags.items():  # the share of images whose top class changes (with a head)
        counted = np.isfinite(values).sum(1)
        with np.errstate(invalid="ignore", divide="ignore"):
            share = np.nansum(values, axis=1) / counted
        out[f"intervene_{name}_changed"] = np.where((counted > 0) & found.head, share, np.nan)
    for name, values in image.items():
        out[f"intervene_image_{name}"] = values
    return out


@dataclass
class AtomInterventions:
    """What the site shows and stores: the arrays of :func:`atom_arrays` and what was run."""

    arrays: dict[str, Any]
    backbone: str
    layer: int
    head: bool
    atoms: list[int]
    rule: str
    images_skipped: int

    @property
    def output(self) -> str:
        return "class logits" if self.head else "final embedding"

    def summary(self) -> dict[str, Any]:
        """``features.json``'s ``intervene``."""
        return {
            "backbone": self.backbone,
            "layer": self.layer,
            "output": self.output,
            "measure": "KL(p || p') of the class distribution" if self.head else "cosine distance 1 - cos(e, e')",
            "atoms": self.atoms,
            "rule": self.rule,
            "images_skipped": self.images_skipped,
            "baseline": "the matched removal: on each image, the other active atom with the closest summed |code|",
        }


def intervene_site(
    sae: Any,
    backbone: Any,
    state: dict[str, Tensor],
    collection: dict[str, Any],
    atoms: Sequence[int] | None,
    m: int,
    images_dpath: str | None,
    device: str,
) -> AtomInterventions:
    """The measured atoms (:func:`measured_atoms`) removed on their top images: everything the site needs."""
    chosen = measured_atoms(state, atoms, m)
    tops = top_images(state, chosen)
    keys = {key for pairs in tops.values() for _, key in pairs}
    pixels, skipped = image_pixels(collection, keys, images_dpath, backbone.preprocess)
    found = measure(sae, backbone, tops, pixels, 0.0, device)
    d_sae, n_top = state["value"].shape
    rule = "every atom with a page" if m == 0 else f"the {m} atoms with a page that fire on most tokens"
    return AtomInterventions(
        atom_arrays(found, tops, d_sae, n_top),
        backbone.spec.name,
        int(backbone.layer),
        found.head,
        chosen,
        rule,
        len(skipped),
    )
