"""Reading a checkpoint of ``fit``: the one reader behind every command that takes ``--ckpt_path``.

``fit`` / ``validate`` / ``test`` / ``predict`` (the CLI's check, its merge of the saved
hyper-parameters and Lightning's restore through ``AtomicCheckpointIO``), ``export`` in both
formats, ``features`` and ``evaluate`` all read a checkpoint here, so a file is judged the same way
and its problems read the same whatever command met it.

A checkpoint may come from someone else, so it is data, never code: ``torch.load(weights_only=True)``
(no pickle), its format checked, and every class path its saved configs name checked
(:func:`sae_pipeline.sae.config.check_class_paths`) before anything uses the content (LightningCLI
merges the hyper-parameters into its config, and jsonargparse imports every ``class_path`` there).
A problem is one :class:`CheckpointError` line naming the file and the fix, never torch's advice to
load with ``weights_only=False`` (which would run code from the file). Callers ask for what they
need beyond the weights and the SAE's config: ``need=("input_scale",)`` to export, ``for_fit`` for a
training state to resume.

Checkpoints written before the layout move (``sae_pipeline.module`` became
``sae_pipeline.training.module``, ``sae_pipeline.export`` became ``sae_pipeline.artifacts.export``,
...) load as they are: what ``fit`` stores names no module that moved (the SAE's class path is its
public ``sae_pipeline.sae.Name``, callback states are keyed by class name, the data module's
settings carry no class path). A saved config could still name one (LightningCLI stores a model
given by class path as ``_class_path``), so :data:`MOVED_MODULES` maps each old module to its new
one. It is an allow-list written here: an old path is rewritten because this table names it, and a
module is imported only when this table names it as the new home of a moved one, never because a
file names it.
"""

from __future__ import annotations

import importlib
import math
import re
from pathlib import Path
from typing import Any

import torch

from feature_extraction.file_checks import terminal_text
from sae_pipeline.artifacts.checkpoint_structure import (
    DAMAGED,
    MAX_NESTING,
    CheckpointError,
    check_structure,
    nesting_depth,
)
from sae_pipeline.sae import SparseAutoencoder
from sae_pipeline.sae.config import (
    ExportError,
    build_sae,
    check_class_paths,
    check_sae_config,
    check_sae_size,
    resolve_sae_class,
)

__all__ = [
    "CheckpointError",
    "MEMBER_NAME",
    "MEMBER_NAME_RULE",
    "MOVED_MODULES",
    "check_model_classes",
    "check_structure",
    "checkpoint_d_in",
    "checkpoint_input_scale",
    "current_class_path",
    "member_names",
    "read_checkpoint",
    "sae_from_checkpoint",
    "select_member",
]

FIT_KEYS = ("optimizer_states", "loops")  # what `fit --ckpt_path` needs beyond the weights
REQUIRED_KEYS = ("state_dict",)  # what every reader needs, and "sae_config" (one SAE) or "sae_group" (a group)
CONFIG_KEYS = ("sae_config", "sae_group", "hyper_parameters", "datamodule_hyper_parameters")  # class paths
MODEL_KEYS = ("sae_config", "sae_group", "hyper_parameters")  # what the model is built from
#: The modules ``fit`` trains, as a checkpoint's ``_class_path`` names them (the CLI's model given by class path).
MODEL_CLASSES = ("sae_pipeline.training.module.SAEModule", "sae_pipeline.training.group.SAEGroupModule")
INSTANTIATOR = "lightning.pytorch.cli.instantiate_module"  # what LightningCLI stores as ``_instantiator``


HINT = "pass a .ckpt written by `fit` (runs/<name>/version_N/checkpoints/last.ckpt, which fit prints)"
LAST_HINT = f"{HINT} or `last` for the newest"
#: A group member's name (``model.members.<name>``): it names folders (the member's TensorBoard run,
#: ``export``'s ``--out/NAME``), so one plain path component on every file system. Matched whole
#: (``fullmatch``): ``^...$`` with ``match`` lets a trailing newline through.
MEMBER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.=-]*")
MEMBER_NAME_RULE = "must start with a letter or digit and hold only letters, digits, '_', '.', '=' and '-'"

#: ``{module before the layout move: its module now}``; see the module docstring.
MOVED_MODULES: dict[str, str] = {
    **{
        f"sae_pipeline.{name}": f"sae_pipeline.training.{name}"
        for name in (
            "callbacks",
            "checkpointing",
            "ckpt_config",
            "interrupts",
            "lightning_compat",
            "lightning_noise",
            "module",
            "predict",
            "requeue",
            "step_boundary",
        )
    },
    **{f"sae_pipeline.{name}": f"sae_pipeline.artifacts.{name}" for name in ("codes", "export")},
    # The SAELens module was later split by concept; a path into it goes to the export side.
    "sae_pipeline.saelens": "sae_pipeline.artifacts.saelens_export",
    "sae_pipeline.artifacts.saelens": "sae_pipeline.artifacts.saelens_export",
}


def read_checkpoint(
    fpath: str | Path,
    *,
    need: tuple[str, ...] = (),
    for_fit: bool = False,
    flag: str = "--ckpt_path",
    last: bool = False,
    mmap: bool = False,
    map_location: Any = "cpu",
    name: str | None = None,
) -> dict[str, Any]:
    """The checkpoint in ``fpath``, checked: an ``SAEModule`` checkpoint holding ``need`` too (and a
    training state when ``for_fit``), whose saved configs name only classes that load without
    importing what the file chose (class paths of moved modules rewritten to their new path).

    ``flag`` and ``last`` (the command also takes ``last``) only shape the messages; ``mmap`` maps the
    tensors instead of reading them (cheap for a check that drops them). ``name`` picks one member of a
    group's checkpoint (:func:`select_member`), which then reads as a single SAE's.
    """
    fpath = Path(fpath)
    hint = LAST_HINT if last else HINT
    if not fpath.exists():
        raise CheckpointError(f"{flag} {fpath}: file not found; {hint}")
    if not fpath.is_file():
        raise CheckpointError(f"{flag} {fpath}: not a file; {hint}")
    try:
        checkpoint = torch.load(fpath, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as exn:  # noqa: BLE001 -- torch raises many types; its message advises weights_only=False
        raise CheckpointError(
            f"{flag} {fpath}: not a readable checkpoint (truncated, or not written by torch.save: "
            f"{type(exn).__name__}); {hint}"
        ) from None
    if isinstance(checkpoint, dict) and nesting_depth(checkpoint) > MAX_NESTING:  # before any walk of it
        raise CheckpointError(f"{flag} {fpath}: nests its data more than {MAX_NESTING} deep; {DAMAGED}")
    if isinstance(checkpoint, dict) and "sae_group" in checkpoint:
        member_names(checkpoint, f"{flag} {fpath}")  # before any name is used (a folder, a lookup)
    if isinstance(checkpoint, dict) and (name is not None or "sae_group" in checkpoint and "input_scale" in need):
        checkpoint = select_member(checkpoint, name, f"{flag} {fpath}")
    missing = [key for key in (*REQUIRED_KEYS, *need) if not isinstance(checkpoint, dict) or key not in checkpoint]
    if isinstance(checkpoint, dict) and "sae_config" not in checkpoint and "sae_group" not in checkpoint:
        missing.append("sae_config")
    if missing:
        raise CheckpointError(
            f"{flag} {fpath}: not an SAE checkpoint of this package (no {', '.join(missing)}); {hint}"
        )
    where = f"{flag} {fpath}"
    check_structure(checkpoint, where)
    configs = {key: checkpoint.get(key) for key in CONFIG_KEYS}
    _upgrade_class_paths(configs)
    try:
        check_instantiator(configs, where)
        check_class_paths(_without_instantiator({key: configs[key] for key in MODEL_KEYS}), where, strings=True)
        check_class_paths(configs["datamodule_hyper_parameters"], where)
        for hyper_parameters in (configs["hyper_parameters"], *_group_hyper_parameters(configs["sae_group"])):
            check_model_classes(hyper_parameters, where)
    except ExportError as exn:
        raise CheckpointError(str(exn)) from None
    if for_fit and any(key not in checkpoint for key in FIT_KEYS):
        raise CheckpointError(
            f"{flag} {fpath}: holds weights only, no training state to resume; start a new run "
            "without --ckpt_path, or use this file with validate, predict or export"
        )
    return checkpoint


def member_names(checkpoint: dict[str, Any], where: str = "checkpoint") -> list[str]:
    """The members of a group's checkpoint, in training order ([] for a single SAE's).

    The names come from a file someone else may have written, and ``export`` makes a folder of each:
    a name that is not `MEMBER_NAME` (``../../x``, an absolute path, ``"abc\\n"``) is a
    CheckpointError naming ``where``, as the same name in a config is refused.
    """
    group = checkpoint.get("sae_group")
    names = list(group) if isinstance(group, dict) else []
    for name in names:
        if not isinstance(name, str) or not MEMBER_NAME.fullmatch(name):
            raise CheckpointError(
                f"{where}: its group names a member {name!r}, and a member name {MEMBER_NAME_RULE} (it names the "
                "member's folders); the checkpoint was not written by `fit`: pass another one"
            )
    return names


def select_member(checkpoint: dict[str, Any], name: str | None, where: str) -> dict[str, Any]:
    """One member of a group's checkpoint (:mod:`sae_pipeline.training.group`), shaped as a single SAE's:
    its weights without the ``members.<name>.`` prefix, its ``sae_config``, ``input_scale`` and
    ``hyper_parameters``, the group's training progress and data."""
    names = member_names(checkpoint, where)
    if not names:
        raise CheckpointError(f"{where}: holds one SAE, not a group; drop --name {name}")
    if name is None or name not in names:
        said = "holds a group of SAEs" if name is None else f"has no member {name!r}"
        raise CheckpointError(f"{where}: {said} ({', '.join(names)}); pass --name with one of them")
    entry = checkpoint["sae_group"][name]
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: member {name!r} is not described (damaged); pass another checkpoint")
    prefix = f"members.{name}."
    state = checkpoint.get("state_dict")
    state = state if isinstance(state, dict) else {}
    member = {key: value for key, value in checkpoint.items() if key not in ("sae_group", "state_dict")}
    member.update({key: entry[key] for key in ("sae_config", "input_scale", "hyper_parameters") if key in entry})
    member["state_dict"] = {key[len(prefix) :]: value for key, value in state.items() if key.startswith(prefix)}
    member["member"] = name
    return member


def current_class_path(class_path: str) -> str:
    """``class_path`` with a module that moved (:data:`MOVED_MODULES`) replaced by its new one; that new
    module, one of ours named by the table, is imported so the class resolves as any loaded one does."""
    module_name, _, name = class_path.rpartition(".")
    new_module = MOVED_MODULES.get(module_name, module_name)
    if new_module in MOVED_MODULES.values():
        importlib.import_module(new_module)
    return f"{new_module}.{name}" if new_module != module_name else class_path


def _upgrade_class_paths(data: object) -> None:
    """Rewrite, in place, every ``class_path`` / ``_class_path`` value under ``data`` (:func:`current_class_path`)."""
    if isinstance(data, dict):
        for key, value in data.items():
            if key in ("class_path", "_class_path") and isinstance(value, str):
                data[key] = current_class_path(value)
            else:
                _upgrade_class_paths(value)
    elif isinstance(data, list):
        for value in data:
            _upgrade_class_paths(value)


def check_instantiator(configs: dict[str, Any], where: str) -> None:
    """LightningCLI stores the function that built the model as ``_instantiator`` beside the hyper-parameters;
    the CLI drops it before parsing, and ``load_from_checkpoint`` (which we never call) would import it.
    Only Lightning's own is accepted, so a reader that does call it runs nothing the file chose."""
    for section in (configs["hyper_parameters"], *_group_hyper_parameters(configs["sae_group"])):
        value = section.get("_instantiator", INSTANTIATOR) if isinstance(section, dict) else INSTANTIATOR
        if value != INSTANTIATOR:
            raise CheckpointError(f"{where}: names {value!r} as the model's instantiator, not Lightning's; {DAMAGED}")


def _group_hyper_parameters(group: object) -> list[object]:
    entries = group.values() if isinstance(group, dict) else ()
    return [entry.get("hyper_parameters") for entry in entries if isinstance(entry, dict)]


def _without_instantiator(data: object) -> object:
    """``data`` with every ``_instantiator`` key left out (checked by `check_instantiator`)."""
    if isinstance(data, dict):
        return {key: _without_instantiator(value) for key, value in data.items() if key != "_instantiator"}
    return data


def check_model_classes(hyper_parameters: object, where: str) -> None:
    """Refuse model hyper-parameters that name a class ``fit`` never stores there.

    The CLI parses these into its config, and the parser turns text into a class wherever the type
    allows one: a dict's ``class_path`` at any depth (also under ``Any``, as a group's members are
    typed), or a plain string for ``model.sae``. ``fit`` stores classes in two places only: the
    model's own (``_class_path``) and each SAE (``sae``, a group member's ``sae``). There a class must
    be one of ours or an SAE class `resolve_sae_class` accepts (so a
    loaded module's class that is no SAE, ``subprocess.Popen``, is refused as well as an unloaded
    module); anywhere else a ``class_path`` is refused. A module that is not loaded was refused before,
    by `check_class_paths` (`sae_pipeline.sae.config`) over the same sections (its line names the
    trust list), so what is left here to refuse is a class that is loaded but no SAE.
    """
    if hyper_parameters is None:
        return
    if not isinstance(hyper_parameters, dict):
        raise CheckpointError(f"{where}: hyper_parameters is not a mapping; {DAMAGED}")
    hparams = dict(hyper_parameters)
    hparams.pop("_instantiator", None)
    model_class = hparams.pop("_class_path", None)
    if model_class is not None and model_class not in MODEL_CLASSES:
        raise CheckpointError(f"{where}: names {model_class!r} as its model, which fit never trains; {DAMAGED}")
    members = hparams.get("members")
    saes = {"model.sae": hparams.pop("sae")} if "sae" in hparams else {}
    if isinstance(members, dict):
        hparams["members"] = {
            name: dict(entry) if isinstance(entry, dict) else entry for name, entry in members.items()
        }
        for name, entry in hparams["members"].items():
            if isinstance(entry, dict) and "sae" in entry:
                saes[f"model.members.{name}.sae"] = entry.pop("sae")
    for position, sae in saes.items():
        class_path = sae if isinstance(sae, str) else sae.get("class_path") if isinstance(sae, dict) else None
        if not isinstance(class_path, str):
            raise CheckpointError(f"{where}: {position} is {type(sae).__name__}, not an SAE's class path; {DAMAGED}")
        try:
            # The class path alone (the parser reads it, not a variant key); a bare class name is one of the
            # package's variants, as the group and jsonargparse read it (a bare name imports nothing).
            resolve_sae_class(class_path if "." in class_path else f"sae_pipeline.sae.{class_path}")
        except ExportError:
            raise CheckpointError(
                f"{where}: {position} names {class_path!r}, which is not an SAE class; {DAMAGED}"
            ) from None
        if isinstance(sae, dict):
            _refuse_nested_classes(sae.get("init_args"), f"{position}.init_args", where)
    _refuse_nested_classes(hparams, "hyper_parameters", where)


def _refuse_nested_classes(data: object, position: str, where: str) -> None:
    """No ``class_path`` under ``data``: an SAE's arguments are JSON scalars, and a model setting names no class."""
    if isinstance(data, dict):
        for key, value in data.items():
            if key in ("class_path", "_class_path"):
                raise CheckpointError(f"{where}: {position} names class {value!r} where fit stores none; {DAMAGED}")
            _refuse_nested_classes(value, f"{position}.{key}", where)
    elif isinstance(data, (list, tuple)):
        for value in data:
            _refuse_nested_classes(value, position, where)


def sae_from_checkpoint(checkpoint: dict[str, Any], where: str = "checkpoint") -> SparseAutoencoder:
    """The trained SAE of a checkpoint from :func:`read_checkpoint` (input scale *not* folded); ``where`` names the
    file in its errors (``--ckpt_path FILE``)."""
    config = check_sae_config(checkpoint.get("sae_config"), f"{where}: sae_config")
    w_dec = checkpoint["state_dict"].get("sae.W_dec")
    check_sae_size(config.get("init_args") or {}, None if w_dec is None else list(w_dec.shape), f"{where}: sae_config")
    try:
        sae = build_sae(config)
    except ExportError as exn:
        raise CheckpointError(f"{where}: {exn}") from None
    except (TypeError, ValueError) as exn:  # a constructor's own check of an argument, one missing
        raise CheckpointError(f"{where}: its sae_config does not describe an SAE ({exn}); {DAMAGED}") from None
    prefix = "sae."
    state = {key[len(prefix) :]: value for key, value in checkpoint["state_dict"].items() if key.startswith(prefix)}
    try:
        sae.load_state_dict(state, strict=True)
    except RuntimeError as exn:
        raise CheckpointError(
            f"{where}: its weights do not match its sae_config: {terminal_text(str(exn).splitlines()[0], 300)}; "
            f"{DAMAGED}"
        ) from None
    return sae


def checkpoint_input_scale(checkpoint: dict[str, Any], where: str) -> float:
    """The factor training multiplied inputs by (``SAEModule``'s ``input_scale``), checked finite and > 0."""
    scale = checkpoint.get("input_scale")
    try:
        value = float(scale)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        value = math.nan
    if isinstance(scale, bool) or not (math.isfinite(value) and value > 0):
        raise CheckpointError(
            f"{where}: input_scale is {scale!r}, must be finite and > 0; the checkpoint is damaged, "
            "pass another one written by `fit`"
        )
    return value


def checkpoint_d_in(checkpoint: dict[str, Any]) -> int | None:
    """The input width of the SAE a checkpoint holds (None when its config does not say)."""
    d_in = (checkpoint.get("sae_config") or {}).get("init_args", {}).get("d_in")
    return int(d_in) if isinstance(d_in, int) else None
