"""Positional information: the sinusoidal table of "Attention Is All You Need" (section 3.5).

Attention itself is blind to order: permuting the keys and values together permutes nothing in
the output. Position has to be written into the inputs, and the 2017 paper adds a fixed table
of sines and cosines to the token embeddings.
"""

from __future__ import annotations

import math

import numpy as np

from ._checks import check_nonneg_int, check_real

__all__ = ["sinusoidal_positional_encoding"]


def sinusoidal_positional_encoding(
    n_positions: int, d_model: int, *, base: float = 10000.0
) -> np.ndarray:
    r"""The sinusoidal positional-encoding table of Vaswani et al. (2017), section 3.5.

    .. math:: PE_{p, 2i} = \sin(p / \text{base}^{2i/d}), \qquad
              PE_{p, 2i+1} = \cos(p / \text{base}^{2i/d})

    Parameters
    ----------
    n_positions : int
        Number of positions ``p = 0, ..., n_positions - 1``.
    d_model : int
        Width ``d`` of the encoding. An odd width ends with a sine column.
    base : float, default 10000.0
        Sets the longest wavelength, ``2 pi base``.

    Returns
    -------
    pe : (n_positions, d_model) np.ndarray of float64
        Every entry lies in ``[-1, 1]``; each (sin, cos) column pair has norm 1 per row.

    Raises
    ------
    TypeError
        If ``n_positions`` or ``d_model`` is not an integer, or ``base`` is not a real number.
    ValueError
        If a size is negative or ``base`` is not a finite number greater than 1.

    Notes
    -----
    Pair ``i`` rotates with angular frequency :math:`\omega_i = \text{base}^{-2i/d}`, so the
    encoding of position ``p + k`` is a fixed rotation of that of position ``p``: a linear map
    that depends on the offset ``k`` alone, which is what lets attention learn relative
    positions.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa import sinusoidal_positional_encoding
    >>> pe = sinusoidal_positional_encoding(5, 8)
    >>> pe.shape
    (5, 8)
    >>> np.round(pe[1, :4], 4)  # position 1: sin(1), cos(1), sin(0.1), cos(0.1)
    array([0.8415, 0.5403, 0.0998, 0.995 ])
    """
    n_positions = check_nonneg_int(n_positions, "n_positions")
    d_model = check_nonneg_int(d_model, "d_model")
    base = check_real(
        base, "base", "a finite real number greater than 1", lambda x: math.isfinite(x) and x > 1
    )
    positions = np.arange(n_positions, dtype=np.float64)[:, None]  # (P, 1)
    freqs = float(base) ** (-np.arange(0, d_model, 2, dtype=np.float64) / d_model)  # (ceil(d/2),)
    angles = positions * freqs  # (P, ceil(d/2))
    pe = np.empty((n_positions, d_model), dtype=np.float64)
    pe[:, 0::2] = np.sin(angles)
    pe[:, 1::2] = np.cos(angles[:, : d_model // 2])
    return pe
