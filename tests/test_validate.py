"""The one integer / number check of every setting: what passes, what fails, and the message."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from feature_extraction.validate import check_float, check_int


@pytest.mark.parametrize("value", [0, 1, 5, np.int64(3), np.int32(0)])
def test_int_in_range_passes_as_int(value: object) -> None:
    out = check_int("n", value, 0, 5)
    assert out == value and type(out) is int


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (True, "True"),
        (False, "False"),
        (1.0, "1.0"),
        ("3", "'3'"),
        (None, "None"),
        (math.nan, "nan"),
        (np.float64(2.0), "np.float64(2.0)"),
    ],
)
def test_int_rejects_bools_floats_strings(value: object, shown: str) -> None:
    with pytest.raises(ValueError, match=rf"^n must be an integer >= 0, got {re.escape(shown)}$"):
        check_int("n", value, 0)


@pytest.mark.parametrize(
    ("minimum", "maximum", "value", "message"),
    [
        (1, None, 0, "k must be an integer >= 1, got 0"),
        (None, 4, 5, "k must be an integer <= 4, got 5"),
        (1, 10, 11, "k must be an integer in [1, 10], got 11"),
        (1, 10, 0, "k must be an integer in [1, 10], got 0"),
        (0, None, -1, "k must be an integer >= 0, got -1"),
    ],
)
def test_int_bounds_are_closed(minimum: int | None, maximum: int | None, value: int, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        check_int("k", value, minimum, maximum)
    assert str(caught.value) == message
    if minimum is not None:
        assert check_int("k", minimum, minimum, maximum) == minimum  # the bound itself is valid
    if maximum is not None:
        assert check_int("k", maximum, minimum, maximum) == maximum


def test_int_note_and_fix_frame_the_value() -> None:
    with pytest.raises(ValueError) as caught:
        check_int("--tokens_per_image", 17, 1, 16, note=" (the 4x4 patches)", fix="; omit it")
    assert str(caught.value) == "--tokens_per_image must be an integer in [1, 16] (the 4x4 patches), got 17; omit it"
    assert check_int("any", -(10**20)) == -(10**20)  # no bounds: any integer


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, np.float32("nan"), np.float64("inf")])
def test_float_rejects_nan_and_infinities(value: object) -> None:
    with pytest.raises(ValueError, match=r"^model\.lr must be a finite number > 0, got (nan|inf|-inf)$"):
        check_float("model.lr", value, 0.0, strict_minimum=True)
    with pytest.raises(ValueError, match=r"^x must be a finite number, got "):
        check_float("x", value)  # not even without bounds


@pytest.mark.parametrize("value", [True, "0.1", None, [0.1]])
def test_float_rejects_non_numbers(value: object) -> None:
    with pytest.raises(ValueError, match=r"^x must be a finite number in \[0, 1\), got "):
        check_float("x", value, 0.0, 1.0, strict_maximum=True)


def test_float_open_and_closed_bounds() -> None:
    assert check_float("lr", 5e-4, 0.0, strict_minimum=True) == 5e-4
    with pytest.raises(ValueError) as caught:
        check_float("model.lr", -1e-3, 0.0, strict_minimum=True)
    assert str(caught.value) == "model.lr must be a finite number > 0, got -0.001"
    with pytest.raises(ValueError, match=r"^model\.lr must be a finite number > 0, got 0.0$"):
        check_float("model.lr", 0.0, 0.0, strict_minimum=True)  # open: the bound itself fails
    assert check_float("c", 0.0, 0.0) == 0.0  # closed: the bound itself passes
    assert check_float("m", 0.0, 0.0, 1.0, strict_maximum=True) == 0.0
    with pytest.raises(ValueError, match=r"^m must be a finite number in \[0, 1\), got 1$"):
        check_float("m", 1, 0.0, 1.0, strict_maximum=True)
    with pytest.raises(ValueError, match=r"^t must be a finite number in \(0, 768\], got 768.5$"):
        check_float("t", 768.5, 0.0, 768.0, strict_minimum=True)
    assert check_float("t", 768, 0.0, 768.0, strict_minimum=True) == 768.0
    with pytest.raises(ValueError, match=r"^p must be a finite number <= 1, got 2$"):
        check_float("p", 2, maximum=1.0)
    out = check_float("i", np.float32(0.5), 0.0, 1.0)
    assert out == 0.5 and type(out) is float
    with pytest.raises(ValueError, match=r"^s must be a finite number > 0, got -2.0$"):
        check_float("s", np.float64(-2.0), 0.0, strict_minimum=True)  # numpy values shown as plain numbers
