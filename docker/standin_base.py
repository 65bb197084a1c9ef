"""Build a stand-in for the CUDA PyTorch base image with buildah, where no registry can be pulled.

The project's Dockerfile expects a PyTorch image (`pytorch/pytorch:*-runtime`): a Python on PATH
that already holds torch and torchvision. Without a registry this module makes one:

1. `debootstrap --variant=minbase` a Debian root filesystem (python3, python3-venv,
   ca-certificates) straight into a `buildah from scratch` container, from the mirror the
   machine's own apt sources name (read at run time, never written down), and commit it.
2. `pip download` torch and torchvision (the versions this interpreter has, which satisfy
   pyproject.toml) with their dependencies on the host, while step 1 runs: local files where
   the machine's pip finds them there, PyPI otherwise.
3. `buildah bud docker/base.Containerfile`: the machine's CA bundle copied in, a venv on PATH,
   the wheels installed from a bind mount (nothing downloaded inside, nothing left behind).

By hand (as root; prints the base image's name and each stage's seconds):

    python docker/standin_base.py --tag localhost/pytorch-standin:latest
    buildah bud --isolation chroot --network host --build-arg BASE_IMAGE=localhost/pytorch-standin:latest \\
        -t sae-pipeline .

Why these choices are the fast ones, with the measured times, is in BENCHMARKS.md ("Docker image build and run").
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from importlib import metadata
from pathlib import Path

DOCKER_DPATH = Path(__file__).resolve().parent
CONTAINERFILE = DOCKER_DPATH / "base.Containerfile"
SUITE = "bookworm"
PACKAGES = "python3,python3-venv,ca-certificates"
INSTALL_HINT = "apt-get install -y --no-install-recommends buildah debootstrap (as root; .ci/run does it)"


def apt_mirror(suite: str = SUITE, etc_apt: Path = Path("/etc/apt")) -> str:
    """The first http(s) URI the machine's apt sources use for `suite` itself (not -updates/-security)."""
    entries: list[tuple[list[str], list[str]]] = []  # (uris, suites)
    list_files = [etc_apt / "sources.list", *sorted((etc_apt / "sources.list.d").glob("*.list"))]
    for fpath in list_files:
        if fpath.is_file():
            for line in fpath.read_text().splitlines():
                words = re.sub(r"\[[^]]*\]", "", line.split("#", 1)[0]).split()
                if len(words) >= 3 and words[0] == "deb":
                    entries.append(([words[1]], [words[2]]))
    for fpath in sorted((etc_apt / "sources.list.d").glob("*.sources")):
        for stanza in re.split(r"\n\s*\n", fpath.read_text()):
            fields: dict[str, str] = {}
            for line in stanza.splitlines():
                if ":" in line and not line.startswith(("#", " ")):
                    key, value = line.split(":", 1)
                    fields[key.strip().lower()] = value.strip()
            if "deb" in fields.get("types", "").split() and fields.get("enabled", "yes").lower() != "no":
                entries.append((fields.get("uris", "").split(), fields.get("suites", "").split()))
    for uris, suites in entries:
        if suite in suites:
            for uri in uris:
                if uri.startswith(("http://", "https://")):
                    return uri
    raise RuntimeError(f"no apt source for '{suite}' in {etc_apt}; debootstrap needs a Debian mirror")


def ca_bundle() -> Path:
    """The certificate bundle the machine's pip trusts (PIP_CERT, pip's config, the system bundle)."""
    candidates = [os.environ.get("PIP_CERT")]
    configured = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.cert"], capture_output=True, text=True
    )
    candidates += [
        configured.stdout.strip() if configured.returncode == 0 else None,
        os.environ.get("REQUESTS_CA_BUNDLE"),
        os.environ.get("SSL_CERT_FILE"),
        "/etc/ssl/certs/ca-certificates.crt",
    ]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    raise RuntimeError("no CA bundle found (PIP_CERT, pip config global.cert, /etc/ssl/certs/ca-certificates.crt)")


def torch_requirements() -> list[str]:
    """`torch==X`, `torchvision==Y`: this interpreter's versions without a local label (`+cu130`)."""
    return [f"{name}=={metadata.version(name).split('+')[0]}" for name in ("torch", "torchvision")]


class Buildah:
    """buildah with its own storage (`--root`/`--runroot`), so that removing one folder cleans up."""

    def __init__(self, storage_dpath: Path | None = None) -> None:
        """`storage_dpath` None: the system's storage, where a plain `buildah bud` finds the image."""
        self.storage = storage_dpath
        self.global_args = (
            []
            if storage_dpath is None
            else [
                "--root",
                str(storage_dpath / "root"),
                "--runroot",
                str(storage_dpath / "run"),
                "--storage-driver",
                "overlay",
            ]
        )

    def __call__(self, *args: str, **kwargs) -> str:
        result = subprocess.run(["buildah", *self.global_args, *args], capture_output=True, text=True, **kwargs)
        if result.returncode != 0:
            raise RuntimeError(
                f"buildah {' '.join(args[:2])} failed ({result.returncode}):\n{(result.stdout + result.stderr)[-4000:]}"
            )
        return result.stdout.strip()

    def cleanup(self) -> None:
        """Remove every container and image of this storage, then the storage folder (own storage only)."""
        if self.storage is None:
            return
        for args in (("rm", "--all"), ("rmi", "--all", "--force")):
            subprocess.run(["buildah", *self.global_args, *args], capture_output=True)
        subprocess.run(["umount", "--recursive", "--lazy", str(self.storage / "root" / "overlay")], capture_output=True)
        shutil.rmtree(self.storage, ignore_errors=True)


def build_rootfs(buildah: Buildah, tag: str, mirror: str) -> None:
    """debootstrap into a scratch container's root and commit it as `tag` (one layer)."""
    container = buildah("from", "scratch")
    try:
        root = buildah("mount", container)
        result = subprocess.run(
            ["debootstrap", "--variant=minbase", f"--include={PACKAGES}", SUITE, root, mirror],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise RuntimeError(f"debootstrap failed ({result.returncode}):\n{(result.stdout + result.stderr)[-3000:]}")
        shutil.rmtree(Path(root) / "var" / "cache" / "apt" / "archives", ignore_errors=True)
        buildah("commit", "--quiet", container, tag)
    finally:
        subprocess.run(["buildah", *buildah.global_args, "rm", container], capture_output=True)


def download_wheels(requirements: list[str], dest: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--dest", str(dest), *requirements],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(f"pip download {' '.join(requirements)} failed:\n{result.stderr[-3000:]}")


def cpu_seconds() -> float:
    """User + system CPU time of this process and its finished children (wall time hides a loaded machine)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def build(buildah: Buildah, tag: str, work_dpath: Path) -> dict[str, float]:
    """Build the stand-in base as `tag`; returns the wall seconds of each stage, and CPU seconds in all."""
    cpu_start = cpu_seconds()
    work_dpath.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}
    requirements = torch_requirements()
    context = work_dpath / "base-context"
    (context / "wheels").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(ca_bundle(), context / "ca-certificates.crt")
    download_error: list[BaseException] = []

    def download() -> None:
        start = time.perf_counter()
        try:
            download_wheels(requirements, context / "wheels")
        except BaseException as error:  # re-raised in the caller's thread
            download_error.append(error)
        seconds["pip download (host, beside debootstrap)"] = time.perf_counter() - start

    downloader = threading.Thread(target=download)
    downloader.start()
    start = time.perf_counter()
    rootfs_tag = tag.rsplit(":", 1)[0] + "-rootfs:" + SUITE
    try:
        build_rootfs(buildah, rootfs_tag, apt_mirror())
    finally:
        seconds["debootstrap + commit"] = time.perf_counter() - start
        downloader.join()
    if download_error:
        raise download_error[0]
    start = time.perf_counter()
    buildah(
        "bud",
        "--isolation",
        "chroot",
        "--network",
        "host",
        "--format",
        "docker",
        "--quiet",
        "--file",
        str(CONTAINERFILE),
        "--build-arg",
        f"ROOTFS_IMAGE={rootfs_tag}",
        "--build-arg",
        f"TORCH_REQUIREMENTS={' '.join(requirements)}",
        "--tag",
        tag,
        str(context),
    )
    seconds["base stage: pip install torch + commit"] = time.perf_counter() - start
    shutil.rmtree(context, ignore_errors=True)
    buildah("rmi", rootfs_tag)
    seconds["CPU seconds, all stages"] = cpu_seconds() - cpu_start
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tag", default="localhost/pytorch-standin:latest", help="name of the image to build")
    parser.add_argument(
        "--storage",
        type=Path,
        default=None,
        help="a folder for buildah's storage (default: the system's, where `buildah bud` looks)",
    )
    parser.add_argument("--work", type=Path, default=Path("standin-build"), help="scratch folder (wheels)")
    args = parser.parse_args(argv)
    missing = [
        name
        for name in ("buildah", "debootstrap")
        if shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None
    ]
    if missing:
        print(f"error: {', '.join(missing)} not found; install with: {INSTALL_HINT}", file=sys.stderr)
        return 2
    buildah = Buildah(args.storage)
    for stage, value in build(buildah, args.tag, args.work).items():
        print(f"{stage}: {value:.0f} s")
    print(args.tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
