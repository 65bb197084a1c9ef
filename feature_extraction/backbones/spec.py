"""What a backbone is: the registry entry, and the token layout recorded in every shard manifest.

The numbers (tokens, grid, width, depth) are written down, not read from the model, so
that the architecture check (each adapter's `layout`) can compare them with what the
library really built: a library upgrade that changes an architecture fails loudly instead
of silently changing the shard layout.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Library = Literal["timm", "open_clip"]  # one adapter module each (`backbone.ADAPTERS`)


@dataclass(frozen=True)
class BackboneSpec:
    """What a backbone is and the token layout it produces (recorded in the manifest)."""

    name: str
    library: Library
    model_name: str
    pretrained_tag: str | None  # timm hub tag / open_clip pretrained tag; None: random only
    n_prefix_tokens: int  # CLS + register tokens (SigLIP has none)
    grid: tuple[int, int]  # patch grid (rows, columns) at `image_size`
    d: int  # token width
    image_size: int
    n_blocks: int  # transformer depth; valid layers are 0..n_blocks-1
    model_kwargs: dict[str, Any] = field(default_factory=dict, hash=False)  # builder overrides
    # Ships configs/extract_<name>.yaml, configs/data/<name>.yaml and the shortcut
    # configs/<variant>_<name>.yaml per SAE variant (the tests derive the config lists from
    # this flag); not part of the manifest record.
    has_configs: bool = False

    @property
    def n_tokens(self) -> int:
        """Tokens per image: prefix tokens plus one per patch."""
        return self.n_prefix_tokens + self.grid[0] * self.grid[1]

    def to_json(self) -> dict:
        """A JSON-ready dict (tuples become lists) for the shard manifest."""
        record = asdict(self)
        del record["has_configs"]  # which configs the repo ships says nothing about the tokens
        record["grid"] = list(self.grid)
        record["n_tokens"] = self.n_tokens
        return record
