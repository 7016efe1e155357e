r"""ALiBi (Press et al. 2022): position as a linear penalty on the scores, one slope per head.

ALiBi adds no positional vectors at all. Each head ``h`` subtracts ``m_h`` times the distance
between query and key from the scaled scores, before the softmax:

.. math:: \text{scores}_{h,i,j} = \frac{q_i \cdot k_j}{\sqrt{Dk}} - m_h \, (i - j), \qquad j \le i.

The slopes ``m_h`` form a fixed geometric sequence, so some heads look far back and others
almost only at the latest tokens. The bias is an ordinary additive float mask: pass it to
:func:`~sdpa.scaled_dot_product_attention` as ``attn_mask``, together with ``is_causal=True``.

Shape letters: ``H`` heads, ``T`` queries, ``S`` keys.
"""

from __future__ import annotations

import numpy as np

from ._checks import check_alignment, check_nonneg_int
from .masks import alignment_offset

__all__ = ["alibi_bias", "alibi_slopes"]


def _geometric_slopes(n: int) -> np.ndarray:
    """``2 ** (-8 k / n)`` for ``k = 1, ..., n`` (the paper's sequence for ``n`` a power of two)."""
    k = np.arange(1, n + 1, dtype=np.float64)
    return np.exp2(-8.0 * k / n)


def alibi_slopes(n_heads: int) -> np.ndarray:
    r"""The ALiBi slope of each head: a geometric sequence from ``2**(-8/n)`` down to ``2**-8``.

    Parameters
    ----------
    n_heads : int
        Number of heads ``H``, at least 1.

    Returns
    -------
    slopes : (H,) np.ndarray of float64
        All in ``(0, 1)``. For ``H`` a power of two, ``slopes[h] = 2 ** (-8 (h + 1) / H)``.

    Raises
    ------
    TypeError
        If ``n_heads`` is not an integer.
    ValueError
        If ``n_heads`` is less than 1.

    Notes
    -----
    For a head count that is not a power of two, Press et al. take the ``P`` slopes of the
    largest power of two ``P < H``, then the first ``H - P`` slopes at odd positions
    (``k = 1, 3, 5, ...``) of the sequence for ``2P`` heads. On a log scale these lie halfway
    between the first ``P`` slopes, or half a step beyond the steepest, so the extra heads refine
    the steep (local) end; the gentlest slope stays ``2**-8``.

    Examples
    --------
    >>> from sdpa import alibi_slopes
    >>> alibi_slopes(8) * 256  # 1/2, 1/4, ..., 1/256
    array([128.,  64.,  32.,  16.,   8.,   4.,   2.,   1.])
    >>> import numpy as np
    >>> np.round(alibi_slopes(6), 4)  # the 4 slopes for H=4, then k = 1, 3 of H=8
    array([0.25  , 0.0625, 0.0156, 0.0039, 0.5   , 0.125 ])
    """
    n = check_nonneg_int(n_heads, "n_heads")
    if n < 1:
        raise ValueError(f"n_heads must be at least 1; got {n_heads!r}")
    p = 1 << (n.bit_length() - 1)  # largest power of two <= n
    slopes = _geometric_slopes(p)
    if p == n:
        return slopes
    extra = _geometric_slopes(2 * p)[0::2][: n - p]  # k = 1, 3, 5, ... of the 2P sequence
    return np.concatenate([slopes, extra])


def alibi_bias(n_heads: int, T: int, S: int, *, alignment: str = "top_left") -> np.ndarray:
    r"""The additive ALiBi bias ``-slope_h * |j - (i + o)|``, shaped ``(H, T, S)`` for ``attn_mask``.

    Parameters
    ----------
    n_heads : int
        Number of heads ``H`` (slopes from :func:`alibi_slopes`).
    T, S : int
        Number of queries and keys.
    alignment : {"top_left", "bottom_right"}, default "top_left"
        Where query ``i`` sits among the keys, as for causal masks: at key position ``i``
        (``o = 0``, training on a whole sequence, ``T == S``) or at ``i + S - T``
        (``o = S - T``: the ``T`` new queries are the last tokens, as when decoding against a
        KV cache). Use the same alignment for ``is_causal``.

    Returns
    -------
    bias : (H, T, S) np.ndarray of float64
        ``bias[h, i, j] = -slopes[h] * |j - (i + o)|``: zero on the query's own position and
        more negative with distance. It broadcasts against scores ``(B, H, T, S)``.

    Raises
    ------
    TypeError
        If ``n_heads``, ``T`` or ``S`` is not an integer.
    ValueError
        If ``n_heads < 1``, ``T`` or ``S`` is negative, or ``alignment`` is unknown.

    Notes
    -----
    Press et al. define the bias for causal attention only (keys ``j <= i + o``), where it is
    ``-slope * (i + o - j)``; combine it with ``is_causal=True`` (and the same alignment) to get
    exactly that. Future keys get the penalty of their absolute distance, so without a causal
    mask the bias is symmetric about the query's position rather than rewarding future keys.

    Softmax ignores a constant added to a whole row, so under a causal mask the bias equals
    ``slope * j`` up to a per-row constant; some implementations (BLOOM's, for instance) add
    that simpler form.

    Examples
    --------
    >>> from sdpa import alibi_bias
    >>> bias = alibi_bias(2, 3, 3)  # slopes 1/16 and 1/256
    >>> bias.shape
    (2, 3, 3)
    >>> bias[0] * 16  # head 0: minus the distance |i - j|, times 1/16
    array([[ 0., -1., -2.],
           [-1.,  0., -1.],
           [-2., -1.,  0.]])
    >>> alibi_bias(1, 2, 4, alignment="bottom_right")[0] * 256  # 2 new queries at positions 2, 3
    array([[-2., -1.,  0., -1.],
           [-3., -2., -1.,  0.]])
    """
    slopes = alibi_slopes(n_heads)
    T = check_nonneg_int(T, "T")
    S = check_nonneg_int(S, "S")
    alignment = check_alignment(alignment, "alignment")
    offset = alignment_offset(T, S, alignment)
    distance = np.abs(np.arange(S)[None, :] - (np.arange(T)[:, None] + offset))  # (T, S)
    return slopes[:, None, None] * -distance  # (H, 1, 1) * (T, S) -> (H, T, S)
