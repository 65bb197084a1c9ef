"""``--help`` that shows each option's default where it says something, for our jsonargparse commands.

jsonargparse (``fit``, ``extract``, ``export``, ``evaluate``, ``features``, the demo) appends
``(type: T, default: X)`` to every option's help. For a required flag, a flag whose default is None
(its help says what happens then) or one whose help already names its default, that addition only
repeats or says ``default: null``; this formatter leaves those as written.
"""

from __future__ import annotations

import argparse

from jsonargparse import DefaultHelpFormatter


class DefaultsHelpFormatter(DefaultHelpFormatter):
    """jsonargparse's ``(type: T, default: X)`` unless the option is required, has no default, or says it already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            action.required
            or not action.option_strings
            or action.default is None
            or action.default is argparse.SUPPRESS
            or "default" in text.lower()
        ):
            return text
        return super()._get_help_string(action)
