"""What callers pass, checked one way everywhere: an integer is an int (or numpy integer), never a bool; a flag
is a bool, never a string."""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np


def is_int(value: Any) -> bool:
    """An integer a caller meant as one: True and False are not (bool is an int subclass), floats are not."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_bool(name: str, value: Any, error: type[Exception] = ValueError) -> bool:
    """`value` as a bool, or `error` naming `name`: a string such as "no" or "false" is truthy, so only True and
    False (numpy's too) are taken, never a value whose truth would silently mean something else."""
    if not isinstance(value, (bool, np.bool_)):
        raise error(f"{name} must be True or False, got {value!r}")
    return bool(value)


def check_int(name: str, value: Any, low: int, high: int | None = None, error: type[Exception] = ValueError) -> int:
    """`value` as an int in [low, high] (high None: no upper bound), or `error` naming `name` and the value."""
    if not is_int(value) or value < low or (high is not None and value > high):
        raise error(f"{name} must be {_integers(low, high)}, got {value!r}")
    return int(value)


def _integers(low: int, high: int | None) -> str:
    if high is None and low in (0, 1):
        return "a positive integer" if low else "a non-negative integer"
    return f"an integer >= {low}" + (f" and <= {high}" if high is not None else "")
