"""Predicates for the input checks of the API and the CLI, in one place so every check agrees on
what a number is: a bool is never one."""

from __future__ import annotations

import math
import numbers
import operator


def as_int(x) -> int | None:
    """x as a Python int when it is an integer scalar (Python, NumPy or a 0-d JAX array; not a
    bool), else None. For values used at run time (a seed, a count)."""
    if isinstance(x, bool) or getattr(x, "dtype", None) == bool:
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


def is_int_at_least(x, minimum: int) -> bool:
    """A Python or NumPy int >= minimum: what a static (hashed, compile-time) argument may be."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= minimum


def is_real(x) -> bool:
    """A finite Python or NumPy real number (not a bool)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)
