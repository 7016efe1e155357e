r"""The pieces of a Transformer block other than attention, as functions with hand-derived
gradients: the linear map, the two norms and GELU.

Every forward function ``f`` has a partner ``f_backward(d_y, *inputs)`` that returns the
gradients of the scalar ``L = sum(d_y * f(*inputs))`` with respect to the inputs: the
vector-Jacobian product that backpropagation needs, where ``d_y = dL/dy`` arrives from the layer
above. The rest of :mod:`sdpa.nn`'s functions follow the same rule: soft-capping in
:mod:`sdpa.nn.softcap`, the loss and the embedding's gradient in :mod:`sdpa.nn.losses`.

Shape letters: ``E`` feature width (``in``/``out`` for a linear map). Leading dimensions
``...`` are anything (batch, time, heads); parameters are shared across them, so their
gradients are sums over the leading dimensions.

**Dtypes.** float32 and float64 inputs give outputs of the common dtype (``np.result_type``),
computed in it; float16 is computed in float32 and returned as float16; integer and bool inputs
are computed in float64. Inputs are never modified.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike

from .._checks import check_features, check_grad_shape, check_real, check_vector, float_arrays

__all__ = [
    "gelu",
    "gelu_backward",
    "layer_norm",
    "layer_norm_backward",
    "linear",
    "linear_backward",
    "rms_norm",
    "rms_norm_backward",
]

GELU_APPROXIMATIONS = ("none", "tanh")


def _check_eps(eps) -> float:
    return check_real(
        eps, "eps", "a positive, finite real number", lambda x: math.isfinite(x) and x > 0
    )


def _check_approximate(approximate) -> str:
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"approximate must be 'none' or 'tanh'; got {approximate!r}")
    return approximate


def _sum_leading(a: np.ndarray) -> np.ndarray:
    """Sum over every axis but the last: the gradient of a parameter shared by all rows."""
    return a.reshape(-1, a.shape[-1]).sum(axis=0)


# ---------------------------------------------------------------------------------------------
# Linear map
# ---------------------------------------------------------------------------------------------


def _linear_args(x, weight, bias):
    (x, weight, bias), out_dtype = float_arrays(x=x, weight=weight, bias=bias)
    if weight.ndim != 2:
        raise ValueError(f"weight must be 2-D (in, out); got weight.shape={weight.shape}")
    if x.ndim == 0 or x.shape[-1] != weight.shape[0]:
        raise ValueError(
            f"the last axis of x must equal the rows of weight (in, out); "
            f"got x.shape={x.shape}, weight.shape={weight.shape}"
        )
    check_vector(bias, "bias", weight.shape[1], "the result (the columns of weight)")
    return x, weight, bias, out_dtype


def linear(x: ArrayLike, weight: ArrayLike, bias: ArrayLike | None = None) -> np.ndarray:
    """Affine map of the last axis: ``x @ weight + bias``.

    Parameters
    ----------
    x : (..., in) array_like
        The inputs, one row per position.
    weight : (in, out) array_like
        Stored input-major, so the map is one matrix product (``torch.nn.Linear`` stores the
        transpose, ``(out, in)``).
    bias : (out,) array_like, optional
        Added to every row of the product.

    Returns
    -------
    y : (..., out) np.ndarray
        ``x @ weight + bias``.

    Raises
    ------
    TypeError
        If an input is complex or not numeric.
    ValueError
        If ``weight`` is not 2-D, ``x``'s last axis is not ``in``, or ``bias`` is not ``(out,)``.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa.nn import linear
    >>> x = np.array([[1.0, 2.0]])             # (T=1, in=2)
    >>> W = np.array([[1.0, 0, 1], [0, 1, 1]])  # (in=2, out=3)
    >>> linear(x, W, bias=np.array([0.5, 0, 0]))
    array([[1.5, 2. , 3. ]])
    """
    x, weight, bias, out_dtype = _linear_args(x, weight, bias)
    y = x @ weight  # (..., in) @ (in, out) -> (..., out)
    if bias is not None:
        y = y + bias
    return y.astype(out_dtype, copy=False)


def linear_backward(
    d_y: ArrayLike, x: ArrayLike, weight: ArrayLike, bias: ArrayLike | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    r"""Gradients of ``sum(d_y * linear(x, weight, bias))``.

    Parameters
    ----------
    d_y : (..., out) array_like
        Gradient with respect to the result.
    x, weight, bias
        As in :func:`linear`.

    Returns
    -------
    d_x : (..., in) np.ndarray
        ``d_y @ weight.T``.
    d_weight : (in, out) np.ndarray
        ``x^T d_y`` summed over the leading dimensions.
    d_bias : (out,) np.ndarray or None
        ``d_y`` summed over the leading dimensions; None when there is no bias.

    Raises
    ------
    TypeError
        As :func:`linear`.
    ValueError
        As :func:`linear`; also if ``d_y`` does not have the result's shape.

    Notes
    -----
    With the rows of ``x`` stacked into a matrix :math:`X` (all leading dimensions flattened),
    :math:`Y = XW + b` gives :math:`dX = dY\,W^\top`, :math:`dW = X^\top dY` and
    :math:`db = \mathbf{1}^\top dY`.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa.nn import linear_backward
    >>> x = np.array([[1.0, 2.0], [3.0, 4.0]])  # (T=2, in=2)
    >>> W = np.eye(2)
    >>> d_x, d_W, d_b = linear_backward(np.ones((2, 2)), x, W, np.zeros(2))
    >>> d_W  # column sums of x, once per output
    array([[4., 4.],
           [6., 6.]])
    >>> d_b  # one per row of x
    array([2., 2.])
    """
    x, weight, bias, out_dtype = _linear_args(x, weight, bias)
    (d_y,), _ = float_arrays(d_y=d_y)
    d_y = d_y.astype(x.dtype, copy=False)
    check_grad_shape(d_y, (*x.shape[:-1], weight.shape[1]), "(..., out)")
    d_x = d_y @ weight.T  # (..., out) @ (out, in) -> (..., in)
    x2 = x.reshape(-1, weight.shape[0])  # (N, in), N = product of the leading dimensions
    d_y2 = d_y.reshape(-1, weight.shape[1])  # (N, out)
    d_weight = x2.T @ d_y2  # (in, N) @ (N, out) -> (in, out)
    d_bias = None if bias is None else d_y2.sum(axis=0).astype(out_dtype, copy=False)
    return d_x.astype(out_dtype, copy=False), d_weight.astype(out_dtype, copy=False), d_bias


# ---------------------------------------------------------------------------------------------
# Normalisations
# ---------------------------------------------------------------------------------------------


def _norm_args(x, weight, bias, eps):
    eps = _check_eps(eps)
    (x, weight, bias), out_dtype = float_arrays(x=x, weight=weight, bias=bias)
    E = check_features(x, "x")
    check_vector(weight, "weight", E, "x")
    check_vector(bias, "bias", E, "x")
    return x, weight, bias, eps, out_dtype


def _row_scale(x: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """``(s, eps_s)``: per row a power of two ``s`` to divide by, and ``eps / s**2``, ``(..., 1)``.

    The squares of a float32 row above 1.8e19 overflow (float64: 1.3e154), and so may its
    sum. With ``peak = max(max|x|, sqrt(eps))``, ``s`` lies in ``(peak / 2, peak]``: the
    scaled row lies in ``[-2, 2]`` and ``eps_s`` in ``(0, 4]``, so nothing can overflow, and
    the squares that underflow are those negligible beside ``eps_s`` or the largest square.
    Dividing by a power of two is exact (outside the subnormals), so ordinary rows give
    bitwise the numbers of the unscaled formula. ``eps_s`` is kept at least the smallest
    normal number, so that a constant row gives ``0 / sqrt(eps_s) = 0`` even when ``eps / s**2``
    underflows.
    """
    eps = x.dtype.type(eps)
    peak = np.maximum(np.max(np.abs(x), axis=-1, keepdims=True), np.sqrt(eps))  # (..., 1)
    _, exponent = np.frexp(peak)  # peak = mantissa * 2**exponent, mantissa in [0.5, 1)
    s = np.ldexp(x.dtype.type(1), exponent - 1)  # (..., 1); s * s may overflow, eps / s / s not
    return s, np.maximum(eps / s / s, np.finfo(x.dtype).tiny)


def _layer_norm_stats(x: np.ndarray, eps: float) -> tuple[np.ndarray, ...]:
    """``(x_hat, rstd, s)``, the last two ``(..., 1)``: ``1 / sqrt(var + eps) = rstd / s``.

    The rows are divided by ``s`` first (:func:`_row_scale`); ``rstd`` is that of the scaled
    rows, and ``x_hat`` does not depend on the scaling.
    """
    s, eps_s = _row_scale(x, eps)
    x = x / s  # (..., E), exact, in [-2, 2]
    centred = x - x.mean(axis=-1, keepdims=True)
    var = np.mean(centred * centred, axis=-1, keepdims=True)  # biased, as the forward uses
    rstd = 1.0 / np.sqrt(var + eps_s)
    return centred * rstd, rstd, s


def layer_norm(
    x: ArrayLike, weight: ArrayLike, bias: ArrayLike, *, eps: float = 1e-5
) -> np.ndarray:
    r"""Layer normalisation over the last axis, ``(x - mean) / sqrt(var + eps) * weight + bias``.

    The same numbers as ``torch.nn.functional.layer_norm(x, (E,), weight, bias, eps)``.

    Parameters
    ----------
    x : (..., E) array_like
        The rows to normalise.
    weight : (E,) array_like
        Per-feature gain (often called gamma).
    bias : (E,) array_like
        Per-feature shift (beta).
    eps : float, default 1e-5
        Added to the variance, so a constant row does not divide by zero.

    Returns
    -------
    y : (..., E) np.ndarray
        The normalised rows, scaled and shifted.

    Raises
    ------
    TypeError
        If an input is complex or not numeric, or ``eps`` is not a real number.
    ValueError
        If ``x`` has no axis or an empty last axis, ``weight`` or ``bias`` is not ``(E,)``,
        or ``eps`` is not positive and finite.

    Notes
    -----
    Each row :math:`x \in \mathbb{R}^E` has mean :math:`\mu` and *biased* variance
    :math:`\sigma^2 = \frac1E \sum_i (x_i - \mu)^2`; then
    :math:`\hat x = (x - \mu)/\sqrt{\sigma^2 + \varepsilon}` and :math:`y = w \odot \hat x + b`.

    **Any magnitude.** Each row is first divided by a power of two close to
    :math:`\max(\max_i |x_i|, \sqrt{\varepsilon})` (``eps`` likewise by its square), so
    that the squares can neither overflow (in float32 they would beyond about 1.8e19, and the
    result would be zeros) nor vanish when they matter: every finite row is normalised as in
    exact arithmetic, up to the dtype's rounding. Dividing by a power of two is exact, so
    ordinary rows give the same numbers as the unscaled formula. So does
    :func:`layer_norm_backward`.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa.nn import layer_norm
    >>> x = np.array([[1.0, 2.0, 3.0, 6.0]])
    >>> y = layer_norm(x, np.ones(4), np.zeros(4))
    >>> np.round(y, 3)
    array([[-1.069, -0.535,  0.   ,  1.604]])
    >>> float(np.round(y.mean(), 12)), float(np.round(y.var(), 4))  # mean 0, variance ~1
    (0.0, 1.0)
    """
    x, weight, bias, eps, out_dtype = _norm_args(x, weight, bias, eps)
    x_hat, _, _ = _layer_norm_stats(x, eps)
    return (x_hat * weight + bias).astype(out_dtype, copy=False)


def layer_norm_backward(
    d_y: ArrayLike, x: ArrayLike, weight: ArrayLike, bias: ArrayLike, *, eps: float = 1e-5
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    r"""Gradients of ``sum(d_y * layer_norm(x, weight, bias, eps=eps))``.

    Parameters
    ----------
    d_y : (..., E) array_like
        Gradient with respect to the result.
    x, weight, bias, eps
        As in :func:`layer_norm`.

    Returns
    -------
    d_x : (..., E) np.ndarray
        Gradient with respect to ``x``.
    d_weight : (E,) np.ndarray
        ``sum(d_y * x_hat)`` over the leading dimensions.
    d_bias : (E,) np.ndarray
        ``sum(d_y)`` over the leading dimensions.

    Raises
    ------
    TypeError
        As :func:`layer_norm`.
    ValueError
        As :func:`layer_norm`; also if ``d_y`` does not have the shape of ``x``.

    Notes
    -----
    With :math:`g = w \odot dy` (the gradient reaching :math:`\hat x`) and
    :math:`r = 1/\sqrt{\sigma^2 + \varepsilon}`, per row

    .. math:: dx = r \left( g - \operatorname{mean}(g)
                   - \hat x \operatorname{mean}(g \odot \hat x) \right).

    The two means remove what the normalisation removed: a shift of all features (the
    mean) and a rescaling of the row (the variance) do not change :math:`\hat x`, so the
    gradient has no component along :math:`\mathbf 1` or along :math:`\hat x`.

    Examples
    --------
    The gradient with respect to ``x`` sums to zero along each row (adding a constant to a row
    changes nothing):

    >>> import numpy as np
    >>> from sdpa.nn import layer_norm_backward
    >>> rng = np.random.default_rng(0)
    >>> x, d_y = rng.standard_normal((2, 3, 5))
    >>> d_x, d_w, d_b = layer_norm_backward(d_y, x, np.ones(5), np.zeros(5))
    >>> np.round(d_x.sum(axis=-1), 12) + 0.0
    array([0., 0., 0.])
    """
    x, weight, bias, eps, out_dtype = _norm_args(x, weight, bias, eps)
    (d_y,), _ = float_arrays(d_y=d_y)
    d_y = d_y.astype(x.dtype, copy=False)
    check_grad_shape(d_y, x.shape, "(..., E)")
    x_hat, rstd, s = _layer_norm_stats(x, eps)
    g = d_y * weight  # gradient reaching x_hat
    d_x = rstd * (
        g - g.mean(axis=-1, keepdims=True) - x_hat * np.mean(g * x_hat, axis=-1, keepdims=True)
    )
    d_x = d_x / s  # the 1 / sqrt(var + eps) of the unscaled rows is rstd / s
    d_weight = _sum_leading(d_y * x_hat)
    d_bias = _sum_leading(d_y)
    return tuple(a.astype(out_dtype, copy=False) for a in (d_x, d_weight, d_bias))


def _rms_stats(x: np.ndarray, eps: float) -> tuple[np.ndarray, ...]:
    """``(x_hat, rrms, s)``, the last two ``(..., 1)``: ``1 / sqrt(mean(x^2) + eps) = rrms / s``.

    The rows are divided by ``s`` first, as in :func:`_layer_norm_stats`.
    """
    s, eps_s = _row_scale(x, eps)
    x = x / s  # (..., E), exact, in [-2, 2]
    rrms = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps_s)
    return x * rrms, rrms, s


def rms_norm(x: ArrayLike, weight: ArrayLike, *, eps: float = 1e-6) -> np.ndarray:
    r"""Root-mean-square normalisation over the last axis, ``x / sqrt(mean(x^2) + eps) * weight``.

    The same numbers as ``torch.nn.functional.rms_norm(x, (E,), weight, eps)``: layer
    normalisation without the centring and without the bias (Zhang and Sennrich, 2019), as in
    LLaMA-family models.

    Parameters
    ----------
    x : (..., E) array_like
        The rows to normalise.
    weight : (E,) array_like
        Per-feature gain.
    eps : float, default 1e-6
        Added to the mean square.

    Returns
    -------
    y : (..., E) np.ndarray
        The rows divided by their root mean square, scaled.

    Raises
    ------
    TypeError
        If an input is complex or not numeric, or ``eps`` is not a real number.
    ValueError
        If ``x`` has no axis or an empty last axis, ``weight`` is not ``(E,)``, or ``eps``
        is not positive and finite.

    Notes
    -----
    :math:`\hat x = x / \sqrt{\operatorname{mean}(x^2) + \varepsilon}`, :math:`y = w \odot
    \hat x`. As in :func:`layer_norm`, each row is first divided by a power of two close to
    its largest entry, so that rows of any finite magnitude (float32 rows above about 1.8e19
    would otherwise give zeros) match exact arithmetic; ordinary rows are unchanged.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa.nn import rms_norm
    >>> y = rms_norm(np.array([3.0, 4.0]), np.ones(2), eps=1e-12)  # rms = sqrt(12.5)
    >>> np.round(y, 4)
    array([0.8485, 1.1314])
    >>> float(np.round(np.mean(y**2), 8))  # the result has mean square 1
    1.0

    The squares of a float32 row of 1e20 would overflow; the row is scaled first:

    >>> np.round(rms_norm(np.array([3e20, 4e20], np.float32), np.ones(2, np.float32)), 4)
    array([0.8485, 1.1314], dtype=float32)
    """
    x, weight, _, eps, out_dtype = _norm_args(x, weight, None, eps)
    x_hat, _, _ = _rms_stats(x, eps)
    return (x_hat * weight).astype(out_dtype, copy=False)


def rms_norm_backward(
    d_y: ArrayLike, x: ArrayLike, weight: ArrayLike, *, eps: float = 1e-6
) -> tuple[np.ndarray, np.ndarray]:
    r"""Gradients of ``sum(d_y * rms_norm(x, weight, eps=eps))``.

    Parameters
    ----------
    d_y : (..., E) array_like
        Gradient with respect to the result.
    x, weight, eps
        As in :func:`rms_norm`.

    Returns
    -------
    d_x : (..., E) np.ndarray
        Gradient with respect to ``x``.
    d_weight : (E,) np.ndarray
        ``sum(d_y * x_hat)`` over the leading dimensions.

    Raises
    ------
    TypeError
        As :func:`rms_norm`.
    ValueError
        As :func:`rms_norm`; also if ``d_y`` does not have the shape of ``x``.

    Notes
    -----
    With :math:`g = w \odot dy` and :math:`r = 1/\sqrt{\operatorname{mean}(x^2) + \varepsilon}`,
    per row :math:`dx = r\,(g - \hat x \operatorname{mean}(g \odot \hat x))`: the layer-norm
    formula without the term for the mean, which RMS normalisation does not subtract.

    Examples
    --------
    Scaling a row does not change its normalisation (up to ``eps``), so the gradient is
    orthogonal to the row itself:

    >>> import numpy as np
    >>> from sdpa.nn import rms_norm_backward
    >>> rng = np.random.default_rng(0)
    >>> x, d_y = rng.standard_normal((2, 4))
    >>> d_x, d_w = rms_norm_backward(d_y, x, np.ones(4), eps=1e-12)
    >>> float(np.round(d_x @ x, 10)) + 0.0
    0.0
    """
    x, weight, _, eps, out_dtype = _norm_args(x, weight, None, eps)
    (d_y,), _ = float_arrays(d_y=d_y)
    d_y = d_y.astype(x.dtype, copy=False)
    check_grad_shape(d_y, x.shape, "(..., E)")
    x_hat, rrms, s = _rms_stats(x, eps)
    g = d_y * weight
    d_x = rrms * (g - x_hat * np.mean(g * x_hat, axis=-1, keepdims=True)) / s
    d_weight = _sum_leading(d_y * x_hat)
    return d_x.astype(out_dtype, copy=False), d_weight.astype(out_dtype, copy=False)


# ---------------------------------------------------------------------------------------------
# GELU
# ---------------------------------------------------------------------------------------------

_erf = np.frompyfunc(math.erf, 1, 1)  # the C library's erf, element by element (NumPy has none)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_TANH_CUBIC = 0.044715  # the constant of Hendrycks and Gimpel's tanh approximation


def _gelu_args(x, approximate):
    approximate = _check_approximate(approximate)
    (x,), out_dtype = float_arrays(x=x)
    return x, approximate, out_dtype


def _normal_cdf(x: np.ndarray) -> np.ndarray:
    """Phi(x) = (1 + erf(x / sqrt 2)) / 2, computed in float64, returned in x's dtype."""
    erf = _erf(x.astype(np.float64) / math.sqrt(2.0)).astype(np.float64)
    return (0.5 * (1.0 + erf)).astype(x.dtype, copy=False)


def gelu(x: ArrayLike, *, approximate: str = "none") -> np.ndarray:
    r"""The Gaussian error linear unit, ``x * Phi(x)`` (Hendrycks and Gimpel, 2016).

    The same numbers as ``torch.nn.functional.gelu(x, approximate=approximate)``.

    Parameters
    ----------
    x : array_like
        Any shape.
    approximate : {"none", "tanh"}, default "none"
        ``"none"``: the exact ``x * Phi(x)``, with ``Phi`` the standard normal distribution
        function. ``"tanh"``: ``x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))``, the
        approximation GPT-2 uses; it differs from the exact function by less than 5e-4.

    Returns
    -------
    y : np.ndarray
        Same shape as ``x``.

    Raises
    ------
    TypeError
        If ``x`` is complex or not numeric.
    ValueError
        If ``approximate`` is neither ``"none"`` nor ``"tanh"``.

    Notes
    -----
    The exact form evaluates ``erf`` element by element through Python's ``math.erf``
    (NumPy has no vectorised ``erf``), which is slower than the ``tanh`` form on large arrays;
    :class:`sdpa.nn.DecoderLM` uses the ``tanh`` form.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa.nn import gelu
    >>> x = np.array([-3.0, -1.0, 0.0, 1.0, 3.0])
    >>> np.round(gelu(x), 4)  # almost 0 for negative x, almost x for positive x
    array([-0.004 , -0.1587,  0.    ,  0.8413,  2.996 ])
    >>> float(np.abs(gelu(x) - gelu(x, approximate="tanh")).max()) < 5e-4
    True
    """
    x, approximate, out_dtype = _gelu_args(x, approximate)
    if approximate == "tanh":
        inner = _SQRT_2_OVER_PI * (x + _TANH_CUBIC * x * x * x)
        y = 0.5 * x * (1.0 + np.tanh(inner))
    else:
        y = x * _normal_cdf(x)
    return y.astype(out_dtype, copy=False)


def gelu_backward(d_y: ArrayLike, x: ArrayLike, *, approximate: str = "none") -> np.ndarray:
    r"""Gradient of ``sum(d_y * gelu(x, approximate=approximate))`` with respect to ``x``.

    Parameters
    ----------
    d_y : array_like
        Gradient with respect to the result, shaped like ``x``.
    x, approximate
        As in :func:`gelu`.

    Returns
    -------
    d_x : np.ndarray
        ``d_y * gelu'(x)``.

    Raises
    ------
    TypeError
        As :func:`gelu`.
    ValueError
        As :func:`gelu`; also if ``d_y`` does not have the shape of ``x``.

    Notes
    -----
    Exact: :math:`\frac{d}{dx}\,x\Phi(x) = \Phi(x) + x\varphi(x)` with
    :math:`\varphi(x) = e^{-x^2/2}/\sqrt{2\pi}`. With :math:`u = \sqrt{2/\pi}(x + 0.044715x^3)`,
    the tanh form has derivative
    :math:`\tfrac12(1 + \tanh u)
    + \tfrac12 x (1 - \tanh^2 u)\sqrt{2/\pi}(1 + 3 \cdot 0.044715 x^2)`.

    Examples
    --------
    The slope is 1/2 at 0, tends to 1 for large ``x`` and to 0 for very negative ``x``:

    >>> import numpy as np
    >>> from sdpa.nn import gelu_backward
    >>> x = np.array([-10.0, 0.0, 10.0])
    >>> np.round(gelu_backward(np.ones(3), x), 6) + 0.0
    array([0. , 0.5, 1. ])
    """
    x, approximate, out_dtype = _gelu_args(x, approximate)
    (d_y,), _ = float_arrays(d_y=d_y)
    d_y = d_y.astype(x.dtype, copy=False)
    check_grad_shape(d_y, x.shape, "(the shape of x)")
    if approximate == "tanh":
        th = np.tanh(_SQRT_2_OVER_PI * (x + _TANH_CUBIC * x * x * x))
        slope = 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * _SQRT_2_OVER_PI * (
            1.0 + 3.0 * _TANH_CUBIC * x * x
        )
    else:
        density = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
        slope = _normal_cdf(x) + x * density
    return (d_y * slope).astype(out_dtype, copy=False)
