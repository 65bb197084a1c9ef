"""Pretrained downloads: fail in one line that names `--checkpoint_path`, and fail fast.

Nothing touches the network unless `pretrained=True`; the adapters build pretrained
models only through `download`, so every library's hub, network and cache errors (which
take many forms) become the same one-line RuntimeError.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import urlparse

from feature_extraction.backbones.spec import BackboneSpec

T = TypeVar("T")


def download(spec: BackboneSpec, create: Callable[[], T]) -> T:
    """`create()` (a library call that downloads weights), its failure as one line."""
    require_hub_reachable(spec)
    try:
        return create()
    except Exception as error:  # hub/network/cache errors take many forms
        raise download_error(spec, error) from error


def require_hub_reachable(spec: BackboneSpec) -> None:
    """Fail in seconds, not after a minute of hub retries, when the hub cannot be reached.

    Skipped when `HF_HUB_OFFLINE` is set (the hub library then serves its cache or fails
    fast itself) and behind a proxy (a direct connection says nothing there).
    """
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or any(
        os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
    ):
        return
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=5).close()
    except OSError as error:
        raise download_error(spec, error) from error


def download_error(spec: BackboneSpec, error: BaseException) -> RuntimeError:
    detail = " ".join(str(error).split())[:200]
    return RuntimeError(
        f"could not download pretrained weights for backbone {spec.name!r} ({spec.model_name}, "
        f"tag {spec.pretrained_tag}): {type(error).__name__}: {detail}. Offline, pass "
        f"--checkpoint_path FILE (local .safetensors or state dict) with --pretrained false, or "
        f"set HF_HUB_OFFLINE=1 to use weights already in the Hugging Face cache"
    )
