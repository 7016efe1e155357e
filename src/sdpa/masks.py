"""Boolean attention masks (``True`` = may attend) and the band geometry behind them.

Causal and sliding-window masks are bands in the ``(T, S)`` score matrix. With the
*alignment offset* ``o`` (``0`` for ``"top_left"``, ``S - T`` for ``"bottom_right"``), query
``i`` may attend key ``j`` when

* causal: ``j <= i + o``;
* window ``(left, right)``: ``i + o - left <= j <= i + o + right``.

``"top_left"`` is PyTorch's ``is_causal`` convention, ``tril(ones(T, S), 0)``;
``"bottom_right"`` aligns the last query with the last key, ``tril(ones(T, S), S - T)``,
which is what decoding with a KV cache needs (the new queries are the last ``T`` positions).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from ._checks import as_array, check_alignment, check_nonneg_int, check_window

__all__ = ["causal_mask", "padding_mask", "sliding_window_mask"]


def alignment_offset(T: int, S: int, alignment: str) -> int:
    """The diagonal offset ``o``: query ``i`` sits at key position ``i + o``."""
    return 0 if alignment == "top_left" else S - T


def band_limits(
    is_causal: bool, window: tuple[int | None, int | None] | None
) -> tuple[int | None, int | None]:
    """``(lo, hi)``: query ``i`` may attend ``i + o + lo <= j <= i + o + hi`` (None: unbounded)."""
    lo = hi = None
    if window is not None:
        left, right = window
        lo = None if left is None else -left
        hi = right
    if is_causal:
        hi = 0 if hi is None else min(hi, 0)
    return lo, hi


def band_mask(
    rows: np.ndarray, cols: np.ndarray, offset: int, lo: int | None, hi: int | None
) -> np.ndarray | None:
    """Boolean ``(len(rows), len(cols))`` band for query indices ``rows`` and key indices ``cols``.

    Returns None when the band is unbounded on both sides (everything allowed).
    """
    if lo is None and hi is None:
        return None
    diff = cols[None, :] - (rows[:, None] + offset)  # (T, S): j - (i + o)
    allowed = np.ones(diff.shape, dtype=bool)
    if lo is not None:
        allowed &= diff >= lo
    if hi is not None:
        allowed &= diff <= hi
    return allowed


def causal_mask(T: int, S: int | None = None, *, alignment: str = "top_left") -> np.ndarray:
    """Boolean causal mask of shape ``(T, S)``: ``True`` where query ``i`` may attend key ``j``.

    Parameters
    ----------
    T : int
        Number of queries.
    S : int, optional
        Number of keys; defaults to ``T``.
    alignment : {"top_left", "bottom_right"}, default "top_left"
        ``"top_left"`` gives ``tril(ones(T, S), 0)`` (PyTorch's ``is_causal``);
        ``"bottom_right"`` gives ``tril(ones(T, S), S - T)`` (the KV-cache convention).

    Returns
    -------
    mask : (T, S) np.ndarray of bool

    Raises
    ------
    TypeError
        If ``T`` or ``S`` is not an integer.
    ValueError
        If ``T`` or ``S`` is negative, or ``alignment`` is unknown.

    Examples
    --------
    >>> from sdpa import causal_mask
    >>> causal_mask(3).astype(int)
    array([[1, 0, 0],
           [1, 1, 0],
           [1, 1, 1]])
    >>> causal_mask(2, 4, alignment="bottom_right").astype(int)  # 2 new queries, 4 cached keys
    array([[1, 1, 1, 0],
           [1, 1, 1, 1]])
    """
    T = check_nonneg_int(T, "T")
    S = T if S is None else check_nonneg_int(S, "S")
    alignment = check_alignment(alignment, "alignment")
    lo, hi = band_limits(True, None)
    return band_mask(np.arange(T), np.arange(S), alignment_offset(T, S, alignment), lo, hi)


def sliding_window_mask(
    T: int, S: int, window: tuple[int | None, int | None], *, alignment: str = "top_left"
) -> np.ndarray:
    """Boolean band mask: query ``i`` may attend keys ``i + o - left <= j <= i + o + right``.

    Parameters
    ----------
    T, S : int
        Number of queries and keys.
    window : (left, right)
        Non-negative integers, or None for no limit on that side. ``(w - 1, 0)`` is the
        causal sliding window of width ``w`` used by Mistral and Longformer-style models.
    alignment : {"top_left", "bottom_right"}, default "top_left"
        Where query ``i`` sits among the keys: ``o = 0`` or ``o = S - T``.

    Returns
    -------
    mask : (T, S) np.ndarray of bool

    Raises
    ------
    TypeError
        If ``T`` or ``S`` is not an integer.
    ValueError
        If ``T`` or ``S`` is negative, ``window`` is not a pair of non-negative integers or
        None, or ``alignment`` is unknown.

    Examples
    --------
    >>> from sdpa import sliding_window_mask
    >>> sliding_window_mask(4, 4, (1, 0)).astype(int)  # self and one token back
    array([[1, 0, 0, 0],
           [1, 1, 0, 0],
           [0, 1, 1, 0],
           [0, 0, 1, 1]])
    """
    T = check_nonneg_int(T, "T")
    S = check_nonneg_int(S, "S")
    window = check_window(window)
    if window is None:
        raise ValueError("window must be a pair (left, right); got None")
    alignment = check_alignment(alignment, "alignment")
    lo, hi = band_limits(False, window)
    mask = band_mask(np.arange(T), np.arange(S), alignment_offset(T, S, alignment), lo, hi)
    return np.ones((T, S), dtype=bool) if mask is None else mask


def padding_mask(lengths: ArrayLike, S: int) -> np.ndarray:
    """Boolean key-padding mask of shape ``(B, 1, 1, S)``: key ``j`` of sequence ``b`` is real
    when ``j < lengths[b]``.

    The shape broadcasts against scores ``(B, H, T, S)``, so it can be passed straight to
    :func:`scaled_dot_product_attention` as ``attn_mask``.

    Parameters
    ----------
    lengths : (B,) array_like of int
        Number of real (non-padding) tokens in each sequence, each in ``[0, S]``.
    S : int
        Padded key length.

    Returns
    -------
    mask : (B, 1, 1, S) np.ndarray of bool

    Raises
    ------
    TypeError
        If ``lengths`` is not an integer array or ``S`` is not an integer.
    ValueError
        If ``lengths`` is not 1-D or has entries outside ``[0, S]``.

    Examples
    --------
    >>> from sdpa import padding_mask
    >>> m = padding_mask([3, 1], 4)
    >>> m.shape
    (2, 1, 1, 4)
    >>> m[:, 0, 0].astype(int)
    array([[1, 1, 1, 0],
           [1, 0, 0, 0]])
    """
    S = check_nonneg_int(S, "S")
    lengths = as_array(lengths, "lengths", masked_hint="pass a plain array of lengths")
    if lengths.dtype.kind not in "iu":
        raise TypeError(f"lengths must be an array of integers; got dtype {lengths.dtype}")
    if lengths.ndim != 1:
        raise ValueError(f"lengths must be 1-D with one length per sequence; got shape {lengths.shape}")
    if lengths.size and (lengths.min() < 0 or lengths.max() > S):
        raise ValueError(f"lengths must lie in [0, S={S}]; got {lengths.tolist()}")
    mask = np.arange(S)[None, :] < lengths[:, None]  # (B, S)
    return mask[:, None, None, :]
