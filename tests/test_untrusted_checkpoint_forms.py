"""Every form in which a checkpoint's hyper-parameters could name a class, for every command that reads them.

LightningCLI parses a checkpoint's ``hyper_parameters`` into its config, and jsonargparse turns text
into a class wherever a type allows one: a ``class_path`` dict at any depth (also under ``Any``, as a
group's members are typed), a plain string for ``model.sae``, the model's own ``_class_path``. The
bad-input run found the string form importing a module planted beside the checkpoint. Here each form
names ``evilmod``, a module planted in a folder put first on ``sys.path`` (as ``python -m`` puts the
current folder), and each of ``fit``, ``validate``, ``test`` and ``predict --ckpt_path`` must refuse it
in one line without importing it. A loaded module's class that is no SAE (``subprocess.Popen``) is
refused the same way, as a damaged or untrusted checkpoint. The subprocess version of the attack, from
a real downloaded folder, is ``tests/test_untrusted_artifacts.py``.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from in_process import QUIET, REPO_DPATH, error_lines, run
from test_export import trained_checkpoint

from sae_pipeline.sae.config import TRUSTED_MODULES_ENV

EVIL = "evilmod.EvilSAE"
EVIL_MODULE = """\
from pathlib import Path
Path({marker!r}).write_text("imported")
from sae_pipeline.sae import TopKSAE


class EvilSAE(TopKSAE):
    pass
"""


def _sae_string(hparams: dict[str, Any]) -> None:
    hparams["sae"] = EVIL


def _sae_dict(hparams: dict[str, Any]) -> None:
    hparams["sae"]["class_path"] = EVIL


def _sae_dict_with_variant(hparams: dict[str, Any]) -> None:
    """A registry key beside the class path: the parser reads the class path, not the key."""
    hparams["sae"].update(class_path=EVIL, variant="topk")


def _nested_init_args(hparams: dict[str, Any]) -> None:
    hparams["sae"]["init_args"]["extra"] = {"class_path": EVIL, "init_args": {"d_in": 12}}


def _list_of_dicts(hparams: dict[str, Any]) -> None:
    hparams["inference_ks"] = [{"class_path": EVIL}]


def _list_of_strings(hparams: dict[str, Any]) -> None:
    hparams["inference_ks"] = [EVIL]


def _model_class_path(hparams: dict[str, Any]) -> None:
    hparams["_class_path"] = "evilmod.EvilModule"


def _instantiator(hparams: dict[str, Any]) -> None:
    """What LightningCLI stores beside the hyper-parameters; ``load_from_checkpoint`` would import it."""
    hparams["_instantiator"] = "evilmod.make"


def _member_string(hparams: dict[str, Any]) -> None:
    hparams["members"] = {"a": {"sae": EVIL}}


def _member_dict(hparams: dict[str, Any]) -> None:
    hparams["members"] = {"a": {"sae": {"class_path": EVIL, "init_args": {"d_sae": 48, "k": 4}}}}


def _loaded_class_no_sae(hparams: dict[str, Any]) -> None:
    hparams["sae"] = "subprocess.Popen"


def _bare_name_no_sae(hparams: dict[str, Any]) -> None:
    """A bare class name (a group member's short form) that names no variant of the package."""
    hparams["members"] = {"a": {"sae": {"class_path": "Popen", "init_args": {}}}}


def _loaded_class_in_members(hparams: dict[str, Any]) -> None:
    hparams["members"] = {"a": {"sae": hparams["sae"], "lr": {"class_path": "subprocess.Popen", "init_args": {}}}}


FORMS: dict[str, Callable[[dict[str, Any]], None]] = {
    "sae string": _sae_string,
    "sae dict": _sae_dict,
    "sae dict with variant": _sae_dict_with_variant,
    "nested init_args": _nested_init_args,
    "list of dicts": _list_of_dicts,
    "list of strings": _list_of_strings,
    "model _class_path": _model_class_path,
    "_instantiator": _instantiator,
    "member string": _member_string,
    "member dict": _member_dict,
}
NOT_AN_SAE = {
    "loaded class, not an SAE": _loaded_class_no_sae,
    "loaded class in a member": _loaded_class_in_members,
    "bare name, not an SAE": _bare_name_no_sae,
}
CONFIG = str(REPO_DPATH / "configs" / "topk_digits.yaml")
COMMANDS = ("fit", "validate", "test", "predict")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    _, ckpt_fpath = trained_checkpoint("topk", tmp_path_factory.mktemp("train"))
    return torch.load(ckpt_fpath, map_location="cpu", weights_only=True)


@pytest.fixture
def planted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder holding ``evilmod.py``, first on ``sys.path``; yields the marker its import would write."""
    (tmp_path / "evilmod.py").write_text(EVIL_MODULE.format(marker=str(tmp_path / "IMPORTED")))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(TRUSTED_MODULES_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    yield tmp_path / "IMPORTED"
    sys.modules.pop("evilmod", None)


def _command(command: str, ckpt_fpath: Path) -> list[str]:
    args = [command, "--config", CONFIG, "--ckpt_path", str(ckpt_fpath), "--trainer.default_root_dir", "runs"]
    return args + (["--codes.fpath", "codes.h5"] if command == "predict" else []) + QUIET


def _refused(trained: dict[str, Any], edit: Callable[[dict[str, Any]], None], command: str, capsys) -> str:
    checkpoint = copy.deepcopy(trained)
    edit(checkpoint["hyper_parameters"])
    ckpt_fpath = Path("planted.ckpt")
    torch.save(checkpoint, ckpt_fpath)
    status, _, err = run(_command(command, ckpt_fpath), capsys)
    assert status == 2, err[-2000:]
    errors = error_lines(err)
    assert len(errors) == 1 and str(ckpt_fpath) in errors[0], err[-2000:]
    assert "Parsing of ckpt_path" not in err and "usage:" not in err
    for name in ("runs", "codes.h5"):
        assert not Path(name).exists(), f"{command} left {name}"
    return errors[0]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("form", sorted(FORMS))
def test_no_form_of_class_imports_a_planted_module(trained, planted: Path, form: str, command: str, capsys) -> None:
    line = _refused(trained, FORMS[form], command, capsys)
    assert not planted.exists() and "evilmod" not in sys.modules, f"{command} imported the checkpoint's {form}"
    assert "evilmod" in line


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("form", sorted(NOT_AN_SAE))
def test_a_loaded_class_that_is_no_sae_reads_as_damaged(
    trained, planted: Path, form: str, command: str, capsys
) -> None:
    line = _refused(trained, NOT_AN_SAE[form], command, capsys)
    assert "Popen" in line
    assert "damaged" in line or "not an SAE class" in line


def test_the_plant_would_run(planted: Path) -> None:
    """The folder's module is importable as set up, so the tests above can fail."""
    import importlib

    importlib.import_module("evilmod")
    assert planted.exists()
