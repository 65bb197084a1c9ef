"""What a ``--ckpt_path`` run takes from its checkpoint, and what it refuses to override (a group's too).

LightningCLI merges a checkpoint's saved model hyper-parameters (``model.sae`` and ``model.lr``,
``model.warmup_steps``, ...) into the parsed config before it builds the model, so without a
check ``fit --config configs/topk_digits.yaml --ckpt_path <an MP-SAE checkpoint>`` trains the
MP-SAE (and writes it into the run's ``config.yaml``) and ``--model.sae.init_args.d_sae 500``
is ignored against a d_sae 1000 checkpoint, both with exit 0. The rules, for ``fit`` (resume)
and for ``validate``, ``test`` and ``predict`` alike:

- The model is always the checkpoint's: its SAE and its hyper-parameters (a resumed run also
  continues the checkpoint's optimiser and learning-rate schedule state, so a new ``lr`` could
  not take effect anyway).
- What the user gave explicitly (config files and flags, not the parser's defaults) must agree
  with it. An SAE whose class or ``init_args`` differ from the checkpoint's (``d_in`` aside: it
  comes from the data and is checked against it separately), or an explicit ``model.lr``,
  ``model.warmup_steps``, ... that differs from the checkpoint's, is refused with one ``error:``
  line naming both and the fix: pass the config the run was trained with (its
  ``version_N/config.yaml``), or start a new run without ``--ckpt_path``. Nothing is written.
- Only what the user wrote is compared: the SAE's class (where given) and the ``init_args`` given;
  an argument left out, or given as ``null`` (the constructors' "derive it", e.g. ``k_aux``), is
  the checkpoint's, as is every hyper-parameter left out (whatever the parser's default).
- A config that leaves the SAE's class unset (``fit --ckpt_path FILE --data.source digits``) takes
  the checkpoint's SAE, and one line says which (``--ckpt_path FILE: resuming its
  MatchingPursuitSAE(d_sae=1000, k=10) ...``). A requeued SLURM job started that way, whose
  ``--ckpt_path`` gives way to the job's own hpc checkpoint, takes that checkpoint's SAE and
  hyper-parameters the same way (Lightning merges those of ``--ckpt_path`` only).
- A group (`sae_pipeline.training.group`): the same per member (`check_group_against_checkpoint`;
  Lightning's merge replaces the config's members with the checkpoint's, so a changed ``k`` or ``lr``
  would otherwise be dropped without a word), and a group's checkpoint with a single SAE's config (or
  the reverse) is one line naming what the checkpoint holds.

"Explicit" is what :func:`explicit_config` reads: the same arguments parsed again without
defaults (jsonargparse's ``parse_args(defaults=False)``, with its private ``_skip_validation``,
which also lets the parse of a config without ``model.sae`` wait for the checkpoint's). Arguments
given to the CLI as a dict rather than a list are not compared.
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

from jsonargparse import Namespace

from sae_pipeline.artifacts.checkpoint import CheckpointError
from sae_pipeline.training.group import CLIP_KEYS, plain_config

SHOWN_ARGS = ("d_sae", "k")  # always named in an SAE's label, so the two SAEs are recognisable
LINKED_ARGS = ("d_in",)  # linked from the data; checked against it after instantiation
BASE_CLASS = "SparseAutoencoder"  # what jsonargparse reports for init_args given without a class
FIX = "pass the config the run was trained with (its version_N/config.yaml) or start a new run without --ckpt_path"


def explicit_config(parser: Any, args: Any) -> Namespace | None:
    """The arguments parsed without the parser's defaults: only what config files and flags set.

    None where that cannot be told (arguments given as a dict, or a parse that fails: the real
    parse then reports the problem, so this one stays silent).
    """
    if args is not None and not isinstance(args, (list, tuple)):
        return None
    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            return parser.parse_args(args, defaults=False, _skip_validation=True)
    except (SystemExit, Exception):  # noqa: BLE001 -- any failure is reported by the real parse
        return None


def sets_sae_class(explicit_model: Any) -> bool:
    """Whether the user's config names the SAE's class (not only some of its ``init_args``)."""
    sae = _get(explicit_model, "sae")
    class_path = _get(sae, "class_path")
    return bool(class_path) and _class_name(class_path) != BASE_CLASS


def sae_namespace(sae_config: dict[str, Any]) -> Namespace:
    """The checkpoint's ``{"class_path", "init_args"}`` as the parser holds ``model.sae`` (``d_in`` included:
    the data's is linked over it, and checked against it, when the classes are instantiated)."""
    init_args = dict(sae_config.get("init_args") or {})
    return Namespace(class_path=str(sae_config["class_path"]), init_args=Namespace(**init_args))


def sae_label(class_path: str, init_args: dict[str, Any], keys: list[str] | tuple[str, ...] = ()) -> str:
    """``MatchingPursuitSAE(d_sae=1000, k=10)``: the class and the arguments that tell two SAEs apart."""
    shown = [key for key in (*SHOWN_ARGS, *keys) if key in init_args]
    shown = list(dict.fromkeys(shown))
    return f"{_class_name(class_path)}({', '.join(f'{key}={init_args[key]!r}' for key in shown)})"


def check_against_checkpoint(ckpt_path: str, checkpoint: dict[str, Any], model: Any, explicit_model: Any) -> None:
    """Raise a one-line :class:`CheckpointError` where the user's explicit model config differs from the
    checkpoint's (see the module docstring). ``model``: the parsed ``model`` section (defaults filled);
    ``explicit_model``: the same section parsed without defaults (None: nothing explicit)."""
    ckpt_sae = checkpoint.get("sae_config") or {}
    user_sae = _get(explicit_model, "sae")
    if user_sae is not None:
        user_class = str(_get(_get(model, "sae"), "class_path")) if sets_sae_class(explicit_model) else None
        _check_sae(f"--ckpt_path {ckpt_path}", ckpt_sae, user_class, _as_dict(_get(user_sae, "init_args")))
    explicit = {key: value for key, value in _as_dict(explicit_model).items() if key != "sae"}
    _check_settings(ckpt_path, checkpoint.get("hyper_parameters") or {}, explicit, "model.")


def check_group_against_checkpoint(
    ckpt_path: str, checkpoint: dict[str, Any], explicit_model: Any, group: bool
) -> None:
    """A group's checkpoint goes with a group config, a single SAE's with a single SAE's config (one line naming
    what the checkpoint holds otherwise: LightningCLI's merge of its hyper-parameters would fail with the
    parser's usage). The group's members are the checkpoint's, and what the user wrote for them must agree, as
    for one SAE: a config naming members names the same ones; a member's SAE class, its ``init_args`` given
    (``d_in`` and ``null`` aside) and its settings given (``lr``, ..., ``seed``, ``gradient_clip_val``) equal
    the checkpoint's, or one line names both values. Member flags alone (``--model.members.NAME.lr``) may name
    some members only. ``explicit_model``: the ``model`` section parsed without defaults."""
    saved = checkpoint.get("sae_group")
    members = plain_config(_get(explicit_model, "members"))
    members = members if isinstance(members, dict) else None
    if saved is not None and (not group or (members is None and _get(explicit_model, "sae") is not None)):
        raise CheckpointError(
            f"--ckpt_path {ckpt_path} holds a group of {len(saved)} SAEs ({', '.join(saved)}) but the config names "
            f"one SAE; pass the group's config (its version_N/config.yaml) or start a new run without --ckpt_path "
            f"(one member alone: export --ckpt_path {ckpt_path} --name NAME)"
        )
    if saved is None:
        sae = checkpoint.get("sae_config") or {}
        held = sae_label(str(sae.get("class_path", "?")), dict(sae.get("init_args") or {}))
        asked = f"a group of {len(members)} SAEs ({', '.join(members)})" if members else "a group (model.members)"
        raise CheckpointError(
            f"--ckpt_path {ckpt_path} holds one SAE, {held}, but the config names {asked}; pass that SAE's config "
            "(its version_N/config.yaml) or start a new run without --ckpt_path"
        )
    if not members:
        return
    whole = any(isinstance(entry, dict) and "sae" in entry for entry in members.values())
    if set(members) - set(saved) or (whole and set(members) != set(saved)):
        raise CheckpointError(
            f"--ckpt_path {ckpt_path}: its group holds {', '.join(saved)}, the config names {', '.join(members)}; "
            "pass the config it was trained with (a group cannot gain or lose members when resumed)"
        )
    group_hparams = checkpoint.get("hyper_parameters") or {}
    saved_entries = group_hparams.get("members") if isinstance(group_hparams.get("members"), dict) else {}
    for name, entry in members.items():
        _check_member(ckpt_path, name, entry, saved[name] or {}, saved_entries.get(name) or {}, group_hparams)
    explicit = {key: value for key, value in _as_dict(explicit_model).items() if key not in ("sae", "members")}
    _check_settings(ckpt_path, group_hparams, explicit, "model.")


def _check_member(
    ckpt_path: str, name: str, entry: Any, saved: dict[str, Any], saved_entry: Any, group_hparams: dict[str, Any]
) -> None:
    """One member against the checkpoint's: its SAE (``sae_group.<name>.sae_config``) and its settings (its
    module's hyper-parameters; ``seed`` and clipping from the group's saved entry, or the group's defaults)."""
    if not isinstance(entry, dict):
        return  # the member's own check names what is wrong with it
    where = f"--ckpt_path {ckpt_path}: its member {name}"
    sae = entry.get("sae")
    if isinstance(sae, dict) and saved.get("sae_config"):
        class_path = sae.get("class_path")
        _check_sae(where, saved["sae_config"], str(class_path) if class_path else None, _as_dict(sae.get("init_args")))
    hparams = dict(saved.get("hyper_parameters") or {})
    saved_entry = saved_entry if isinstance(saved_entry, dict) else {}
    known = {key: hparams[key] for key in hparams if key not in ("sae", "seed", *CLIP_KEYS)}
    known["seed"] = saved_entry.get("seed")
    for key in CLIP_KEYS:
        if key in saved_entry:
            known[key] = saved_entry[key]
        elif key in group_hparams:
            known[key] = group_hparams[key]
    given = {key: value for key, value in entry.items() if key != "sae"}
    _check_settings(ckpt_path, known, given, f"model.members.{name}.")


def _check_sae(where: str, ckpt_sae: dict[str, Any], user_class: str | None, user_args: dict[str, Any]) -> None:
    """The SAE the user wrote (its class where given, the ``init_args`` given) against the checkpoint's."""
    ckpt_class = str(ckpt_sae.get("class_path", "?"))
    ckpt_args = dict(ckpt_sae.get("init_args") or {})
    user_class = user_class or ckpt_class
    differing = [
        key
        for key in user_args
        if key in ckpt_args
        and key not in LINKED_ARGS
        and user_args[key] is not None
        and not _same(user_args[key], ckpt_args[key])
    ]
    if _class_name(user_class) != _class_name(ckpt_class) or differing:
        raise CheckpointError(
            f"{where} holds {sae_label(ckpt_class, ckpt_args, differing)} but "
            f"the config asks for {sae_label(user_class, user_args, differing)}; {FIX}"
        )


def _check_settings(ckpt_path: str, saved: dict[str, Any], given: dict[str, Any], prefix: str) -> None:
    """Settings the user gave (``lr``, ...) against those the checkpoint was trained with."""
    differing = [key for key in given if key in saved and not _same(given[key], saved[key])]
    if differing:
        theirs = ", ".join(f"{prefix}{key}={saved[key]!r}" for key in differing)
        ours = ", ".join(f"{prefix}{key}={plain_config(given[key])!r}" for key in differing)
        raise CheckpointError(
            f"--ckpt_path {ckpt_path} was trained with {theirs} but the config asks for {ours} "
            f"(a run from a checkpoint keeps its model settings); {FIX}"
        )


def _get(namespace: Any, key: str) -> Any:
    if namespace is None:
        return None
    if isinstance(namespace, dict):
        return namespace.get(key)
    return namespace.get(key) if hasattr(namespace, "get") else getattr(namespace, key, None)


def _as_dict(namespace: Any) -> dict[str, Any]:
    if namespace is None:
        return {}
    return namespace.as_dict() if isinstance(namespace, Namespace) else dict(namespace)


def _same(given: Any, saved: Any) -> bool:
    """Equal as the config means them: ``1e-3`` (a string to YAML 1.1) is 0.001, a tuple equals its list."""
    given, saved = plain_config(given), plain_config(saved)
    if given == saved:
        return True
    if isinstance(given, bool) or isinstance(saved, bool):
        return False
    try:
        return float(given) == float(saved)
    except (TypeError, ValueError):
        return False


def _class_name(class_path: Any) -> str:
    return str(class_path).rpartition(".")[2]
