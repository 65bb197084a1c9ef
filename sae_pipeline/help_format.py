"""``--help`` that shows each option's default, for the argparse commands (export, evaluate).

LightningCLI and jsonargparse (``fit``, ``extract``) print defaults already; argparse does
only with a formatter. ``argparse.ArgumentDefaultsHelpFormatter`` would also print
``(default: None)`` for required flags and repeat a default the help text already names, so
this one adds ``(default: X)`` only where it tells the reader something.
"""
from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Append ``(default: X)`` to an option's help unless it is required, has no default, or says it already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.required or not action.option_strings or action.default is None
                or action.default is argparse.SUPPRESS or "default" in text.lower()):
            return text
        return f"{text} (default: %(default)s)"
