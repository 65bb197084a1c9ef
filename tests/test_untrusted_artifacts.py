"""An SAE someone else made is data: reading it never imports a module it names.

The attack, as reproduced: a downloaded SAE folder ships ``evilmod.py`` and its ``config.json``
(or checkpoint) names ``evilmod.EvilSAE``; run from that folder, ``python -m`` puts the folder on
``sys.path``, so importing the class path runs the file. Every reader of every artifact is started
for real from inside such a folder; the planted module writes a marker file when imported, which
must never appear. The user's own subclass still loads when they allow its module
(``SAE_PIPELINE_TRUSTED_MODULES``), which also shows the plant works (so the test can fail).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import fork_server
import pytest
import torch
from test_export import trained_checkpoint

from sae_pipeline.artifacts.export import export_checkpoint
from sae_pipeline.sae.config import TRUSTED_MODULES_ENV, ExportError, build_sae

REPO_DPATH = Path(__file__).resolve().parents[1]
EVIL_CLASS_PATH = "evilmod.EvilSAE"
EVIL_MODULE = """\
from pathlib import Path
Path({marker!r}).write_text("imported")
from sae_pipeline.sae import TopKSAE


class EvilSAE(TopKSAE):
    pass
"""


@pytest.fixture(scope="module")
def evil_dpath(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder as a stranger would hand it over: a native export, a checkpoint, a SAELens export, all
    naming ``evilmod.EvilSAE``, and ``evilmod.py`` beside them."""
    dpath = tmp_path_factory.mktemp("downloaded")
    _, ckpt_fpath = trained_checkpoint("topk", tmp_path_factory.mktemp("train"))
    export_checkpoint(ckpt_fpath, dpath)
    config = json.loads((dpath / "config.json").read_text())
    config.update(class_path=EVIL_CLASS_PATH, variant=None)
    (dpath / "config.json").write_text(json.dumps(config))
    checkpoint = torch.load(ckpt_fpath, map_location="cpu", weights_only=True)
    checkpoint["sae_config"]["class_path"] = EVIL_CLASS_PATH
    checkpoint["hyper_parameters"]["sae"]["class_path"] = EVIL_CLASS_PATH
    torch.save(checkpoint, dpath / "evil.ckpt")
    marker = dpath / "IMPORTED"
    (dpath / "evilmod.py").write_text(EVIL_MODULE.format(marker=str(marker)))
    return dpath


def run_in(dpath: Path, args: list[str], **env: str) -> subprocess.CompletedProcess:
    environ = {key: value for key, value in os.environ.items() if key != TRUSTED_MODULES_ENV}
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_DPATH), environ.get("PYTHONPATH")]))
    return fork_server.run([sys.executable, *args], cwd=dpath, env=environ | env, timeout=300)


CONFIG = str(REPO_DPATH / "configs" / "topk_digits.yaml")
READERS = {
    "evaluate sae": ["-m", "sae_pipeline.evaluate", "sae", "--sae", ".", "--data", "digits", "--out", "out"],
    "features --sae": ["-m", "sae_pipeline", "features", "--sae", ".", "--data.source", "digits", "--out", "site"],
    "features --ckpt_path": [
        "-m",
        "sae_pipeline",
        "features",
        "--ckpt_path",
        "evil.ckpt",
        "--data.source",
        "digits",
        "--out",
        "site",
    ],
    "export": ["-m", "sae_pipeline", "export", "--ckpt_path", "evil.ckpt", "--out", "exported"],
    "export saelens": [
        "-m",
        "sae_pipeline",
        "export",
        "--ckpt_path",
        "evil.ckpt",
        "--out",
        "exported",
        "--format",
        "saelens",
    ],
    "fit --ckpt_path": [
        "-m",
        "sae_pipeline",
        "fit",
        "--config",
        CONFIG,
        "--ckpt_path",
        "evil.ckpt",
        "--trainer.default_root_dir",
        "runs",
    ],
    "validate": [
        "-m",
        "sae_pipeline",
        "validate",
        "--config",
        CONFIG,
        "--ckpt_path",
        "evil.ckpt",
        "--trainer.default_root_dir",
        "runs",
    ],
    "predict": [
        "-m",
        "sae_pipeline",
        "predict",
        "--config",
        CONFIG,
        "--ckpt_path",
        "evil.ckpt",
        "--trainer.default_root_dir",
        "runs",
        "--codes.fpath",
        "codes.h5",
    ],
    "load_sae": ["-c", "from sae_pipeline.artifacts import load_sae; load_sae('.')"],
}


@pytest.mark.slow
@pytest.mark.parametrize("reader", sorted(READERS))
def test_no_reader_imports_what_an_artifact_names(evil_dpath: Path, reader: str) -> None:
    result = run_in(evil_dpath, READERS[reader])
    assert not (evil_dpath / "IMPORTED").exists(), f"{reader} imported the artifact's module"
    assert result.returncode != 0
    if reader != "load_sae":  # the Python API raises; the commands print one line
        assert result.returncode == 2, result.stderr[-2000:]
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, result.stderr[-2000:]
        assert EVIL_CLASS_PATH in errors[0] and f"{TRUSTED_MODULES_ENV}=evilmod" in errors[0]
    else:
        assert "nothing was imported" in result.stderr and EVIL_CLASS_PATH in result.stderr
    for name in ("out", "site", "exported", "runs", "codes.h5"):
        assert not (evil_dpath / name).exists(), f"{reader} left {name}"


def test_a_module_the_user_trusts_is_imported(evil_dpath: Path, tmp_path: Path) -> None:
    """The opt-in for one's own subclass, and the proof that the planted module would run."""
    probe = tmp_path / "probe"
    probe.mkdir()
    for name in ("config.json", "sae.safetensors"):
        (probe / name).write_bytes((evil_dpath / name).read_bytes())
    marker = tmp_path / "IMPORTED"
    (probe / "evilmod.py").write_text(EVIL_MODULE.format(marker=str(marker)))
    code = "from sae_pipeline.artifacts import load_sae; print(type(load_sae('.')).__name__)"
    refused = run_in(probe, ["-c", code])
    assert refused.returncode != 0 and not marker.exists()
    allowed = run_in(probe, ["-c", code], **{TRUSTED_MODULES_ENV: "otherpkg, evilmod"})
    assert allowed.returncode == 0, allowed.stderr[-2000:]
    assert allowed.stdout.strip() == "EvilSAE" and marker.exists()


@pytest.mark.parametrize(
    "config, expected",
    [
        (
            {"class_path": "sae_pipeline.sae.TopKSAE", "variant": "topk", "init_args": {"d_in": 4, "d_sae": 8, "k": 2}},
            "TopKSAE",
        ),
        ({"class_path": "sae_pipeline.sae.topk.TopKSAE", "init_args": {"d_in": 4, "d_sae": 8, "k": 2}}, "TopKSAE"),
        (
            {
                "class_path": "sae_pipeline.sae.MatchingPursuitSAE",
                "variant": "mp",
                "init_args": {"d_in": 4, "d_sae": 8, "k": 2},
            },
            "MatchingPursuitSAE",
        ),
    ],
)
def test_registered_variants_resolve_by_key_first(config: dict, expected: str) -> None:
    """An artifact's registry key (or a registered class path) resolves without importing; the two must agree."""
    assert type(build_sae(config)).__name__ == expected


@pytest.mark.parametrize(
    "class_path", ["sae_pipeline.sae.ReLUSAE", "sae_pipeline.sae.mp.MatchingPursuitSAE", "evilmod.EvilSAE"]
)
def test_a_variant_and_class_path_that_disagree_are_refused(
    class_path: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 31, item 7: the key no longer wins silently over a class path naming another class; the line names
    both, and nothing the class path names is imported."""
    from sae_pipeline.artifacts import load_sae
    from sae_pipeline.evaluate.__main__ import main as evaluate_main

    _, ckpt_fpath = trained_checkpoint("topk", tmp_path / "train")
    export_checkpoint(ckpt_fpath, tmp_path / "sae")
    config = json.loads((tmp_path / "sae" / "config.json").read_text())
    assert config["variant"] == "topk"
    (tmp_path / "sae" / "config.json").write_text(json.dumps({**config, "class_path": class_path}))
    with pytest.raises(ExportError) as raised:
        load_sae(tmp_path / "sae")
    expected = f"variant 'topk' (sae_pipeline.sae.TopKSAE) and class_path {class_path!r} name different classes"
    assert str(tmp_path / "sae" / "config.json") in str(raised.value) and expected in str(raised.value)
    args = ["sae", "--sae", str(tmp_path / "sae"), "--data", "digits", "--out", str(tmp_path / "eval")]
    assert evaluate_main(args) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], errors
    assert "evilmod" not in sys.modules and not (tmp_path / "eval").exists()


@pytest.mark.parametrize("class_path", ["os.system", "json.JSONDecoder", "no_such_module_xyz.SAE", "SAE"])
def test_a_class_path_that_is_no_sae_is_refused(class_path: str) -> None:
    with pytest.raises(ExportError, match="class_path"):
        build_sae({"class_path": class_path, "init_args": {}})
    assert "no_such_module_xyz" not in sys.modules
