"""The backbone configs are composed of pieces (configs/vision/, configs/data/): each setting is
written once, and every composed file parses, through the real CLI parser, exactly as the plain
one-file config made of its pieces (what the copies it replaced held)."""

from __future__ import annotations

import contextlib
import hashlib
import io
import sys
from pathlib import Path

import fork_server
import pytest
import yaml

from feature_extraction.backbones import BACKBONES as BACKBONE_SPECS
from sae_pipeline.cli import SAECLI
from sae_pipeline.config_files import config_sha256, load_config, setting_sources, source_files
from sae_pipeline.sae import SAE_REGISTRY

CONFIGS_DPATH = Path(__file__).resolve().parents[1] / "configs"
VARIANTS = list(SAE_REGISTRY)
BACKBONES = [name for name, spec in BACKBONE_SPECS.items() if spec.has_configs]
TINY_D = 8


class Parsed(Exception):
    """Raised before instantiation: the parsed CLI, without building a model or a trainer."""


class ParseOnly(SAECLI):
    def before_instantiate_classes(self) -> None:
        super().before_instantiate_classes()  # names the run
        raise Parsed(self)


def parse(args: list[str]) -> ParseOnly:
    with pytest.raises(Parsed) as caught:
        ParseOnly(args=args)
    return caught.value.args[0]


@pytest.fixture(autouse=True)
def plain_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    """LightningCLI(args=...) warns when sys.argv also holds arguments (pytest's own)."""
    monkeypatch.setattr(sys, "argv", ["sae_pipeline"])


@pytest.fixture(scope="module")
def printed() -> object:
    """``fit ARGS --print_config`` through one real parser: the parsed config, dumped as YAML."""
    parser = parse(["fit", "--config", str(CONFIGS_DPATH / "mpsae_digits.yaml")]).parser

    def print_config(args: list[str]) -> str:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exited:
            parser.parse_args(["fit", *args, "--print_config"])
        assert not exited.value.code
        return out.getvalue()

    return print_config


def composed_fpaths() -> list[Path]:
    return [CONFIGS_DPATH / f"{v}_{b}.yaml" for v in VARIANTS for b in BACKBONES]


def training_fpaths() -> list[Path]:
    return sorted(p for p in CONFIGS_DPATH.rglob("*.yaml") if not p.name.startswith("extract_"))


@pytest.mark.parametrize("variant", VARIANTS)
def test_composed_config_parses_as_its_pieces_merged(variant: str, printed, tmp_path: Path) -> None:
    """The parser's reading of the shortcut, of ``vision/<v>.yaml --data data/<b>.yaml`` and of
    one flat file holding the merged pieces (as the copies did) are the same dumped config."""
    for backbone in BACKBONES:
        fpath = CONFIGS_DPATH / f"{variant}_{backbone}.yaml"
        flat = load_config(fpath)
        assert flat["data"]["source"] == f"shards/{backbone}" and "config" not in flat
        flat_fpath = tmp_path / f"{variant}_{backbone}.yaml"
        flat_fpath.write_text(yaml.safe_dump(flat))
        expected = printed(["--config", str(flat_fpath)])
        assert f"source: shards/{backbone}\n" in expected and "max_epochs: 50\n" in expected
        assert printed(["--config", str(fpath)]) == expected, fpath.name
        assert (
            printed(
                [
                    "--config",
                    str(CONFIGS_DPATH / "vision" / f"{variant}.yaml"),
                    "--data",
                    str(CONFIGS_DPATH / "data" / f"{backbone}.yaml"),
                ]
            )
            == expected
        )


@pytest.mark.parametrize("fpath", training_fpaths(), ids=lambda p: p.relative_to(CONFIGS_DPATH).as_posix())
def test_each_setting_has_one_source(fpath: Path) -> None:
    """No setting of a run is written in two of the files it is made of."""
    twice = {name: files for name, files in setting_sources(fpath).items() if len(files) > 1}
    assert not twice, f"{fpath.name}: set in more than one file: {twice}"


def test_composed_files_hold_no_setting_of_their_own() -> None:
    for fpath in composed_fpaths():
        sources = setting_sources(fpath)
        assert fpath.resolve() not in {f for files in sources.values() for f in files}, fpath.name
        variant, backbone = fpath.stem.split("_", 1)  # variant keys have no "_"; backbone names may (pe_core)
        assert sources["data.source"] == [(CONFIGS_DPATH / "data" / f"{backbone}.yaml").resolve()]
        assert sources["model.sae.class_path"] == [(CONFIGS_DPATH / "vision" / f"{variant}.yaml").resolve()]
        assert sources["trainer.max_epochs"] == [(CONFIGS_DPATH / "vision" / "recipe.yaml").resolve()]


def test_shortcut_and_pieces_name_the_run_alike(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    shortcut = parse(["fit", "--config", str(CONFIGS_DPATH / "topk_clip.yaml")])
    pieces = parse(
        [
            "fit",
            "--config",
            str(CONFIGS_DPATH / "vision" / "topk.yaml"),
            "--data",
            str(CONFIGS_DPATH / "data" / "clip.yaml"),
        ]
    )
    assert shortcut.run_dpath == pieces.run_dpath == Path("runs/topk_clip")
    assert pieces.config.fit.data.source == "shards/clip"
    plain = parse(["fit", "--config", str(CONFIGS_DPATH / "topk_clip.yaml"), "--data.source", "shards/other"])
    assert plain.run_dpath == Path("runs/topk_clip")  # --data.X flags do not rename the run


@pytest.mark.slow
def test_a_new_backbone_trains_from_its_data_piece(
    token_shards, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backbone with no shortcut files: its data piece next to a variant piece, a real fit step."""
    shards = tmp_path / "shards" / "newbone"
    token_shards(shards, [4, 4, 4], TINY_D)
    piece = tmp_path / "newbone.yaml"
    piece.write_text(f"source: {shards}\nnum_workers: 0\n")
    monkeypatch.chdir(tmp_path)
    cli = SAECLI(
        args=[
            "fit",
            "--config",
            str(CONFIGS_DPATH / "vision" / "mpsae.yaml"),
            "--data",
            str(piece),
            "--data.batch_size",
            "8",
            "--data.val_fraction",
            "0.34",
            "--model.sae.init_args.d_sae",
            "64",
            "--trainer.accelerator",
            "cpu",
            "--trainer.devices",
            "1",
            "--trainer.precision",
            "32-true",
            "--trainer.fast_dev_run",
            "true",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.enable_model_summary",
            "false",
        ]
    )
    assert cli.run_dpath == Path("runs/mpsae_newbone")
    assert cli.trainer.global_step == 1 and (cli.model.sae.d_in, cli.model.sae.d_sae) == (TINY_D, 64)
    assert cli.model.hparams.lr == 5e-4 and cli.model.hparams.warmup_steps == 1000  # the variant piece's
    data = cli.config.fit.data
    assert (data.num_workers, cli.config.fit.checkpoint.every_n_train_steps) == (0, 5000)  # the piece's, the recipe's


def test_config_key_must_come_last(tmp_path: Path) -> None:
    (tmp_path / "base.yaml").write_text("trainer:\n  max_epochs: 3\n")
    (tmp_path / "bad.yaml").write_text("config: base.yaml\ntrainer:\n  devices: 1\n")
    with pytest.raises(ValueError, match="'config:' must be its last key"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "good.yaml").write_text("trainer:\n  devices: 1\n  max_epochs: 5\nconfig: base.yaml\n")
    assert load_config(tmp_path / "good.yaml") == {"trainer": {"max_epochs": 5, "devices": 1}}
    assert setting_sources(tmp_path / "good.yaml")["trainer.max_epochs"] == [
        tmp_path / "base.yaml",
        tmp_path / "good.yaml",
    ]
    (tmp_path / "loop.yaml").write_text("config: loop.yaml\n")
    with pytest.raises(ValueError, match="includes itself"):
        load_config(tmp_path / "loop.yaml")


def test_fingerprint_covers_every_piece(tmp_path: Path) -> None:
    digits = CONFIGS_DPATH / "mpsae_digits.yaml"
    assert config_sha256(digits) == hashlib.sha256(digits.read_bytes()).hexdigest()  # one file: its own sha
    composed = CONFIGS_DPATH / "mpsae_dinov2.yaml"
    assert {f.relative_to(CONFIGS_DPATH).as_posix() for f in source_files(composed)} == {
        "mpsae_dinov2.yaml",
        "vision/mpsae.yaml",
        "vision/recipe.yaml",
        "data/dinov2.yaml",
    }
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.yaml").write_text("source: a\n")
    (tmp_path / "run.yaml").write_text("data: data/x.yaml\n")
    before = config_sha256(tmp_path / "run.yaml")
    (tmp_path / "data" / "x.yaml").write_text("source: b\n")
    assert config_sha256(tmp_path / "run.yaml") != before


def test_a_broken_piece_is_one_line_naming_it(tmp_path: Path) -> None:
    """``python -m sae_pipeline fit --config`` with a piece that is not YAML, or not there: one line, exit 2."""
    (tmp_path / "vision").mkdir()
    (tmp_path / "vision" / "v.yaml").write_text("model:\n  lr: [1\n")
    (tmp_path / "run.yaml").write_text("config: vision/v.yaml\n")
    (tmp_path / "gone.yaml").write_text("data: data/nowhere.yaml\n")
    repo = Path(__file__).resolve().parents[1]
    for name, expected in (
        ("run.yaml", "v.yaml: YAML syntax error at line 3"),
        ("gone.yaml", "nowhere.yaml: not found"),
    ):
        done = fork_server.run(
            [sys.executable, "-m", "sae_pipeline", "fit", "--config", str(tmp_path / name)],
            cwd=tmp_path,
            env={**__import__("os").environ, "PYTHONPATH": str(repo)},
        )
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ValueError: config file ") and expected in lines[0], (
            done.stderr
        )
