"""Vision backbones whose token activations the SAEs are trained on.

One concept per module:

- `spec.py`: `BackboneSpec`, what a backbone is and the token layout the manifest records.
- `registry.py`: `BACKBONES`, one entry per backbone (adding a backbone is one entry
  there plus its extraction config and data piece: `sae_pipeline.config_files`).
- `adapter.py`: the interface of a library adapter (build, tokens of a layer, layout);
  `timm_adapter.py` and `open_clip_adapter.py` implement it, one module per library.
- `weights.py`: local weights (safetensors or `weights_only` torch files), strict load.
- `hub.py`: pretrained downloads that fail fast, in one line naming `--checkpoint_path`.
- `backbone.py`: `load_backbone` and the frozen `Backbone` module (`to_json` is the
  manifest's backbone record).

Nothing touches the network unless `pretrained=True`.
"""

from feature_extraction.backbones.backbone import Backbone, load_backbone
from feature_extraction.backbones.registry import BACKBONES, get_backbone_spec
from feature_extraction.backbones.spec import BackboneSpec

__all__ = ["BACKBONES", "Backbone", "BackboneSpec", "get_backbone_spec", "load_backbone"]
