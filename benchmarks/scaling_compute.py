"""Parts of benchmarks/scaling.py (placeholder: filled in by the scaling work)."""

from __future__ import annotations

import argparse

PARTS: dict = {}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass
