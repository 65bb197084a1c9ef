"""Every command the docs tell a user to copy is run here at a tiny size, or says why it is not.

The commands are the lines of the ``bash`` blocks of README.md and docs/ (``tests/docs_text.py``).
Each one is

- run by ``test_documented_commands_run_at_a_tiny_size``, in one scratch directory, in the order
  of ``TINY`` and with the flags ``TINY`` adds to keep it small (fewer steps, fewer pages);
- run by another test (``RUN_ELSEWHERE``: the test is named and must exist); or
- marked in the docs with ``# not run by the tests: REASON`` (a GPU, a cluster, an hour).

A command in none of these fails ``test_every_documented_command_is_run_or_says_why``; an entry of
``TINY`` the docs no longer show fails too, so the table follows the docs. The flags of every
command, marked ones included, are checked against that command's ``--help``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import fork_server
import pytest
from docs_text import REPO_DPATH, bash_commands, documented_commands

FIT_TINY = ["--trainer.max_steps", "2"]
#: command as the docs write it -> flags appended to keep it tiny; run in this order, in one directory.
TINY: dict[str, list[str]] = {
    "mkdir -p slurm-logs": [],
    "python -m feature_extraction --config configs/extract_demo.yaml": [],
    "python -m sae_pipeline fit --config configs/demo_shards.yaml": [
        "--trainer.max_epochs",
        "1",
        "--trainer.check_val_every_n_epoch",
        "1",
    ],
    "python -m sae_pipeline features --config configs/demo_shards.yaml --ckpt_path last --out site_demo": [
        "--top",
        "2",
        "--atoms",
        "0",
        "1",
    ],
    "python -m sae_pipeline export --ckpt_path runs/demo_shards/version_0/checkpoints/last.ckpt --out exported_demo": [],  # noqa: E501
    "python -m sae_pipeline.evaluate sae --sae exported_demo --data demo_out/shards --out eval_demo": [],
    "python -m sae_pipeline fit --config configs/mpsae_digits.yaml": FIT_TINY,
    "python -m sae_pipeline fit --config configs/mpsae_digits.yaml --model.sae.init_args.k 20 --print_config": [],
    "python -m sae_pipeline fit --config configs/mpsae_digits.yaml --ckpt_path last": ["--trainer.max_steps", "4"],
    "python -m sae_pipeline validate --config configs/mpsae_digits.yaml --ckpt_path last": [],
    "python -m sae_pipeline predict --config configs/mpsae_digits.yaml --ckpt_path last": [],
    "python -m sae_pipeline export --ckpt_path runs/mpsae_digits/version_0/checkpoints/last.ckpt --out exported": [],
    "python -m sae_pipeline export --ckpt_path runs/mpsae_digits/version_0/checkpoints/last.ckpt --out sl_mpsae "
    "--format saelens": [],
    "python -m sae_pipeline.evaluate sae --sae sl_mpsae --data digits --out eval_sl": [],
    "python -m sae_pipeline.evaluate sae --sae exported --data digits --out eval_one": [],
    "python -m sae_pipeline.evaluate causal --sae exported --data digits --out eval_causal": [],
    "python -m sae_pipeline features --config configs/mpsae_digits.yaml --ckpt_path last --out site_digits": [
        "--top",
        "2",
        "--atoms",
        "0",
        "1",
    ],
    "python -m sae_pipeline fit --config configs/group_digits.yaml": FIT_TINY,
    "python -m sae_pipeline export --ckpt_path runs/group_digits/version_0/checkpoints/last.ckpt "
    "--out exported_group": [],
    "python -m sae_pipeline export --ckpt_path runs/group_digits/version_0/checkpoints/last.ckpt "
    "--out exported_relu --name relu": [],
    "python -m sae_pipeline features --config configs/group_digits.yaml --ckpt_path last --name relu --out site_relu": [
        "--top",
        "2",
        "--atoms",
        "0",
        "1",
    ],
    "python -m sae_pipeline.evaluate dictionary --npz authors --data mnist_sample --out eval_authors": [
        "--max_tokens",
        "300",
    ],
}
#: TINY's commands that read nothing the others write (the demo's shards, the group, the authors'
#: dictionary) run in a second lane beside them, each lane in TINY's order: two cores, half the wait.
SECOND_LANE = ("demo", "group", "authors")
#: command -> the test (``path::name``) or script that runs it.
RUN_ELSEWHERE: dict[str, str] = {
    "make demo": "tests/test_demo.py::test_shard_stage_end_to_end",  # its stages, without the venv it creates
    "make test": ".ci/run",  # the suite itself: CI runs it
    "python -m sae_pipeline --help": "tests/test_docs_commands.py::test_documented_flags_exist",
    "python -m feature_extraction --help": "tests/test_docs_commands.py::test_documented_flags_exist",
    "python -m sae_pipeline features --help": "tests/test_docs_commands.py::test_documented_flags_exist",
    "python -m sae_pipeline features explain --help": "tests/test_docs_commands.py::test_documented_flags_exist",
    "python -m sae_pipeline.evaluate --help": "tests/test_docs_commands.py::test_documented_flags_exist",
    "python -m sae_pipeline fit --config configs/mpsae_digits.yaml --data.cache ram": (
        "tests/test_data_cache.py::test_fit_with_cache_saves_the_flag_and_resumes_like_the_uncached_run"
    ),
}


def commands_by_status() -> tuple[list[str], list[str]]:
    """``(unaccounted, marked without a reason)``: documented commands that break the rule, ``file:line: cmd``."""
    unaccounted, unexplained = [], []
    for fpath, number, command, reason in documented_commands():
        where = f"{fpath.relative_to(REPO_DPATH)}:{number}: {command}"
        if reason is None and command not in TINY and command not in RUN_ELSEWHERE:
            unaccounted.append(where)
        elif reason is not None and len(reason) < 8:
            unexplained.append(where)
    return unaccounted, unexplained


def test_every_documented_command_is_run_or_says_why() -> None:
    unaccounted, unexplained = commands_by_status()
    assert not unaccounted, (
        "commands in the docs that no test runs; add them to TINY or RUN_ELSEWHERE in "
        f"tests/test_docs_commands.py, or end them with '# not run by the tests: REASON': {unaccounted}"
    )
    assert not unexplained, f"'not run by the tests:' needs a reason: {unexplained}"


def test_every_tiny_command_is_still_in_the_docs() -> None:
    documented = {command for _, _, command, _ in documented_commands()}
    assert [command for command in [*TINY, *RUN_ELSEWHERE] if command not in documented] == []


def test_commands_run_elsewhere_name_tests_that_exist() -> None:
    for target in RUN_ELSEWHERE.values():
        fpath, _, name = target.partition("::")
        assert (REPO_DPATH / fpath).is_file(), target
        assert not name or re.search(rf"^def {re.escape(name)}\(", (REPO_DPATH / fpath).read_text(), re.M), target


def test_command_collector_sees_continuations_comments_and_marks(tmp_path: Path) -> None:
    """The collector itself: a command it misses would pass unchecked."""
    page = tmp_path / "page.md"
    page.write_text(
        "```bash\n# a comment\npython -m a \\\n    --x 1   # says what\n"
        "python -m b  # not run by the tests: needs a GPU\n```\n\n```python\nimport c\n```\n"
        "```bash\n# not run by the tests: a cluster\nsbatch d\nsbatch e\n```\n",
        encoding="utf-8",
    )
    assert list(bash_commands(page)) == [
        (3, "python -m a --x 1", None),
        (5, "python -m b", "needs a GPU"),
        (13, "sbatch d", "a cluster"),
        (14, "sbatch e", "a cluster"),
    ]


# -- flags ---------------------------------------------------------------------------------------------


#: how a documented command line names one of our commands: (tokens before, command key, tokens that follow
#: it before the flags)
def command_and_flags(command: str) -> tuple[tuple[str, ...], list[str]] | None:
    """``(our command as argv of python -m sae_pipeline, its flags)`` for a documented line, None if it runs
    none of ours. Docker, torchrun, sbatch and sweep lines are read for the command they start."""
    tokens = shlex.split(command)
    for index, token in enumerate(tokens):
        rest = tokens[index + 1 :]
        if token == "-m" and rest[:1] == ["sae_pipeline"]:
            sub = rest[1:2] if rest[1:2] and not rest[1].startswith("-") else []
            if sub == ["features"] and rest[2:3] == ["explain"]:
                sub = rest[1:3]
            return tuple(sub), rest[1 + len(sub) :]
        if token == "-m" and rest[:1] == ["sae_pipeline.evaluate"]:
            sub = rest[1:2] if rest[1:2] and not rest[1].startswith("-") else []
            return ("evaluate", *sub), rest[1 + len(sub) :]
        if token == "-m" and rest[:1] == ["feature_extraction"]:
            return ("extract",), rest[1:]
        if token == "slurm/train.sh":
            return ("fit",), rest[1:]
        if token == "slurm/sweep.sh":
            return ("fit",), rest[rest.index("--") + 1 :] if "--" in rest else []
        if token == "sae-pipeline" and tokens[0] == "docker" and rest[:1] in (["fit"], ["extract"]):
            return (rest[0],), rest[1:]
    return None


def flag_names(arguments: list[str]) -> set[str]:
    """``--a.b.init_args.c=1`` -> ``--a.b``: what a ``--help`` lists (nested class arguments are checked
    through the class's own signature, not the help)."""
    names = set()
    for argument in arguments:
        if argument.startswith("--") and argument != "--":
            name = argument.split("=", 1)[0].rstrip("+")
            names.add(name.split(".init_args.", 1)[0])
    return names


HELP_SCRIPT = """
import contextlib, io, json, sys
from sae_pipeline.__main__ import main
helps = {}
for argv in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            main([*argv, "--help"])
        except SystemExit:
            pass
    helps[" ".join(argv)] = out.getvalue()
print(json.dumps(helps))
"""


@pytest.mark.slow
def test_documented_flags_exist() -> None:
    """Every ``--flag`` of every documented command (GPU and cluster lines included) is one its ``--help`` lists."""
    uses: dict[tuple[str, ...], dict[str, str]] = {}
    for fpath, number, command, _ in documented_commands():
        parsed = command_and_flags(command)
        if parsed is not None:
            sub, arguments = parsed
            for name in flag_names(arguments):
                uses.setdefault(sub, {}).setdefault(name, f"{fpath.relative_to(REPO_DPATH)}:{number}")
    assert ("fit",) in uses and ("extract",) in uses  # the collector sees the main commands
    env = {**os.environ, "PYTHONPATH": str(REPO_DPATH), "COLUMNS": "200"}
    result = subprocess.run(
        [sys.executable, "-c", HELP_SCRIPT, json.dumps([list(sub) for sub in uses])],
        cwd=REPO_DPATH,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    helps = json.loads(result.stdout.strip().splitlines()[-1])
    missing = []
    for sub, names in uses.items():
        listed = set(re.findall(r"--[\w.\-]+", helps[" ".join(sub)]))
        assert listed, f"no --help output for {sub}"
        missing += [f"{where}: {' '.join(sub)} {name}" for name, where in names.items() if name not in listed]
    assert not missing, f"flags the docs use that the command does not have: {missing}"


def test_flag_reader_reads_each_launcher() -> None:
    assert command_and_flags("sbatch --nodes=4 slurm/train.sh configs/x.yaml --model.sae.init_args.k 64") == (
        ("fit",),
        ["--model.sae.init_args.k", "64"],
    )
    assert command_and_flags("bash slurm/sweep.sh list.txt -- --trainer.max_epochs 10") == (
        ("fit",),
        ["--trainer.max_epochs", "10"],
    )
    assert command_and_flags("docker run --gpus all -v a:b sae-pipeline extract --images x")[0] == ("extract",)
    assert command_and_flags("OMP_NUM_THREADS=1 python -m sae_pipeline.evaluate all --k 5") == (
        ("evaluate", "all"),
        ["--k", "5"],
    )
    assert command_and_flags("tensorboard --logdir runs") is None
    assert flag_names(["--model.sae.init_args.k", "64", "--trainer.callbacks+=X", "--a=1"]) == {
        "--model.sae",
        "--trainer.callbacks",
        "--a",
    }


# -- running them --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_documented_commands_run_at_a_tiny_size(tmp_path: Path) -> None:
    """Each command of ``TINY``, as a user types it in a clone (``configs/`` beside it), in one directory."""
    (tmp_path / "configs").symlink_to(REPO_DPATH / "configs", target_is_directory=True)
    env = {**os.environ, "PYTHONPATH": str(REPO_DPATH), "OMP_NUM_THREADS": "1"}

    def run_lane(commands: list[str]) -> list[str]:
        """The failures of one lane: it stops at its first, as a user would."""
        for command in commands:
            argv = shlex.split(command)
            if argv[0] == "python":
                argv[0] = sys.executable
            argv += TINY[command]
            result = fork_server.run(argv, cwd=tmp_path, env=env, timeout=600)
            if result.returncode != 0:
                return [f"{shlex.join(argv[1:])}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"]
        return []

    second = [command for command in TINY if any(mark in command for mark in SECOND_LANE)]
    lanes = [[command for command in TINY if command not in second], second]
    with ThreadPoolExecutor(len(lanes)) as pool:
        failures = [failure for lane in pool.map(run_lane, lanes) for failure in lane]
    assert not failures, "\n\n".join(failures)
    assert (tmp_path / "site_demo" / "index.html").is_file() and (tmp_path / "site_digits" / "index.html").is_file()
    assert (tmp_path / "exported" / "sae.safetensors").is_file() and (tmp_path / "sl_mpsae" / "cfg.json").is_file()
    assert json.loads((tmp_path / "eval_one" / "results.json").read_text())["saes"]
