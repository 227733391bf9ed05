"""Checks of user-given values: Python and numpy numbers alike, never a bool taken for a number or a
non-bool taken for a flag. Each failure is the given error class with the name, the value and what is
allowed."""
from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from .errors import GenerationError, RlxrtError


def as_int(value: Any, name: str, low: int | None = None, high: int | None = None,
           error: type[RlxrtError] = GenerationError) -> int:
    """``value`` as an int in ``low..high`` (either end may be open); numpy integers are accepted."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise error(f"{name} must be an integer{_range(low, high)}, got {value!r}")
    out = int(value)
    if (low is not None and out < low) or (high is not None and out > high):
        raise error(f"{name} must be an integer{_range(low, high)}, got {out}")
    return out


def as_float(value: Any, name: str, low: float | None = None, high: float | None = None,
             error: type[RlxrtError] = GenerationError) -> float:
    """``value`` as a finite float in ``[low, high]``; ints and numpy numbers are accepted."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise error(f"{name} must be a number{_range(low, high)}, got {value!r}")
    out = float(value)
    if not math.isfinite(out) or (low is not None and out < low) or (high is not None and out > high):
        raise error(f"{name} must be a finite number{_range(low, high)}, got {value!r}")
    return out


def as_bool(value: Any, name: str, error: type[RlxrtError] = GenerationError) -> bool:
    """``value`` as a bool: only True/False (numpy's too); 1, "no" or None are refused, not guessed."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise error(f"{name} must be True or False, got {value!r}")


def _range(low, high) -> str:
    if low is not None and high is not None:
        return f" in {low}..{high}"
    if low is not None:
        return f" >= {low}"
    if high is not None:
        return f" <= {high}"
    return ""
