r"""Rotary position embeddings (RoPE, Su et al. 2021): position as a rotation of query/key pairs.

RoPE splits the ``Dk`` features of every query and key into ``Dk / 2`` pairs and rotates pair
``i`` of the vector at position ``m`` by the angle :math:`m \theta_i`, with the frequencies
:math:`\theta_i = \text{base}^{-2i / Dk}`. Rotations preserve lengths, and the rotation at ``m``
followed by the inverse rotation at ``n`` is the rotation at ``m - n``, so

.. math:: \langle R_m q, R_n k \rangle = \langle q, R_{n - m} k \rangle

depends on the positions only through their offset. Attention scores become functions of
*relative* position while each vector is rotated on its own, which is why RoPE fits a KV cache:
a cached key, once rotated, never needs to change.

Two layouts of the pairs are in use, and they differ only by a fixed permutation of features:

* **halves** (``interleaved=False``; GPT-NeoX and the Hugging Face ``rotate_half`` code used for
  LLaMA-family models): pair ``i`` is ``(x[i], x[i + Dk/2])``;
* **interleaved** (``interleaved=True``; the RoFormer paper, GPT-J, and Meta's reference LLaMA
  code, which views adjacent features as one complex number): pair ``i`` is
  ``(x[2i], x[2i + 1])``.

Shape letters: ``T`` positions (queries or keys), ``Dk`` features per head.
"""

from __future__ import annotations

import math
from numbers import Real

import numpy as np
from numpy.typing import ArrayLike

from ._checks import as_array, as_float_array, check_bool, check_nonneg_int, compute_dtype

__all__ = ["apply_rotary_embedding", "rotary_cos_sin"]


def _check_base(base) -> float:
    if isinstance(base, (bool, np.bool_)) or not isinstance(base, Real):
        raise TypeError(f"base must be a real number; got {base!r}")
    if not (math.isfinite(base) and base > 1):
        raise ValueError(f"base must be a finite number greater than 1; got {base!r}")
    return float(base)


def _check_positions(positions: ArrayLike) -> np.ndarray:
    """Positions as a float64 array (ints or floats, finite); bool and complex are refused."""
    pos = as_array(positions, "positions", masked_hint="pass a plain array of positions")
    if pos.dtype.kind not in "iuf":
        raise TypeError(
            f"positions must be an array of integers or real numbers; got dtype {pos.dtype}"
        )
    pos = pos.astype(np.float64)
    if not np.all(np.isfinite(pos)):
        raise ValueError("positions must be finite; got NaN or inf")
    return pos


def rotary_cos_sin(
    positions: ArrayLike, dim: int, *, base: float = 10000.0
) -> tuple[np.ndarray, np.ndarray]:
    r"""The cosine and sine tables of RoPE: ``cos(p * theta_i)`` and ``sin(p * theta_i)``.

    Parameters
    ----------
    positions : (..., T) array_like of int or float
        Positions ``p`` (token indices; floats allow scaled positions).
    dim : int
        Even feature width ``Dk`` of the vectors to rotate; there are ``Dk / 2`` frequencies.
    base : float, default 10000.0
        Sets the slowest frequency, :math:`\theta_{Dk/2 - 1} = \text{base}^{-(Dk - 2)/Dk}`.

    Returns
    -------
    cos, sin : (..., T, Dk / 2) np.ndarray of float64
        Entry ``[..., t, i]`` is the cosine (sine) of ``positions[..., t] * theta_i`` with
        :math:`\theta_i = \text{base}^{-2i/Dk}`, one column per pair.

    Raises
    ------
    TypeError
        If ``dim`` is not an integer, ``base`` is not a real number, or ``positions`` is not
        an integer or real array.
    ValueError
        If ``dim`` is negative or odd, ``base`` is not greater than 1, or a position is not
        finite.

    Notes
    -----
    Angles are computed in float64 whatever the dtype of the vectors: at position 10^5 the
    fastest pair has turned through 10^5 radians, and a float32 product could be off by up to
    about 0.004 rad. Model code that caches these tables per layer computes the same thing.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa import rotary_cos_sin
    >>> cos, sin = rotary_cos_sin(np.arange(3), 4)  # theta = (1, 1/100)
    >>> cos.shape
    (3, 2)
    >>> np.round(sin, 4)  # sin(p), sin(p / 100) for p = 0, 1, 2
    array([[0.    , 0.    ],
           [0.8415, 0.01  ],
           [0.9093, 0.02  ]])
    """
    dim = check_nonneg_int(dim, "dim")
    if dim % 2:
        raise ValueError(f"dim must be even (features rotate in pairs); got dim={dim}")
    base = _check_base(base)
    pos = _check_positions(positions)
    theta = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)  # (Dk/2,)
    angles = pos[..., None] * theta  # (..., T, 1) * (Dk/2,) -> (..., T, Dk/2)
    return np.cos(angles), np.sin(angles)


def apply_rotary_embedding(
    x: ArrayLike,
    positions: ArrayLike | None = None,
    *,
    base: float = 10000.0,
    interleaved: bool = False,
) -> np.ndarray:
    r"""Rotate each feature pair of ``x`` by its position times the pair's frequency (RoPE).

    Apply it to queries and keys (not values) after the head split and before the scores:
    ``scores = rope(q) @ rope(k).T`` then depend on positions only through ``m - n``.

    Parameters
    ----------
    x : (..., T, Dk) array_like
        Queries or keys, one row per position; ``Dk`` must be even.
    positions : (..., T) array_like of int or float, optional
        Position of each row, broadcastable to ``x.shape[:-1]``; default ``arange(T)``. Pass
        ``arange(start, start + T)`` for new tokens appended to a KV cache of length ``start``,
        per-sequence positions ``(B, 1, T)`` for left-padded batches, or scaled floats.
    base : float, default 10000.0
        Frequencies are :math:`\theta_i = \text{base}^{-2i/Dk}`, ``i = 0, ..., Dk/2 - 1``.
    interleaved : bool, default False
        ``False``: pair ``i`` is features ``(i, i + Dk/2)``, the rotate-half layout of GPT-NeoX
        and the Hugging Face LLaMA code. ``True``: pair ``i`` is features ``(2i, 2i + 1)``, the
        layout of the RoFormer paper, GPT-J and Meta's reference LLaMA code.

    Returns
    -------
    out : (..., T, Dk) np.ndarray
        Same shape and floating dtype as ``x`` (integer and bool inputs give float64).

    Raises
    ------
    TypeError
        If ``x`` is complex or non-numeric, ``positions`` is not an integer or real array,
        ``base`` is not a real number, or ``interleaved`` is not a bool.
    ValueError
        If ``x`` has fewer than two dimensions or an odd last dimension, ``positions`` does
        not broadcast to ``x.shape[:-1]`` or is not finite, or ``base`` is not greater than 1.

    Notes
    -----
    For pair ``(a, b)`` at position ``p`` and angle :math:`\phi = p\,\theta_i`:

    .. math:: (a, b) \mapsto (a \cos\phi - b \sin\phi,\; a \sin\phi + b \cos\phi).

    This is multiplication of the complex number ``a + ib`` by :math:`e^{i\phi}`. The two
    layouts are the same map conjugated by a permutation: if ``perm`` lists the halves layout
    in pair order, ``perm = [0, Dk/2, 1, Dk/2 + 1, ...]``, then
    ``rope(x, interleaved=False)[..., perm] == rope(x[..., perm], interleaved=True)``. A model
    trained with one layout runs with the other after permuting the output features of each
    head in ``W_q`` and ``W_k`` (Hugging Face's LLaMA conversion script does this).

    **Dtypes.** Angles, cosines and sines are computed in float64 (see :func:`rotary_cos_sin`)
    and cast to the working dtype; float16 is computed in float32 and returned as float16.
    The input is never modified.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa import apply_rotary_embedding
    >>> x = np.array([[1.0, 0.0]] * 3)  # (T=3, Dk=2): one pair, frequency 1
    >>> np.round(apply_rotary_embedding(x), 3)  # (cos p, sin p) for p = 0, 1, 2
    array([[ 1.   ,  0.   ],
           [ 0.54 ,  0.841],
           [-0.416,  0.909]])
    >>> rng = np.random.default_rng(0)
    >>> q, k = rng.normal(size=(2, 8))  # the same q and k placed at positions (m, n)
    >>> def score(m, n):
    ...     qm = apply_rotary_embedding(q[None], [m])[0]
    ...     kn = apply_rotary_embedding(k[None], [n])[0]
    ...     return float(qm @ kn)
    >>> round(score(5, 2), 6) == round(score(105, 102), 6)  # only m - n matters
    True
    """
    arr = as_float_array(x, "x")
    if arr.ndim < 2:
        raise ValueError(
            f"x must have shape (..., T, Dk) with at least 2 dimensions; got x.shape={arr.shape}"
        )
    T, D = arr.shape[-2], arr.shape[-1]
    if D % 2:
        raise ValueError(
            f"the last dimension Dk of x must be even (features rotate in pairs); got x.shape={arr.shape}"
        )
    check_bool(interleaved, "interleaved")
    if positions is None:
        positions = np.arange(T)
    else:
        pos = as_array(positions, "positions", masked_hint="pass a plain array of positions")
        try:
            fits = np.broadcast_shapes(pos.shape, arr.shape[:-1]) == arr.shape[:-1]
        except ValueError:
            fits = False
        if not fits:
            raise ValueError(
                f"positions must broadcast to x.shape[:-1]={arr.shape[:-1]} (..., T); "
                f"got positions.shape={pos.shape}"
            )
    cos, sin = rotary_cos_sin(positions, D, base=base)  # (..., T, Dk/2) float64
    _, work = compute_dtype(arr)
    cos = cos.astype(work)
    sin = sin.astype(work)
    xw = arr.astype(work, copy=False)
    half = D // 2
    if interleaved:
        a, b = xw[..., 0::2], xw[..., 1::2]  # (..., T, Dk/2) each: pair i = (x[2i], x[2i+1])
    else:
        a, b = xw[..., :half], xw[..., half:]  # pair i = (x[i], x[i + Dk/2])
    a_rot = a * cos - b * sin
    b_rot = a * sin + b * cos
    out = np.empty(arr.shape, dtype=work)
    if interleaved:
        out[..., 0::2], out[..., 1::2] = a_rot, b_rot
    else:
        out[..., :half], out[..., half:] = a_rot, b_rot
    return out.astype(arr.dtype, copy=False)
