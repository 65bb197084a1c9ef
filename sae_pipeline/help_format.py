"""``--help`` that shows each option's default where it says something.

jsonargparse (``fit``, ``extract``, ``export``, ``evaluate``, the demo) appends ``(type: T, default: X)``
to every option's help, argparse's ``ArgumentDefaultsHelpFormatter`` ``(default: X)``. For a
required flag, a flag whose default is None (its help says what happens then) or one whose help
already names its default, that addition only repeats or says ``default: null``; one rule
(:class:`DefaultsWhereUseful`) leaves those as written, for both parsers.
"""
from __future__ import annotations

import argparse

from jsonargparse import DefaultHelpFormatter


class DefaultsWhereUseful:
    """The help text as written when the option is required, has no default, or names its default already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.required or not action.option_strings or action.default is None
                or action.default is argparse.SUPPRESS or "default" in text.lower()):
            return text
        return super()._get_help_string(action)  # type: ignore[misc]


class DefaultsHelpFormatter(DefaultsWhereUseful, DefaultHelpFormatter):
    """For jsonargparse parsers: ``(type: T, default: X)`` where it says something."""


class ArgparseDefaultsHelpFormatter(DefaultsWhereUseful, argparse.ArgumentDefaultsHelpFormatter):
    """For the one plain argparse parser left (``features``, whose ``--config`` is a training config)."""
