"""The tests' fork server (tests/fork_server.py) gives what a fresh interpreter gives, and is really used.

A server that silently fell back to fresh interpreters would pass every test and save nothing, so the
suite's own environment (after conftest's imports, which set variables of their own) must be accepted.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import fork_server
import pytest

REPO_DPATH = Path(__file__).resolve().parents[1]


def fresh(argv: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(not fork_server.ENABLED, reason="SAE_PIPELINE_TEST_FORK=0 turns the server off")
def test_the_suites_environment_is_forked() -> None:
    before = dict(fork_server.COUNTS)
    result = fork_server.run([sys.executable, "-m", "sae_pipeline", "export", "--help"], cwd=REPO_DPATH)
    assert result.returncode == 0 and "--ckpt_path" in result.stdout, result.stderr[-2000:]
    assert fork_server.COUNTS["forked"] == before["forked"] + 1, (
        "the fork server refused the suite's own environment: every command pays a fresh interpreter's imports; "
        f"these: {fork_server._import_time_env(os.environ)}; the server's: {fork_server._SERVER.import_time_env}"
    )


def test_a_forked_command_says_what_a_fresh_one_says(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    (tmp_path / "run.yaml").write_text("model:\n  sae: [unclosed\n")
    for args in (["export", "--help"], ["fit", "--config", "run.yaml"], ["no_such_command"]):
        argv = [sys.executable, "-m", "sae_pipeline", *args]
        forked, reference = fork_server.run(argv, cwd=tmp_path, env=env, timeout=300), fresh(argv, tmp_path, env)
        assert (forked.returncode, forked.stdout, forked.stderr) == (
            reference.returncode,
            reference.stdout,
            reference.stderr,
        ), args


def test_a_variable_read_at_import_starts_a_fresh_interpreter(tmp_path: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "0" if os.environ.get("TRITON_INTERPRET") == "1" else "1"}
    before = dict(fork_server.COUNTS)
    result = fork_server.run([sys.executable, "-m", "sae_pipeline", "export", "--help"], cwd=tmp_path, env=env)
    assert result.returncode == 0
    assert fork_server.COUNTS["fresh"] == before["fresh"] + 1 and fork_server.COUNTS["forked"] == before["forked"]


def test_a_forked_process_is_read_waited_and_killed(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "sae_pipeline", "export", "--help"]
    process = fork_server.popen(argv, cwd=tmp_path, new_session=True, default_sigint=True)
    assert "--ckpt_path" in process.stdout.read() and process.wait(120) == 0 and process.poll() == 0
    long_fit = [sys.executable, "-m", "sae_pipeline", "fit", "--config", str(REPO_DPATH / "configs/topk_digits.yaml")]
    process = fork_server.popen([*long_fit, "--trainer.max_steps", "100000"], cwd=tmp_path, new_session=True)
    assert os.getpgid(process.pid) == process.pid  # a process group of its own, as start_new_session gives
    assert process.poll() is None
    process.kill()
    assert process.wait(120) == -9
