"""An export folder never holds two SAEs (reliability issue, item 7): exporting the other format into
a folder that holds an export is refused before anything is written; the same format replaces it.
``python -m sae_pipeline export`` through ``main`` in-process, one case in a real subprocess."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import fork_server
import pytest
import torch
from in_process import fit_in

from sae_pipeline.__main__ import main
from sae_pipeline.artifacts import load_sae

REPO_DPATH = Path(__file__).resolve().parents[1]
TOPK = str(REPO_DPATH / "configs" / "topk_digits.yaml")
FILES = {"native": ["sae.safetensors", "config.json"], "saelens": ["sae_weights.safetensors", "cfg.json"]}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A TopK SAE (d_sae 32) trained 2 steps on digits."""
    cwd = tmp_path_factory.mktemp("export_run")
    fit_in(cwd, "--config", TOPK, "--model.sae.init_args.d_sae", "32", "--trainer.max_steps", "2")
    return cwd / "runs/topk_digits/version_0/checkpoints/last.ckpt"


def export(ckpt: Path, out: Path, fmt: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    status = main(["export", "--ckpt_path", str(ckpt), "--out", str(out), "--format", fmt])
    return status, capsys.readouterr().err


def contents(dpath: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(dpath.iterdir())}


CASES = {  # name: (what --out holds, the format exported into it, refused)
    "native over SAELens": (FILES["saelens"], "native", True),
    "SAELens over native": (FILES["native"], "saelens", True),
    "native over a SAELens cfg.json alone": (["cfg.json"], "native", True),
    "SAELens over a native sae.safetensors alone": (["sae.safetensors"], "saelens", True),
    "native over native": (FILES["native"], "native", False),
    "SAELens over SAELens": (FILES["saelens"], "saelens", False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_export_folder_holds_one_sae(
    case: str, ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    held, fmt, refused = CASES[case]
    out = tmp_path / "sae"
    first = "native" if held[0] in FILES["native"] else "saelens"
    assert export(ckpt, out, first, capsys)[0] == 0
    for fname in set(FILES[first]) - set(held):
        (out / fname).unlink()
    before = contents(out)
    status, err = export(ckpt, out, fmt, capsys)
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    if refused:
        assert status == 2, err
        other = "SAELens" if first == "saelens" else "native"
        assert len(lines) == 1, err
        assert f"--out {out} holds a {other} export ({', '.join(f for f in FILES[first] if f in held)})" in lines[0]
        assert f"pass another --out, or remove {out} first to replace it" in lines[0]
        assert contents(out) == before  # nothing written, nothing removed
    else:
        assert status == 0 and not lines, err
        assert sorted(contents(out)) == sorted(FILES[fmt])
        assert load_sae(out).d_sae == 32


def test_the_command_refuses_the_other_format(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "sae"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_DPATH), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "sae_pipeline", "export", "--ckpt_path", str(ckpt), "--out", str(out)]
    assert fork_server.run(command, cwd=Path.cwd(), env=env, timeout=300).returncode == 0
    before = contents(out)
    result = fork_server.run([*command, "--format", "saelens"], cwd=Path.cwd(), env=env, timeout=300)
    assert result.returncode == 2, result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [
        (
            f"error: ExportError: --out {out} holds a native export (sae.safetensors, config.json) "
            f"and one folder holds one SAE; pass another --out, or remove {out} first to replace it"
        )
    ]
    assert contents(out) == before


FOREIGN = {  # name: (file in --out, its content, format exported, refused)
    "another program's config.json": ("config.json", '{"model_type": "bert", "hidden_size": 768}\n', "native", True),
    "a config.json that is no JSON": ("config.json", "[settings]\nkey = 1\n", "native", True),
    "SAELens's own cfg.json": ("cfg.json", '{"architecture": "standard", "metadata": {}}\n', "saelens", True),
    "our export of just after the move": (
        "config.json",
        '{"format": "sae_pipeline.artifacts.export/1"}\n',
        "native",
        False,
    ),
}


@pytest.mark.parametrize("case", sorted(FOREIGN))
def test_a_config_another_program_wrote_is_not_replaced(
    case: str, ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As ``features`` refuses an --out that is not its site, ``export`` refuses to replace a config it did not
    write (issue 31, item 4); our own earlier export, in either format's spelling, is replaced as before."""
    fname, text, fmt, refused = FOREIGN[case]
    out = tmp_path / "app"
    out.mkdir()
    (out / fname).write_text(text)
    before = contents(out)
    status, err = export(ckpt, out, fmt, capsys)
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    if refused:
        assert status == 2 and len(lines) == 1, err
        assert f"--out {out} holds a {fname} that this package did not write" in lines[0]
        assert f"pass another --out, or move {out / fname} away first" in lines[0]
        assert contents(out) == before
    else:
        assert status == 0 and not lines, err
        assert load_sae(out).d_sae == 32


def test_a_groups_export_checks_every_member_folder_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from test_group_artifacts import group_checkpoint

    ckpt = group_checkpoint(tmp_path / "group.ckpt", ["first", "second"])
    (tmp_path / "out" / "second").mkdir(parents=True)
    (tmp_path / "out" / "second" / "config.json").write_text('{"name": "another program"}\n')
    status, err = export(ckpt, tmp_path / "out", "native", capsys)
    assert status == 2 and "holds a config.json that this package did not write" in err, err
    assert not (tmp_path / "out" / "first").exists()  # refused before the first member was written


def without_mark(fpath: Path) -> None:
    """Rewrite a safetensors file with the same tensors and no metadata: another program's, or ours before the mark."""
    from safetensors.torch import load_file, save_file

    save_file(load_file(str(fpath)), str(fpath))


OTHERS = {  # name: (the format exported first, or None, what is then added or changed, format exported, refused)
    "a lone sae.safetensors": (None, "sae.safetensors", "native", True),
    "a lone SAELens sae_weights.safetensors": (None, "sae_weights.safetensors", "saelens", True),
    "another program's weights beside our config": ("native", "unmarked sae.safetensors", "native", True),
    "a user's file beside our export": ("native", "notes.txt", "native", True),
    "a folder beside our export": ("saelens", "runs/", "saelens", True),
    "the temporary file of a killed export": ("native", ".sae.safetensors.4242.tmp", "native", False),
    "our SAELens export of before the mark": ("saelens", "unmarked sae_weights.safetensors", "saelens", False),
}


@pytest.mark.parametrize("case", sorted(OTHERS))
def test_an_out_holding_a_file_export_did_not_write_is_refused(
    case: str, ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 43, item 5: nothing written by someone else is replaced, or joined. Export knows its own files by
    their marks (config's format, weights' header metadata) and names (its lock, its temporary files); anything
    else in --out is refused in one line before anything is written. Re-exporting over its own export works."""
    first, added, fmt, refused = OTHERS[case]
    out = tmp_path / "sae"
    if first is not None:
        assert export(ckpt, out, first, capsys)[0] == 0
    name = added.removeprefix("unmarked ").rstrip("/")
    if added.startswith("unmarked "):
        without_mark(out / name)
    elif added.endswith(".safetensors"):  # another program's weights, with its own metadata
        from safetensors.torch import save_file

        out.mkdir()
        save_file({"W": torch.zeros(2, 2)}, str(out / name), metadata={"format": "pt"})
    elif added.endswith("/"):
        (out / name).mkdir()
    else:
        (out / name).write_text("not an export's\n")
    before = contents(out) if not added.endswith("/") else None
    status, err = export(ckpt, out, fmt, capsys)
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    if refused:
        assert status == 2 and len(lines) == 1, err
        what = f"a {name} that" if name in FILES[fmt] else f"{name}, which"  # a file it would replace, or join
        assert f"--out {out} holds {what} this package did not write" in lines[0], lines[0]
        assert "pass another --out" in lines[0], lines[0]
        assert before is None or contents(out) == before  # nothing written, nothing removed
    else:
        assert status == 0 and not lines, err
        assert sorted(p.name for p in out.iterdir() if not p.name.endswith(".tmp")) == sorted(FILES[fmt])
        assert load_sae(out).d_sae == 32


def test_a_groups_out_holding_a_file_export_did_not_write_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from test_group_artifacts import group_checkpoint

    ckpt = group_checkpoint(tmp_path / "group.ckpt", ["first", "second"])
    assert export(ckpt, tmp_path / "out", "native", capsys)[0] == 0
    assert export(ckpt, tmp_path / "out", "native", capsys)[0] == 0  # over its own export: replaced
    (tmp_path / "out" / "README.md").write_text("the user's notes\n")
    status, err = export(ckpt, tmp_path / "out", "native", capsys)
    assert status == 2 and f"--out {tmp_path / 'out'} holds README.md, which this package did not write" in err, err
