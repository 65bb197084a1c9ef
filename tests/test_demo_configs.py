"""The demo configs connect (issue 10, item 9): what `extract_demo.yaml` writes is what `demo_shards.yaml` reads.

Run as README.md and docs/getting-started.md say, from one working directory and with no extra flags:
`python -m feature_extraction --config configs/extract_demo.yaml`, then
`python -m sae_pipeline fit --config configs/demo_shards.yaml`. And when a shard directory has no
manifest, the advice given is one that works there (not a `finalize` that fails).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from feature_extraction import shards as S
from feature_extraction.__main__ import build_parser
from feature_extraction.__main__ import main as extraction_main
from sae_pipeline.data import ActivationDataModule
from sae_pipeline.data.sources import open_source

CONFIGS_DPATH = Path(__file__).resolve().parents[1] / "configs"


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A working directory where the demo extraction ran exactly as configured (CPU, no workers)."""
    cwd = tmp_path_factory.mktemp("demo")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(cwd)
        assert extraction_main(["--config", str(CONFIGS_DPATH / "extract_demo.yaml"), "--progress", "false"]) == 0
    return cwd


def test_extract_demo_out_is_demo_shards_source() -> None:
    extract = build_parser().parse_args(["--config", str(CONFIGS_DPATH / "extract_demo.yaml")])
    data = yaml.safe_load((CONFIGS_DPATH / "demo_shards.yaml").read_text())["data"]
    assert Path(extract.out) == Path(data["source"]) == Path("demo_out/shards")
    assert extract.shard_size == 2


def test_demo_shards_config_trains_on_the_demo_extraction(demo_dir: Path, monkeypatch) -> None:
    monkeypatch.chdir(demo_dir)
    data = yaml.safe_load((CONFIGS_DPATH / "demo_shards.yaml").read_text())["data"]
    manifest = S.load_manifest(data["source"], verify=True)
    assert (manifest["n_images"], len(manifest["shards"]), manifest["n_tokens"]) == (14, 7, 238)
    datamodule = ActivationDataModule(**data)
    datamodule.setup("fit")
    assert len(datamodule.train_dataloader()) == 6  # the config's comment: 204 training tokens / 32


def test_commands_in_the_config_comments_match(demo_dir: Path) -> None:
    for name in ("extract_demo.yaml", "demo_shards.yaml"):
        commands = re.findall(r"^#\s+(python -m \S+ .*?)(?:\s+#.*)?$", (CONFIGS_DPATH / name).read_text(), re.M)
        assert commands, name
        for command in commands:  # no flag overriding --out / --data.source: the files agree by themselves
            assert not {"--out", "--data.source", "--shard_size"} & set(shlex.split(command)), command


def test_a_parent_of_the_extraction_is_named_without_advising_finalize(
    demo_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """The old layout: extraction in demo_out/shards/vit_tiny, training reading demo_out/shards."""
    monkeypatch.chdir(demo_dir)
    with pytest.raises(ValueError) as info:
        open_source("demo_out")
    message = str(info.value)
    assert "pass one of them: demo_out/shards" in message and "finalize" not in message


def test_an_unfinished_extraction_advises_the_finalize_that_works(demo_dir: Path, tmp_path: Path, monkeypatch) -> None:
    import shutil

    out = tmp_path / "shards"
    shutil.copytree(demo_dir / "demo_out" / "shards", out)
    (out / S.MANIFEST_FNAME).unlink()
    with pytest.raises(ValueError, match=r"finalize --out \S+") as info:
        open_source(str(out))
    command = shlex.split(re.search(r"`(python -m feature_extraction finalize [^`]+)`", str(info.value)).group(1))
    assert extraction_main(command[3:]) == 0  # the advised command works
    assert open_source(str(out)).manifest["n_images"] == 14
