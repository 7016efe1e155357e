"""Quantised keys and values: integer codes with a scale and a zero point per group of numbers.

The page *Quantised KV caches* (``book/measured/quantised-kv-cache.md``) stores the keys and
values of the book's trained model in a few bits each and measures what that costs. This module
holds the arithmetic, asymmetric min-max quantisation: every group of numbers gets its own
zero point ``zero`` (the group's minimum) and step ``scale`` (its range over ``2**bits - 1``),
and each number becomes the integer code of the nearest point of the grid
``zero + scale * [0, 1, ..., 2**bits - 1]``.

Which numbers share a group is the choice the page studies. Keys and values are ``(..., T, D)``
arrays (tokens on the second axis from the end, channels on the last):

* ``per="channel"``: one scale and zero point per channel, from the statistics of that channel
  along the tokens (in groups of ``group_size`` consecutive tokens, default all ``T``);
* ``per="token"``: one scale and zero point per token, from its channels (in groups of
  ``group_size`` consecutive channels, default all ``D``).

Codes of fewer than 8 bits are packed, group by group, into whole bytes (two 4-bit codes per
byte), and :attr:`Quantised.nbytes` counts those bytes *and* the scales and zero points, so the
memory per token it reports is what a cache would hold.

Shape letters: ``T`` tokens, ``D`` channels (``Dk`` for keys, ``Dv`` for values).
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["Quantised", "dequantise", "fake_quantise", "quantise"]

PER = ("channel", "token")
SCALE_DTYPES = (np.float16, np.float32, np.float64)


@dataclass(frozen=True)
class Quantised:
    """An array stored as packed integer codes with a scale and a zero point per group.

    Made by :func:`quantise`; :func:`dequantise` turns it back into numbers.

    Attributes
    ----------
    packed : np.ndarray of uint8
        The codes, ``bits`` per number, packed into whole bytes group by group: for
        ``per="token"`` shape ``(..., T, D // group_size, nbytes_per_group)``, for
        ``per="channel"`` shape ``(..., D, T // group_size, nbytes_per_group)``, with
        ``nbytes_per_group = ceil(group_size * bits / 8)``. The first code of a byte sits in
        its highest bits.
    scale : np.ndarray
        The step of each group's grid, of dtype ``scale_dtype``: ``(..., T // group_size, D)``
        for ``per="channel"``, ``(..., T, D // group_size)`` for ``per="token"``.
    zero : np.ndarray
        The number code 0 stands for in each group (at most the group's minimum), shaped
        like ``scale``.
    bits : int
        Bits per code, 1 to 8.
    per : {"channel", "token"}
        Whether a scale belongs to a channel or to a token.
    group_size : int
        How many numbers share a scale, along the tokens (``per="channel"``) or the channels
        (``per="token"``).
    shape : tuple of int
        The shape of the array that was quantised, ``(..., T, D)``.
    dtype : np.dtype
        Its floating dtype, which :func:`dequantise` returns.
    """

    packed: np.ndarray
    scale: np.ndarray
    zero: np.ndarray
    bits: int
    per: str
    group_size: int
    shape: tuple
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        """Bytes stored: the packed codes, the scales and the zero points."""
        return int(self.packed.nbytes + self.scale.nbytes + self.zero.nbytes)

    def codes(self) -> np.ndarray:
        """The integer codes, unpacked, in the shape of the quantised array (uint8)."""
        grouped = _unpack(self.packed, self.bits, self.group_size)  # (..., A, n, g)
        return _ungrouped(grouped, self.per)


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """``(..., g)`` codes below ``2**bits`` -> ``(..., ceil(g bits / 8))`` bytes.

    The codes are one stream of bits, each code's most significant bit first, cut into bytes
    (the last padded with zeros). When whole codes fill each byte (``bits`` divides 8 and the
    group fills whole bytes) shifts do it directly; otherwise NumPy's bit (un)packing.
    """
    g = codes.shape[-1]
    per_byte = 8 // bits
    if 8 % bits == 0 and g % per_byte == 0:
        lanes = codes.reshape(*codes.shape[:-1], g // per_byte, per_byte)
        packed = np.zeros(lanes.shape[:-1], dtype=np.uint8)
        for j in range(per_byte):  # the first code of a byte in its highest bits
            packed |= lanes[..., j] << (8 - bits * (j + 1))
        return packed
    stream = np.unpackbits(codes[..., None], axis=-1)[..., 8 - bits :]  # (..., g, bits)
    return np.packbits(stream.reshape(*codes.shape[:-1], g * bits), axis=-1)


def _unpack(packed: np.ndarray, bits: int, g: int) -> np.ndarray:
    """The inverse of :func:`_pack`: ``(..., nbytes)`` -> ``(..., g)`` codes (uint8)."""
    per_byte = 8 // bits
    if 8 % bits == 0 and g % per_byte == 0:
        mask = (1 << bits) - 1
        lanes = [(packed >> (8 - bits * (j + 1))) & mask for j in range(per_byte)]
        return np.stack(lanes, axis=-1).reshape(*packed.shape[:-1], g)
    stream = np.unpackbits(packed, axis=-1, count=g * bits)  # (..., g * bits)
    stream = stream.reshape(*packed.shape[:-1], g, bits)
    return np.packbits(stream, axis=-1)[..., 0] >> (8 - bits)  # bits, then zeros: shift back


def _grouped(x: np.ndarray, per: str, group_size: int) -> np.ndarray:
    """``(..., T, D)`` -> ``(..., A, n, group_size)``: each group of one scale on the last axis.

    ``per="token"``: ``A = T`` and ``n = D // group_size``; ``per="channel"``: ``A = D`` and
    ``n = T // group_size`` (the tokens of a channel are made the last axis first).
    """
    rows = x if per == "token" else np.swapaxes(x, -1, -2)  # (..., A, L), L quantised
    return rows.reshape(*rows.shape[:-1], rows.shape[-1] // group_size, group_size)


def _ungrouped(grouped: np.ndarray, per: str) -> np.ndarray:
    """The inverse of :func:`_grouped`: ``(..., A, n, group_size)`` -> ``(..., T, D)``."""
    rows = grouped.reshape(*grouped.shape[:-2], -1)  # (..., A, L)
    return rows if per == "token" else np.swapaxes(rows, -1, -2)


def _stats_layout(stats: np.ndarray, per: str) -> np.ndarray:
    """Per-group statistics ``(..., A, n)`` in the documented layout of ``scale``."""
    return stats if per == "token" else np.swapaxes(stats, -1, -2)


def _grouped_stats(stats: np.ndarray, per: str) -> np.ndarray:
    """``scale`` or ``zero`` in the documented layout -> ``(..., A, n, 1)``."""
    return (stats if per == "token" else np.swapaxes(stats, -1, -2))[..., None]


def _rounded(value: np.ndarray, dtype, *, up: bool) -> np.ndarray:
    """``value`` (float64) in ``dtype``, rounded up or down rather than to the nearest."""
    out = value.astype(dtype)
    wrong = out.astype(np.float64) < value if up else out.astype(np.float64) > value
    toward = np.array(np.inf if up else -np.inf, dtype=dtype)
    return np.where(wrong, np.nextafter(out, toward), out)


def _check_array(x: ArrayLike) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype == bool or not (
        np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)
    ):
        raise TypeError(f"x must be an array of real numbers; got dtype {arr.dtype}")
    if arr.ndim < 2:
        raise ValueError(f"x must be (..., T, D), at least 2-D; got x.shape={arr.shape}")
    if arr.size == 0:
        raise ValueError(f"x must not be empty; got x.shape={arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError("x must hold only finite numbers; got inf or nan")
    return arr if np.issubdtype(arr.dtype, np.floating) else arr.astype(np.float64)


def _check_options(bits, per, group_size, scale_dtype, shape) -> tuple[int, str, int, np.dtype]:
    if isinstance(bits, (bool, np.bool_)) or not isinstance(bits, Integral):
        raise TypeError(f"bits must be an int; got {bits!r}")
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be from 1 to 8; got {bits}")
    if per not in PER:
        raise ValueError(f"per must be 'channel' or 'token'; got {per!r}")
    length = shape[-2] if per == "channel" else shape[-1]
    axis = "tokens T" if per == "channel" else "channels D"
    if group_size is None:
        group_size = length
    elif isinstance(group_size, (bool, np.bool_)) or not isinstance(group_size, Integral):
        raise TypeError(f"group_size must be an int or None; got {group_size!r}")
    if group_size < 1 or length % group_size:
        raise ValueError(
            f"group_size must be a positive divisor of the {axis} = {length} of x with "
            f"per={per!r}; got group_size={group_size}, x.shape={shape}"
        )
    try:
        dtype = np.dtype(scale_dtype)
    except TypeError:
        dtype = None
    if dtype is None or dtype.type not in SCALE_DTYPES:
        raise TypeError(f"scale_dtype must be float16, float32 or float64; got {scale_dtype!r}")
    return int(bits), per, int(group_size), dtype


def quantise(
    x: ArrayLike,
    bits: int,
    *,
    per: str,
    group_size: int | None = None,
    scale_dtype=np.float16,
) -> Quantised:
    r"""Asymmetric min-max quantisation of ``x`` to ``bits``-bit codes, a scale per group.

    Parameters
    ----------
    x : (..., T, D) array_like
        Real numbers, tokens on the second axis from the end and channels on the last (keys
        or values ``(B, Hkv, T, Dk)``). Integers are read as float64.
    bits : int
        Bits per code, 1 to 8: ``2**bits`` grid points per group.
    per : {"channel", "token"}
        ``"channel"``: one scale and zero point per channel, from its numbers along the tokens;
        ``"token"``: one per token, from its numbers along the channels.
    group_size : int, optional
        Numbers per scale along the quantised axis (tokens for ``"channel"``, channels for
        ``"token"``); a divisor of that axis' length. Default: the whole axis.
    scale_dtype : {np.float16, np.float32, np.float64}, default np.float16
        How the scales and zero points are stored (and counted in :attr:`Quantised.nbytes`).

    Returns
    -------
    Quantised
        The packed codes, the scales and zero points, and what :func:`dequantise` needs.

    Raises
    ------
    TypeError
        If ``x`` is not real, ``bits`` or ``group_size`` is not an int, or ``scale_dtype`` is
        not one of the three float dtypes.
    ValueError
        If ``x`` has fewer than two dimensions, is empty or not finite, or its magnitude does
        not fit ``scale_dtype``; if ``bits`` is outside 1 to 8, ``per`` is not one of the two
        choices, or ``group_size`` does not divide the quantised axis.

    Notes
    -----
    For a group with minimum :math:`m` and maximum :math:`M`, and :math:`q_{\max} = 2^b - 1`:

    .. math::

        z = m, \qquad s = (M - m) / q_{\max}, \qquad
        \text{code}(x) = \operatorname{round}\bigl((x - z) / s\bigr) \in \{0, \dots, q_{\max}\},

    (halves rounded to even, as :func:`numpy.rint` does), and :func:`dequantise` returns
    :math:`z + s \cdot \text{code}`. The zero point is a number
    (the value code 0 stands for), as in KIVI, rather than an integer code; the two
    conventions differ only in how :math:`z` is rounded. Stored in ``scale_dtype``, :math:`z`
    is rounded down and :math:`s` up, so the grid still covers :math:`[m, M]` and every number
    comes back within half a step, :math:`s / 2`; a number on the grid comes back exactly
    (up to the rounding of the dequantised dtype). A group of equal numbers gets
    :math:`s = 0` when its value is stored exactly.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa_book.pages.kv_quant import dequantise, quantise
    >>> k = np.array([[0.0, 10.0, 1.0],    # (T=4, D=3): channel 1 is ten times larger
    ...               [1.0, 30.0, 2.0],
    ...               [2.0, 50.0, 0.0],
    ...               [3.0, 70.0, 3.0]])
    >>> by_channel = quantise(k, bits=2, per="channel")     # each channel on its own grid
    >>> by_channel.codes()[:, 1], by_channel.scale          # scale (T // T, D)
    (array([0, 1, 2, 3], dtype=uint8), array([[ 1., 20.,  1.]], dtype=float16))
    >>> float(np.abs(dequantise(by_channel) - k).max())     # every number on its grid
    0.0
    >>> by_token = quantise(k, bits=2, per="token")         # the large channel sets the step
    >>> np.round(np.abs(dequantise(by_token) - k).max(axis=0), 2)   # errors per channel
    array([2.  , 0.03, 1.  ])
    >>> # codes: 4 bytes (one per token) and 3 (one per channel); 4 bytes more per group for
    >>> # its float16 scale and zero point
    >>> by_token.nbytes, by_channel.nbytes
    (20, 15)
    """
    arr = _check_array(x)
    bits, per, group_size, dtype = _check_options(bits, per, group_size, scale_dtype, arr.shape)
    limit = np.finfo(dtype).max / 4  # the range over one step must stay finite in dtype
    if np.abs(arr).max() > limit:
        raise ValueError(
            f"x must have magnitudes of at most {limit:.4g} to store its scales and zero points "
            f"in {dtype}; got {float(np.abs(arr).max()):.4g} (pass scale_dtype=np.float32)"
        )
    q_max = (1 << bits) - 1
    groups = _grouped(arr.astype(np.float64), per, group_size)  # (..., A, n, g)
    low, high = groups.min(axis=-1), groups.max(axis=-1)  # (..., A, n)
    zero = _rounded(low, dtype, up=False)  # at most the minimum
    scale = _rounded((high - zero.astype(np.float64)) / q_max, dtype, up=True)
    short = zero.astype(np.float64) + scale.astype(np.float64) * q_max < high  # a rounding
    scale = np.where(short, np.nextafter(scale, np.array(np.inf, dtype=dtype)), scale)
    zero64, scale64 = zero.astype(np.float64)[..., None], scale.astype(np.float64)[..., None]
    steps = (groups - zero64) / np.where(scale64 > 0, scale64, 1.0)  # (..., A, n, g)
    codes = np.clip(np.rint(steps), 0, q_max).astype(np.uint8)
    packed = _pack(codes, bits)  # (..., A, n, ceil(g bits / 8)): each group in whole bytes
    return Quantised(
        packed=packed,
        scale=_stats_layout(scale, per),
        zero=_stats_layout(zero, per),
        bits=bits,
        per=per,
        group_size=group_size,
        shape=arr.shape,
        dtype=arr.dtype,
    )


def dequantise(q: Quantised) -> np.ndarray:
    """The numbers a :class:`Quantised` array stands for: ``zero + scale * code``.

    Parameters
    ----------
    q : Quantised
        What :func:`quantise` returned.

    Returns
    -------
    x : (..., T, D) np.ndarray
        In the dtype of the array that was quantised.

    Raises
    ------
    TypeError
        If ``q`` is not a :class:`Quantised`.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa_book.pages.kv_quant import dequantise, quantise
    >>> v = np.array([[0.1, 0.45, -0.2, 0.3]], dtype=np.float32)   # (T=1, D=4)
    >>> q = quantise(v, bits=4, per="token")                        # 16 levels
    >>> q.codes(), q.packed               # two codes per byte: 7, 15 -> 0x7F; 0, 12 -> 0x0C
    (array([[ 7, 15,  0, 12]], dtype=uint8), array([[[127,  12]]], dtype=uint8))
    >>> err = np.abs(dequantise(q) - v).max()
    >>> bool(err <= q.scale.max() / 2), dequantise(q).dtype         # within half a step
    (True, dtype('float32'))
    """
    if not isinstance(q, Quantised):
        raise TypeError(f"q must be a Quantised array (from quantise); got {type(q).__name__}")
    codes = _grouped(q.codes(), q.per, q.group_size).astype(np.float64)  # (..., A, n, g)
    zero = _grouped_stats(q.zero, q.per).astype(np.float64)
    scale = _grouped_stats(q.scale, q.per).astype(np.float64)
    return _ungrouped(zero + scale * codes, q.per).astype(q.dtype)


def fake_quantise(
    x: ArrayLike,
    bits: int,
    *,
    per: str,
    group_size: int | None = None,
    scale_dtype=np.float16,
) -> np.ndarray:
    """``dequantise(quantise(x, ...))``: ``x`` as a quantised cache would give it back.

    Parameters
    ----------
    x : (..., T, D) array_like
        As for :func:`quantise`.
    bits : int
        As for :func:`quantise`.
    per : {"channel", "token"}
        As for :func:`quantise`.
    group_size : int, optional
        As for :func:`quantise`.
    scale_dtype : {np.float16, np.float32, np.float64}, default np.float16
        As for :func:`quantise`.

    Returns
    -------
    (..., T, D) np.ndarray
        The dequantised numbers, in the floating dtype of ``x``.

    Raises
    ------
    TypeError, ValueError
        As :func:`quantise`.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa_book.pages.kv_quant import fake_quantise
    >>> x = np.array([[-1.0, -0.4, 0.2, 0.9, 2.0]])    # (T=1, D=5): range 3
    >>> fake_quantise(x, 2, per="token")                # 4 levels, a step of 1: -1, 0, 1, 2
    array([[-1.,  0.,  0.,  1.,  2.]])
    """
    return dequantise(quantise(x, bits, per=per, group_size=group_size, scale_dtype=scale_dtype))
