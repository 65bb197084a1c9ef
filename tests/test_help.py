"""Conventions of the command line: one entry point lists every command; every option's help shows its default."""

from __future__ import annotations

import argparse
import os
import sys

import fork_server
import pytest
from jsonargparse import ArgumentParser

from feature_extraction.help_format import DefaultsHelpFormatter
from sae_pipeline.__main__ import COMMANDS, LIGHTNING_COMMANDS, usage
from sae_pipeline.evaluate.parser import build_parser


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def defaulted_options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        a
        for a in parser._actions
        if a.option_strings
        and a.default not in (None, argparse.SUPPRESS)
        and not a.required
        and not isinstance(a, argparse._HelpAction)
    ]


def test_top_level_help_lists_every_command() -> None:
    text = usage()
    for name in (*LIGHTNING_COMMANDS, *COMMANDS):
        assert f"\n  {name} " in text
    assert {"export", "extract", "evaluate"} <= set(COMMANDS)


@pytest.mark.parametrize("name", sorted(subparsers(build_parser())))
def test_every_evaluate_option_shows_its_default(name: str) -> None:
    parser = subparsers(build_parser())[name]
    formatter = parser._get_formatter()
    options = defaulted_options(parser)
    for action in options:
        shown = formatter._expand_help(action) if action.help else ""  # the text --help prints for it
        assert "default" in shown, f"{name} {action.option_strings[-1]}: --help does not show its default"
    if name != "report":
        assert options  # every study command has defaulted options to show


def test_formatter_adds_defaults_only_where_they_say_something() -> None:
    parser = ArgumentParser(formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=7, help="steps")
    parser.add_argument("--out", required=True, help="folder")
    parser.add_argument("--cap", default=None, help="cap on tokens")
    parser.add_argument("--data", default="digits", help="source (default: the bundled digits)")
    text = " ".join(parser.format_help().split())
    assert "steps (type: int, default: 7)" in text
    assert "folder (" not in text and "cap on tokens (" not in text
    assert text.count("default") == 2  # --data keeps its own wording, once


@pytest.mark.parametrize(
    "module",
    [
        "sae_pipeline.artifacts.export",
        "sae_pipeline.evaluate.__main__",
        "sae_pipeline.demo",
        "feature_extraction.__main__",
        "sae_pipeline.features.cli",
    ],
)
def test_every_other_command_is_jsonargparse_with_the_one_error_line(module: str, capsys) -> None:
    """export, evaluate, demo, extract and features: jsonargparse parsers, and a bad flag is one ``error:`` line
    naming it and exit 2 (``exit_status.run_cli``; features, a multi-rank command, through the dispatcher)."""
    import importlib

    import jsonargparse

    from sae_pipeline.__main__ import main as dispatch

    command = importlib.import_module(module)
    assert isinstance(command.build_parser(), jsonargparse.ArgumentParser)
    argv = ["inference", "--out", "x", "--no_such_flag", "1"] if "evaluate" in module else ["--no_such_flag", "1"]
    status = dispatch(["features", *argv]) if "features" in module else command.main(argv)
    assert status == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and " INFO " not in line]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "--no_such_flag" in lines[0], err


def test_export_help_shows_the_formats_and_default() -> None:
    result = fork_server.run([sys.executable, "-m", "sae_pipeline", "export", "--help"], cwd=os.getcwd(), timeout=120)
    text = " ".join(result.stdout.split())
    assert result.returncode == 0 and "--format {native,saelens}" in text and "(default: native)" in text


@pytest.mark.slow
@pytest.mark.parametrize("command", ["fit", "extract"])
def test_jsonargparse_commands_show_defaults_too(command: str) -> None:
    result = fork_server.run([sys.executable, "-m", "sae_pipeline", command, "--help"], cwd=os.getcwd(), timeout=300)
    assert result.returncode == 0 and result.stdout.count("default: ") >= 5  # jsonargparse: (type: T, default: X)


def test_config_file_sets_the_flags_of_export_and_evaluate(tmp_path, capsys) -> None:
    """The jsonargparse style: ``--config FILE`` sets any flag (here one that names a missing checkpoint)."""
    from sae_pipeline.artifacts.export import main as export_main

    config = tmp_path / "export.yaml"
    config.write_text(f"ckpt_path: {tmp_path / 'missing.ckpt'}\nout: {tmp_path / 'out'}\nformat: saelens\n")
    assert export_main(["--config", str(config)]) == 2
    assert f"--ckpt_path {tmp_path / 'missing.ckpt'}: file not found" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()

    study = tmp_path / "study.yaml"
    study.write_text("out: eval_out\nk: [4, 8]\nvariants: [mpsae]\n")
    parsed = build_parser().parse_args(["inference", "--config", str(study), "--k_main", "4"])
    assert (parsed.inference.out, parsed.inference.k, parsed.inference.variants) == ("eval_out", [4, 8], ["mpsae"])
    assert parsed.inference.k_main == 4 and parsed.inference.p_main == 1000  # flags after it and defaults still apply
