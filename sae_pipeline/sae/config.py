"""An SAE's config, ``{"class_path", "init_args"}``: read off an instance, and built back.

This is how an SAE is (de)serialised everywhere: the Lightning checkpoint (``sae_config``),
the native export's ``config.json`` and the training module's hyper-parameters. It lives with
the variants, not with export, so that training (``sae_pipeline.training.module``) depends on the SAEs
only and never on the export or predict commands.

The SAE's constructor arguments are the whole config: every variant keeps each constructor
argument as an attribute of the same name, so the config is read off the instance with
``inspect.signature`` and rebuilt with ``build_sae`` (weights freshly initialised; the
state dict is loaded by whoever holds it).
"""
from __future__ import annotations

import importlib
import inspect
from typing import Any

from sae_pipeline.sae.base import SparseAutoencoder


class ExportError(ValueError):
    """A checkpoint or export directory that cannot be read; the message names the file and the fix."""


def class_path_of(cls: type) -> str:
    """``sae_pipeline.sae.Name`` for the package's variants (their public path), else ``module.Name``."""
    import sae_pipeline.sae as sae_package  # the package imports this module: look it up on use

    if getattr(sae_package, cls.__name__, None) is cls:
        return f"{sae_package.__name__}.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def sae_config(sae: SparseAutoencoder) -> dict[str, Any]:
    """``{"class_path", "init_args"}`` of an SAE instance, as plain JSON data.

    Read from the constructor signature and the attributes of the same name (the variants'
    convention), so any variant, including a user's subclass that follows it, round-trips.
    """
    cls = type(sae)
    init_args: dict[str, Any] = {}
    for name, parameter in inspect.signature(cls.__init__).parameters.items():
        if name == "self" or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if not hasattr(sae, name):
            raise ExportError(f"{cls.__name__} has no attribute {name!r} for its constructor argument; "
                              "keep every constructor argument as an attribute of the same name")
        value = getattr(sae, name)
        if not (value is None or isinstance(value, (bool, int, float, str))):
            raise ExportError(f"{cls.__name__}.{name} = {value!r} is not a JSON scalar; the SAE config must be plain")
        init_args[name] = value
    return {"class_path": class_path_of(cls), "init_args": init_args}


def resolve_sae_class(class_path: str) -> type[SparseAutoencoder]:
    """Import ``class_path`` and check that it names a :class:`SparseAutoencoder` subclass."""
    from sae_pipeline.sae import SAE_REGISTRY

    module_name, _, class_name = str(class_path).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError):
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, SparseAutoencoder)):
        names = ", ".join(class_path_of(c) for c in SAE_REGISTRY.values())
        raise ExportError(f"class_path {class_path!r} is not an SAE class; use one of {names}")
    return cls


def build_sae(config: dict[str, Any]) -> SparseAutoencoder:
    """Instantiate the SAE described by ``{"class_path", "init_args"}`` (weights freshly initialised)."""
    if not isinstance(config, dict) or "class_path" not in config:
        raise ExportError(f"SAE config must be a dict with 'class_path' and 'init_args', got {config!r}")
    return resolve_sae_class(config["class_path"])(**dict(config.get("init_args") or {}))
