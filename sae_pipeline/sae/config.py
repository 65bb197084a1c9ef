"""An SAE's config, ``{"class_path", "init_args"}``: read off an instance, and built back.

This is how an SAE is (de)serialised everywhere: the Lightning checkpoint (``sae_config``),
the native export's ``config.json`` and the training module's hyper-parameters. It lives with
the variants, not with export, so that training (``sae_pipeline.training.module``) depends on the SAEs
only and never on the export or predict commands.

The SAE's constructor arguments are the whole config: every variant keeps each constructor
argument as an attribute of the same name, so the config is read off the instance with
``inspect.signature`` and rebuilt with ``build_sae`` (weights freshly initialised; the
state dict is loaded by whoever holds it).

Reading a config imports nothing it names: an export or checkpoint may come from someone else,
and with ``python -m`` the current folder is on ``sys.path``, so a ``class_path`` naming a
module shipped beside the artifact would run that file. The registry (the ``variant`` key or a
registered class path) and the modules already loaded resolve without importing; the user's own
subclass needs its module in ``SAE_PIPELINE_TRUSTED_MODULES`` (comma-separated modules or
packages), e.g. ``SAE_PIPELINE_TRUSTED_MODULES=mylab.saes python -m sae_pipeline export ...``.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from typing import Any

from feature_extraction.file_checks import shown
from sae_pipeline.sae.base import SparseAutoencoder

#: Comma-separated modules (or packages) an artifact's ``class_path`` may import: the user's own SAE subclasses.
TRUSTED_MODULES_ENV = "SAE_PIPELINE_TRUSTED_MODULES"
#: The shape of a class named by its import path (``package.module.Name``).
IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")


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
            raise ExportError(
                f"{cls.__name__} has no attribute {name!r} for its constructor argument; "
                "keep every constructor argument as an attribute of the same name"
            )
        value = getattr(sae, name)
        if not (value is None or isinstance(value, (bool, int, float, str))):
            raise ExportError(f"{cls.__name__}.{name} = {value!r} is not a JSON scalar; the SAE config must be plain")
        init_args[name] = value
    return {"class_path": class_path_of(cls), "init_args": init_args}


def _registered(class_path: str, variant: object = None) -> type[SparseAutoencoder] | None:
    """The registry's class for an artifact's ``variant`` key or ``class_path`` (its public path
    ``sae_pipeline.sae.Name`` or its defining module's), None when neither names a variant. A ``variant``
    and ``class_path`` that name different classes are an ExportError naming both: which of the two the
    author meant cannot be known, and taking the key's silently loads an SAE the file's class path denies."""
    from sae_pipeline.sae import SAE_ALIASES, SAE_REGISTRY

    named = next(
        (
            cls
            for cls in SAE_REGISTRY.values()
            if class_path in (class_path_of(cls), f"{cls.__module__}.{cls.__qualname__}")
        ),
        None,
    )
    if isinstance(variant, str) and SAE_ALIASES.get(variant, variant) in SAE_REGISTRY:
        cls = SAE_REGISTRY[SAE_ALIASES.get(variant, variant)]
        if named is not cls:  # loading either would hand the user an SAE the other field denies
            raise ExportError(
                f"variant {variant!r} ({class_path_of(cls)}) and class_path {class_path!r} name different "
                "classes; the file was edited or damaged: fix one of the two, or export the SAE again"
            )
        return cls
    return named


def trusted_modules() -> tuple[str, ...]:
    """The modules the user allows an artifact's ``class_path`` to import (``SAE_PIPELINE_TRUSTED_MODULES``,
    comma-separated; a package name allows its submodules)."""
    return tuple(name.strip() for name in os.environ.get(TRUSTED_MODULES_ENV, "").split(",") if name.strip())


def _is_trusted(module_name: str) -> bool:
    return any(module_name == name or module_name.startswith(name + ".") for name in trusted_modules())


def untrusted_class_path(class_path: object) -> str | None:
    """Why resolving ``class_path`` would import code the user has not chosen, or None when it would not.

    Nothing is imported: a module already loaded in this process (the package's own, the user's
    config's, Lightning's) runs no new code when looked up; any other module may be a file the
    artifact's author planted beside it (``python -m`` puts the current folder on ``sys.path``), so
    it needs the user's allow-list.
    """
    module_name = str(class_path).rpartition(".")[0]
    if not module_name or module_name in sys.modules or _is_trusted(module_name):
        return None
    return (
        f"class_path {class_path!r} names module {module_name!r}, which is not loaded and not trusted; nothing "
        f"was imported. If it is your own code, allow it: {TRUSTED_MODULES_ENV}={module_name}"
    )


def check_class_paths(data: object, where: str, strings: bool = False) -> None:
    """Refuse an artifact whose saved config names a module that reading it would import.

    LightningCLI merges a checkpoint's hyper-parameters into the parsed config and jsonargparse
    imports every ``class_path`` there, so a checkpoint is checked whole, before that happens.
    With ``strings``, a plain string shaped as an import path counts too: jsonargparse reads a string
    given for a class-typed argument (``model.sae: evilmod.EvilSAE``) as that class's path. It is for
    the model's sections, where no setting of ours is such a string; a data section may hold a file
    name such as ``acts.h5``, which is not read as a class.
    """
    if isinstance(data, dict):
        for key, value in data.items():
            if key in ("class_path", "_class_path") and isinstance(value, str):
                _refuse_untrusted(value, where)
            else:
                check_class_paths(value, where, strings)
    elif isinstance(data, (list, tuple)):
        for value in data:
            check_class_paths(value, where, strings)
    elif strings and isinstance(data, str) and IMPORT_PATH.fullmatch(data):
        _refuse_untrusted(data, where)


def _refuse_untrusted(class_path: str, where: str) -> None:
    problem = untrusted_class_path(class_path)
    if problem:
        raise ExportError(f"{where}: {problem}")


def resolve_sae_class(class_path: str, variant: object = None) -> type[SparseAutoencoder]:
    """The SAE class an artifact names, importing nothing the artifact chose.

    An artifact (export, checkpoint, SAELens directory) made by someone else is data: its
    ``variant`` key or a registered ``class_path`` resolves through the registry; a class of a
    module already imported is looked up; any other module is imported only when the user lists
    it in ``SAE_PIPELINE_TRUSTED_MODULES`` (their own subclass). Otherwise one ExportError names
    the class path and that fix.
    """
    from sae_pipeline.sae import SAE_REGISTRY

    cls = _registered(str(class_path), variant)
    if cls is not None:
        return cls
    names = ", ".join(class_path_of(c) for c in SAE_REGISTRY.values())
    problem = untrusted_class_path(class_path)
    if problem:
        raise ExportError(f"{problem} (the registered variants: {names})")
    module_name, _, class_name = str(class_path).rpartition(".")
    try:
        module = sys.modules.get(module_name) or importlib.import_module(module_name)
        cls = getattr(module, class_name, None)
    except (ImportError, ValueError):
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, SparseAutoencoder)):
        raise ExportError(f"class_path {class_path!r} is not an SAE class; use one of {names}")
    return cls


def check_sae_config(config: object, where: str = "SAE config") -> dict[str, Any]:
    """``config`` if it has the shape `build_sae` reads: ``class_path`` a string, ``init_args`` absent, null or a
    mapping of argument names to JSON scalars (what `sae_config` writes); else one ExportError naming ``where``.

    An artifact's config may be edited or forged: a list, a nested object or a number where a name is expected
    would otherwise surface as a TypeError from the constructor's call."""
    if not isinstance(config, dict) or not isinstance(config.get("class_path"), str):
        raise ExportError(
            f"{where}: the SAE config must be an object with a class_path string and init_args, not {shown(config)}"
        )
    init_args = config.get("init_args")
    if init_args is not None and not (
        isinstance(init_args, dict)
        and all(
            isinstance(k, str) and (v is None or isinstance(v, (bool, int, float, str))) for k, v in init_args.items()
        )
    ):
        raise ExportError(
            f"{where}: init_args must map argument names to plain values (numbers, strings, true/false, null), "
            f"not {shown(init_args)}"
        )
    return config


def check_sae_size(init_args: dict[str, Any], w_dec_shape: object, where: str) -> None:
    """Refuse an SAE config whose ``d_in`` / ``d_sae`` are not the shape ``[d_sae, d_in]`` of the ``W_dec`` the
    artifact holds: building the SAE allocates what the config says, so a forged ``d_sae`` of 10^12 would take the
    machine's memory before the weights are compared. Checked first, the SAE is never larger than its weights."""
    shape = [int(n) for n in w_dec_shape] if isinstance(w_dec_shape, (list, tuple)) else None
    d_in, d_sae = init_args.get("d_in"), init_args.get("d_sae")
    sizes_ok = all(isinstance(n, int) and not isinstance(n, bool) for n in (d_in, d_sae))
    if shape is None or not sizes_ok or shape != [d_sae, d_in]:
        held = "no W_dec" if shape is None else f"W_dec of shape {shape}"
        raise ExportError(
            f"{where}: init_args d_sae = {shown(d_sae)}, d_in = {shown(d_in)} but its weights hold {held} "
            "([d_sae, d_in]); the artifact is damaged or edited: write it again"
        )


def build_sae(config: dict[str, Any]) -> SparseAutoencoder:
    """Instantiate the SAE described by ``{"class_path", "init_args"}`` (weights freshly initialised)."""
    check_sae_config(config)
    cls = resolve_sae_class(config["class_path"], config.get("variant"))
    return cls(**dict(config.get("init_args") or {}))
