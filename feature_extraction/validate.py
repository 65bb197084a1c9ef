"""The integer and number checks of every setting, with one wording for every message.

A setting that reaches a constructor from a YAML config or a flag can be a bool (YAML's
``true`` is an int to Python), a string, NaN or an infinity; each check names the setting,
the values it accepts and the value it got, in one line::

    model.warmup_steps must be an integer >= 0, got -1
    k must be an integer in [1, 768], got 0
    model.lr must be a finite number > 0, got nan

It lives at the bottom of the layering (``feature_extraction`` imports nothing of
``sae_pipeline``), so that both packages, the SAE classes included, use the same checks.
"""

from __future__ import annotations

import math
import numbers


def _bounds(
    minimum: float | None, maximum: float | None, strict_minimum: bool, strict_maximum: bool, show: type = int
) -> str:
    """``>= 1``, ``< 1``, ``in (0, 768]``, or nothing for no bounds."""

    def text(x: float) -> str:
        return str(x) if show is int else f"{x:g}"

    low = None if minimum is None else ("> " if strict_minimum else ">= ") + text(minimum)
    high = None if maximum is None else ("< " if strict_maximum else "<= ") + text(maximum)
    if low is not None and high is not None:
        return (
            f" in {'(' if strict_minimum else '['}{text(minimum)}, {text(maximum)}"  # type: ignore[arg-type]
            f"{')' if strict_maximum else ']'}"
        )
    return f" {low or high}" if (low or high) else ""


def check_int(
    name: str, value: object, minimum: int | None = None, maximum: int | None = None, *, note: str = "", fix: str = ""
) -> int:
    """``value`` as an int if it is an integer (not a bool; numpy integers pass) in [minimum, maximum].

    Otherwise a one-line ValueError: ``{name} must be an integer >= 1{note}, got 0{fix}``, where
    ``note`` says where the bounds come from and ``fix`` (``"; ..."``) what to do instead.
    """
    valid = f"an integer{_bounds(minimum, maximum, False, False)}{note}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be {valid}, got {value!r}{fix}")
    number = int(value)
    if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        raise ValueError(f"{name} must be {valid}, got {number}{fix}")
    return number


def check_float(
    name: str,
    value: object,
    minimum: float | None = None,
    maximum: float | None = None,
    *,
    strict_minimum: bool = False,
    strict_maximum: bool = False,
    note: str = "",
    fix: str = "",
) -> float:
    """``float(value)`` if it is a finite real number (not a bool) inside the bounds.

    ``strict_minimum`` / ``strict_maximum`` make a bound open (``> 0`` rather than ``>= 0``).
    Otherwise a one-line ValueError: ``{name} must be a finite number > 0{note}, got -0.001{fix}``.
    """
    valid = f"a finite number{_bounds(minimum, maximum, strict_minimum, strict_maximum, float)}{note}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be {valid}, got {value!r}{fix}")
    number = float(value)
    too_low = minimum is not None and (number <= minimum if strict_minimum else number < minimum)
    too_high = maximum is not None and (number >= maximum if strict_maximum else number > maximum)
    if not math.isfinite(number) or too_low or too_high:
        shown = value if type(value) in (int, float) else number  # not np.float64(...)
        raise ValueError(f"{name} must be {valid}, got {shown!r}{fix}")
    return number
