r"""Helpers of the page *Attention in low precision*: FP8, INT8 and 16-bit formats simulated
exactly in NumPy, the scales that make them usable, and attention computed in them.

Hardware computes attention's two products, :math:`Q K^\top` and :math:`P V`, in FP8 or INT8
on current GPUs. NumPy has neither type, so this module simulates them: every number is rounded
to the nearest value of the format's grid (ties to even, as the hardware's round-to-nearest
mode does) and kept in float64, where all values of the formats are exact.

* :class:`FloatFormat` describes a binary floating-point format by its exponent and mantissa
  bits; :data:`FORMATS` holds FP8 e4m3 (the OCP "fn" variant: no infinities, largest 448),
  FP8 e5m2 (largest 57344), bfloat16 and float16; :func:`round_to_format` rounds to one,
  subnormals included, saturating at the largest value or not.
* :func:`absmax_scales` computes one scale per tensor, per head or per block of tokens so that
  the largest magnitude lands on the format's largest value; :func:`fake_quantise` rounds
  ``x / scale`` to the format (INT8: symmetric codes from -127 to 127) and multiplies back.
* :func:`random_hadamard` is FlashAttention-3's rotation, random signs times a normalised
  Hadamard matrix; :func:`low_precision_attention` computes attention with Q K^T and P V in a
  format, per-block scales, optionally with SageAttention's smoothing of K and the rotation.
* :func:`with_attention` gives a copy of a :class:`sdpa.nn.DecoderLM` whose blocks call a
  function of your own for their attention, to run the trained model in a format.

Shape letters: ``B`` batch, ``H`` heads, ``T`` queries, ``S`` keys, ``D`` head width.

>>> import numpy as np
>>> round_to_format(np.array([0.3, 1.0625, 500.0]), "e4m3").tolist()  # 1.0625: a tie
[0.3125, 1.0, 448.0]
>>> round_to_format(np.array([500.0]), "e4m3", saturate=False)  # no 480 in e4m3fn
array([nan])
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from numbers import Integral

import numpy as np
from numpy.typing import ArrayLike

__all__ = [
    "FORMATS",
    "FloatFormat",
    "absmax_scales",
    "fake_quantise",
    "hadamard",
    "low_precision_attention",
    "random_hadamard",
    "round_to_format",
    "with_attention",
]


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format: sign, ``exponent_bits``, ``mantissa_bits``.

    Attributes
    ----------
    name : str
    exponent_bits, mantissa_bits : int
        The fields' widths; a value is ``(1 + m / 2**mantissa_bits) * 2**(e - bias)``, and
        ``m / 2**mantissa_bits * 2**(1 - bias)`` when ``e = 0`` (subnormal).
    max : float
        The largest finite value.
    overflow : float
        What a non-saturating conversion gives for a magnitude that rounds above ``max``:
        ``inf`` (IEEE-like formats) or ``nan`` (e4m3fn, which has no infinity).
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    max: float
    overflow: float

    @property
    def bias(self) -> int:
        """The exponent bias, ``2**(exponent_bits - 1) - 1``."""
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def min_normal(self) -> float:
        """The smallest positive normal value, ``2**(1 - bias)``."""
        return 2.0 ** (1 - self.bias)

    @property
    def min_subnormal(self) -> float:
        """The smallest positive value, ``2**(1 - bias - mantissa_bits)``."""
        return 2.0 ** (1 - self.bias - self.mantissa_bits)

    @property
    def nbytes(self) -> int:
        """Bytes per number."""
        return (1 + self.exponent_bits + self.mantissa_bits) // 8


#: The formats by name: OCP FP8 e4m3 ("fn": no infinities, one NaN pattern per sign, so the
#: top binade reaches 448) and e5m2 (IEEE-like), bfloat16 and IEEE float16.
FORMATS = {
    "e4m3": FloatFormat("e4m3", 4, 3, 448.0, np.nan),
    "e5m2": FloatFormat("e5m2", 5, 2, 57344.0, np.inf),
    "bf16": FloatFormat("bf16", 8, 7, float((2 - 2.0**-7) * 2.0**127), np.inf),
    "fp16": FloatFormat("fp16", 5, 10, 65504.0, np.inf),
}

INT8_MAX = 127  # symmetric INT8: codes -127 to 127, -128 unused so the grid is symmetric


def _format(fmt) -> FloatFormat:
    if isinstance(fmt, FloatFormat):
        return fmt
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {sorted(FORMATS)} or a FloatFormat; got {fmt!r}")
    return FORMATS[fmt]


def _real(x: ArrayLike, name: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype == bool or not (
        np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)
    ):
        raise TypeError(f"{name} must be an array of real numbers; got dtype {arr.dtype}")
    return arr


def round_to_format(x: ArrayLike, fmt="e4m3", *, saturate: bool = True) -> np.ndarray:
    """``x`` rounded to the nearest value of ``fmt``, ties to even, subnormals included.

    Parameters
    ----------
    x : array_like
        Real numbers (NaN stays NaN).
    fmt : {"e4m3", "e5m2", "bf16", "fp16"} or FloatFormat, default "e4m3"
    saturate : bool, default True
        Whether a magnitude that rounds above ``fmt.max`` (infinity included) becomes
        ``±fmt.max`` (the saturating mode of FP8 conversions) or ``fmt.overflow`` with its
        sign (NaN for e4m3, infinity for the others), as a non-saturating conversion gives.

    Returns
    -------
    np.ndarray
        Float64 (or the float dtype of ``x`` when it is float32 and the format fits it): the
        values on the format's grid.

    Raises
    ------
    TypeError
        If ``x`` is not real or ``saturate`` not a bool.
    ValueError
        If ``fmt`` is not a known format.

    Notes
    -----
    A finite :math:`x` lies in the binade :math:`[2^e, 2^{e+1})`, :math:`e \\ge 1 - \\text{bias}`
    (below it, the subnormals share the grid of the smallest binade), where the grid's step
    is :math:`2^{e - m}` for :math:`m` mantissa bits. Dividing by a power of two is exact in
    float64, so ``np.rint(x / step) * step`` rounds exactly, ties to even.

    Examples
    --------
    >>> import numpy as np
    >>> round_to_format(np.array([2.0**-9, 2.0**-10, 3 * 2.0**-11]), "e4m3")  # subnormals
    array([0.00195312, 0.        , 0.00195312])
    >>> round_to_format(np.array([60000.0, 1e6]), "e5m2", saturate=False)
    array([57344.,    inf])
    """
    f = _format(fmt)
    if not isinstance(saturate, (bool, np.bool_)):
        raise TypeError(f"saturate must be a bool; got {saturate!r}")
    arr = _real(x, "x")
    x64 = arr.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        _, e = np.frexp(x64)  # |x| = m 2**e with m in [0.5, 1): binade 2**(e - 1)
        binade = np.maximum(e - 1, 1 - f.bias)  # the subnormals share the smallest binade
        step = np.ldexp(1.0, binade - f.mantissa_bits)
        rounded = np.where(np.isfinite(x64), np.rint(x64 / step) * step, x64)
        over = np.abs(rounded) > f.max  # NaN compares False and stays NaN
        if saturate:
            out = np.where(over, np.sign(x64) * f.max, rounded)
        else:
            out = np.where(over, np.copysign(f.overflow, x64), rounded)
    fits = arr.dtype == np.float32 and f.exponent_bits <= 8 and f.mantissa_bits <= 23
    return out.astype(np.float32) if fits else out


def _check_granularity(granularity, shape) -> str | int:
    if granularity in ("tensor", "head"):
        if granularity == "head" and len(shape) < 3:
            raise ValueError(f"granularity='head' needs x of shape (..., H, T, D); got {shape}")
        return granularity
    if isinstance(granularity, (bool, np.bool_)) or not isinstance(granularity, Integral):
        raise TypeError(
            f"granularity must be 'tensor', 'head' or a block size (int); got {granularity!r}"
        )
    if granularity < 1:
        raise ValueError(f"granularity must be a positive block size; got {granularity}")
    return int(granularity)


def _fmt_max(fmt) -> float:
    return float(INT8_MAX) if fmt == "int8" else _format(fmt).max


def absmax_scales(x: ArrayLike, fmt="e4m3", *, granularity="tensor") -> np.ndarray:
    """One scale per group of ``x`` that maps the group's largest magnitude to ``fmt``'s largest
    value (448 for e4m3, 57344 for e5m2, 127 for ``"int8"``), stored in float32.

    Parameters
    ----------
    x : (..., H, T, D) array_like
        Queries, keys or values (a 2-D ``(T, D)`` array for ``"tensor"`` or a block size).
    fmt : {"e4m3", "e5m2", "bf16", "fp16", "int8"} or FloatFormat, default "e4m3"
    granularity : {"tensor", "head"} or int, default "tensor"
        ``"tensor"``: one scale for all of ``x`` (vLLM's ``k_scale``, ``v_scale``);
        ``"head"``: one per head, over every other axis (vLLM's per-head scales);
        an int ``b``: one per block of ``b`` consecutive tokens (rows) of each head, over all
        ``D`` channels, the last block shorter when ``b`` does not divide ``T`` (the block
        quantisation of FlashAttention-3 and SageAttention).

    Returns
    -------
    np.ndarray
        float32 scales shaped to broadcast against ``x``: ``(1, ..., 1)``, ``(1, .., H, 1, 1)``
        or ``(..., H, T, 1)`` (a block's scale repeated over its rows). An all-zero group gets
        scale 1.

    Raises
    ------
    TypeError, ValueError
        If ``x`` is not real, not finite or empty, or ``fmt`` / ``granularity`` is unknown.

    Examples
    --------
    >>> import numpy as np
    >>> x = np.array([[1.0, -448.0], [0.5, 0.25], [2.0, 0.0]])    # (T=3, D=2)
    >>> absmax_scales(x, "e4m3", granularity=2).ravel()           # rows 0-1, then row 2
    array([1.        , 1.        , 0.00446429], dtype=float32)
    """
    arr = _real(x, "x")
    if arr.ndim < 2 or arr.size == 0:
        raise ValueError(f"x must be a non-empty (..., T, D) array; got shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError("x must hold only finite numbers; got inf or nan")
    g = _check_granularity(granularity, arr.shape)
    top = _fmt_max(fmt)
    mag = np.abs(arr.astype(np.float64))
    if g == "tensor":
        amax = mag.max(keepdims=True)
    elif g == "head":
        axes = tuple(i for i in range(arr.ndim) if i != arr.ndim - 3)
        amax = mag.max(axis=axes, keepdims=True)
    else:
        rows = mag.max(axis=-1)  # (..., T)
        starts = np.arange(0, arr.shape[-2], g)
        per_block = np.maximum.reduceat(rows, starts, axis=-1)  # (..., ceil(T / g))
        amax = np.repeat(per_block, g, axis=-1)[..., : arr.shape[-2], None]
    scale = np.where(amax > 0, amax / top, 1.0).astype(np.float32)
    return scale


def fake_quantise(
    x: ArrayLike, fmt="e4m3", *, granularity="tensor", scale: ArrayLike | None = None
) -> np.ndarray:
    """``x`` as it comes back from ``fmt`` with scales: ``round(x / scale) * scale``.

    Parameters
    ----------
    x : (..., H, T, D) array_like
    fmt : {"e4m3", "e5m2", "bf16", "fp16", "int8"} or FloatFormat, default "e4m3"
        ``"int8"``: symmetric codes ``rint(x / scale)`` (halves to even) clipped to
        ``[-127, 127]``; a float format: :func:`round_to_format` of ``x / scale``, saturating.
    granularity : {"tensor", "head"} or int, default "tensor"
        As :func:`absmax_scales`, which computes the scales when ``scale`` is not given.
    scale : array_like, optional
        Scales that broadcast against ``x`` (a calibrated ``k_scale``, or ``1.0``: vLLM's
        default without calibration, which stores ``x`` itself in the format).

    Returns
    -------
    np.ndarray
        Float64, the shape of ``x``.

    Raises
    ------
    TypeError, ValueError
        As :func:`absmax_scales`; if ``scale`` has a non-positive entry.

    Examples
    --------
    >>> import numpy as np
    >>> x = np.array([[12.6, -127.0, 41.5]])        # (T=1, D=3): scale 127 / 127 = 1
    >>> fake_quantise(x, "int8")                    # the codes; 41.5 is a tie, to even
    array([[  13., -127.,   42.]])
    """
    arr = _real(x, "x").astype(np.float64)
    if scale is None:
        s = absmax_scales(arr, fmt, granularity=granularity).astype(np.float64)
    else:
        s = np.asarray(scale, dtype=np.float64)
        if not (np.isfinite(s).all() and (s > 0).all()):
            raise ValueError("scale must hold positive finite numbers")
        _fmt_max(fmt)  # the format's name checked
    y = arr / s
    if fmt == "int8":
        return np.clip(np.rint(y), -INT8_MAX, INT8_MAX) * s
    return round_to_format(y, fmt) * s


def hadamard(n: int) -> np.ndarray:
    """The normalised Sylvester Hadamard matrix of order ``n`` (a power of two): orthogonal,
    every entry ``±1 / sqrt(n)``.

    >>> hadamard(2) * np.sqrt(2)
    array([[ 1.,  1.],
           [ 1., -1.]])
    """
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, Integral) or n < 1 or n & (n - 1):
        raise ValueError(f"n must be a power of two; got {n!r}")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def random_hadamard(n: int, rng: np.random.Generator) -> np.ndarray:
    """FlashAttention-3's rotation: ``diag(signs) @ hadamard(n)``, random signs ``±1``.

    Orthogonal, so ``(Q R)(K R)^T = Q K^T`` in exact arithmetic; it mixes every channel into
    every other, so one large channel is spread over all of them.
    """
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy Generator; got {type(rng).__name__}")
    signs = rng.choice([-1.0, 1.0], size=n)
    return signs[:, None] * hadamard(n)


def _quantise_operand(x, fmt, block):
    """``x`` in ``fmt``: per-block scales for FP8 and INT8, a plain cast for 16-bit formats."""
    if fmt == "fp32":
        return x.astype(np.float32).astype(np.float64)
    if fmt in ("bf16", "fp16"):
        return round_to_format(x, fmt)
    return fake_quantise(x, fmt, granularity=block)


def _quantise_probs(p, fmt):
    """``exp(s - max)`` in ``[0, 1]`` in ``fmt``: FP8 and INT8 with the static scale that maps
    1 to the format's largest value, as SageAttention2 does for FP8."""
    if fmt == "fp32":
        return p.astype(np.float32).astype(np.float64)
    if fmt in ("bf16", "fp16"):
        return round_to_format(p, fmt)
    return fake_quantise(p, fmt, scale=1.0 / _fmt_max(fmt))


QK_FORMATS = ("fp32", "bf16", "fp16", "e4m3", "e5m2", "int8")


def low_precision_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    qk: str = "e4m3",
    pv: str | None = None,
    block_q: int = 128,
    block_k: int = 64,
    smooth_k: bool = False,
    rotation: ArrayLike | None = None,
    is_causal: bool = False,
) -> np.ndarray:
    r"""Attention with :math:`Q K^\top` and :math:`P V` computed in low precision.

    Parameters
    ----------
    q : (..., T, D) array_like
    k, v : (..., S, D) array_like
    qk : {"fp32", "bf16", "fp16", "e4m3", "e5m2", "int8"}, default "e4m3"
        The format of Q and K. FP8 and INT8 get one scale per block of ``block_q`` queries
        and of ``block_k`` keys (over all ``D`` channels); 16-bit formats are a plain cast.
    pv : same choices, optional
        The format of P and V (default: ``qk``). V gets per-block scales of ``block_k`` keys;
        P, the unnormalised ``exp(s - rowmax)`` in ``[0, 1]``, a static scale mapping 1 to
        the format's largest value. The row sums are taken before P is rounded, and the
        output divided by them, as a flash kernel does.
    block_q, block_k : int, default 128 and 64
        Rows per scale (SageAttention's block sizes).
    smooth_k : bool, default False
        Subtract from K its mean over the keys, channel by channel, before quantising
        (SageAttention): every row of scores moves by a constant, so the softmax is unchanged.
    rotation : (D, D) array_like, optional
        An orthogonal matrix applied to Q and K before quantising (FlashAttention-3's
        incoherent processing, :func:`random_hadamard`).
    is_causal : bool, default False
        Query ``t`` sees keys ``s <= t + S - T`` (aligned bottom right).

    Returns
    -------
    (..., T, D) np.ndarray
        Float64; the products themselves are exact in float64 (hardware accumulates in
        float32, whose rounding is far below the formats').

    Raises
    ------
    TypeError, ValueError
        If the arrays are not real or do not fit together, or an option is unknown.

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 2, 16, 8))
    >>> exact = low_precision_attention(q, k, v, qk="fp32")
    >>> float(np.abs(low_precision_attention(q, k, v, qk="e4m3") - exact).max()) < 0.1
    True
    """
    pv = qk if pv is None else pv
    for name, fmt in (("qk", qk), ("pv", pv)):
        if fmt not in QK_FORMATS:
            raise ValueError(f"{name} must be one of {QK_FORMATS}; got {fmt!r}")
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        _check_granularity(b, (1, 1))
        if isinstance(b, str):
            raise TypeError(f"{name} must be an int; got {b!r}")
    q64, k64, v64 = (_real(a, n).astype(np.float64) for a, n in ((q, "q"), (k, "k"), (v, "v")))
    if q64.ndim < 2 or q64.shape[-1] != k64.shape[-1] or k64.shape[:-1] != v64.shape[:-1]:
        raise ValueError(
            f"q must be (..., T, D), k (..., S, D) and v (..., S, Dv); got shapes "
            f"{q64.shape}, {k64.shape}, {v64.shape}"
        )
    if rotation is not None:
        r = _real(rotation, "rotation").astype(np.float64)
        q64, k64 = q64 @ r, k64 @ r
    if smooth_k:
        k64 = k64 - k64.mean(axis=-2, keepdims=True)
    q_hat = _quantise_operand(q64, qk, block_q)
    k_hat = _quantise_operand(k64, qk, block_k)
    s = q_hat @ np.swapaxes(k_hat, -1, -2) / np.sqrt(q64.shape[-1])  # (..., T, S)
    if is_causal:
        T, S = s.shape[-2:]
        s = np.where(np.arange(S) <= np.arange(T)[:, None] + S - T, s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))  # in [0, 1], the flash kernel's P
    p_hat, v_hat = _quantise_probs(p, pv), _quantise_operand(v64, pv, block_k)
    return (p_hat @ v_hat) / p.sum(axis=-1, keepdims=True)


class _Attend:
    """The object a :class:`sdpa.nn.DecoderLM` calls for its attention, forwarding to
    ``attend(layer, q, k, v)``; it counts the calls to know the block."""

    def __init__(self, attend, n_layers: int):
        self.attend, self.n_layers, self.calls = attend, n_layers, 0

    def forward(self, q, k, v, attn_mask, sinks, return_weights, return_lse):
        if sinks is not None or return_weights or return_lse:
            raise ValueError("with_attention supports causal attention without sinks only")
        layer = self.calls % self.n_layers
        self.calls += 1
        mask = np.tril(np.ones((q.shape[2], k.shape[2]), dtype=bool))
        if attn_mask is not None:
            mask = attn_mask
        out = np.asarray(self.attend(layer, q, k, v, mask))
        return out.astype(q.dtype), None, None


def with_attention(model, attend):
    """A copy of ``model`` whose blocks compute their attention with ``attend``.

    Parameters
    ----------
    model : sdpa.nn.DecoderLM
        A model without sinks or a soft-cap on the scores; shares its parameters with the copy.
    attend : callable
        ``attend(layer, q, k, v, mask) -> out``: ``q`` ``(B, H, T, Dk)``, ``k`` and ``v``
        ``(B, H, T, Dk)`` after RoPE, ``mask`` ``(T, T)`` bool (True: may attend), and the
        output ``(B, H, T, Dk)``.

    Returns
    -------
    sdpa.nn.DecoderLM
        Its ``forward`` (without ``return_attention``) runs ``attend`` in every block.
    """
    from sdpa.nn import DecoderLM

    if not isinstance(model, DecoderLM):
        raise TypeError(f"model must be a DecoderLM; got {type(model).__name__}")
    if model.sink or model.attn_softcap is not None or model.n_kv_heads != model.n_heads:
        raise ValueError("model must have no sinks, no attn_softcap and n_kv_heads == n_heads")
    if not callable(attend):
        raise TypeError(f"attend must be callable; got {attend!r:.80}")
    twin = copy.copy(model)  # the same parameters; only the attention object differs
    twin.attention = _Attend(attend, model.n_layers)
    return twin
