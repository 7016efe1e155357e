"""The argument check the book's helpers share: a count of things.

>>> from sdpa_book.checks import check_count
>>> check_count(4, "block")
4
>>> check_count(0, "n_top", minimum=0)
0
>>> check_count(2.0, "block")
Traceback (most recent call last):
...
TypeError: block must be an int; got 2.0
"""

from __future__ import annotations

from numbers import Integral

import numpy as np

__all__ = ["check_count"]


def check_count(value, name: str, *, minimum: int = 1) -> int:
    """``value`` as an ``int`` of at least ``minimum``, or an error naming ``name``.

    Parameters
    ----------
    value : object
        What the caller passed: a Python or NumPy integer (not a bool).
    name : str
        The argument's name, for the message.
    minimum : int, default 1
        The smallest value allowed.

    Returns
    -------
    int

    Raises
    ------
    TypeError
        If ``value`` is not an integer: ``"{name} must be an int; got {value!r}"``.
    ValueError
        If it is below ``minimum``: ``"{name} must be at least {minimum}; got {value}"``.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be an int; got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}; got {value}")
    return int(value)
