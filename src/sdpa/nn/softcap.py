r"""Soft-capping, ``cap * tanh(x / cap)``, and attention whose scores are soft-capped.

Gemma 2 caps its attention scores and final logits this way, nanochat its logits: a smooth
clamp into ``(-cap, cap)`` that keeps training from growing them without bound. As in
:mod:`sdpa.nn.functional`, each forward function has a ``*_backward`` partner returning the
gradients of ``sum(d_y * f(...))``. The soft-capped attention is the one piece of attention in
:mod:`sdpa.nn`: written out over the whole score matrix for :class:`sdpa.nn.DecoderLM`
(``attn_softcap``), because :func:`sdpa.scaled_dot_product_attention` has no cap.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike

from .._checks import check_grad_shape, check_real, float_arrays
from ..attention import softmax_with_sinks
from ..softmax_stable import softmax_and_lse

__all__ = ["softcap", "softcap_backward"]


def _softcap_args(x, cap):
    cap = check_real(
        cap, "cap", "a positive, finite real number", lambda c: math.isfinite(c) and c > 0
    )
    (x,), out_dtype = float_arrays(x=x)
    return x, cap, out_dtype


def softcap(x: ArrayLike, cap: float) -> np.ndarray:
    r"""Soft-capping, ``cap * tanh(x / cap)``: a smooth clamp of ``x`` into ``(-cap, cap)``.

    Gemma 2 caps its attention scores (at 50) and its final logits (at 30) this way, and
    nanochat its logits (at 15): a value small next to ``cap`` passes almost unchanged, a large
    one saturates, so that no score or logit can grow without bound during training.

    Parameters
    ----------
    x : array_like
        Any shape.
    cap : float
        The bound, a positive finite number.

    Returns
    -------
    y : np.ndarray
        Same shape as ``x``, every entry in ``[-cap, cap]`` (``-cap`` and ``cap`` themselves
        only where ``tanh`` rounds to one, or for infinite ``x``).

    Raises
    ------
    TypeError
        If ``x`` is complex or not numeric, or ``cap`` is not a real number.
    ValueError
        If ``cap`` is not positive and finite.

    Notes
    -----
    :math:`y = c \tanh(x / c)` is odd and increasing, with slope one at zero. Since
    :math:`u - u^3/3 \le \tanh u \le u` for :math:`u \ge 0`, the cap shrinks a value by at most
    :math:`|x|^3 / (3 c^2)`: by less than a third of :math:`(x/c)^2` in relative terms. Its
    gradient is in :func:`softcap_backward`.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa.nn import softcap
    >>> x = np.array([-100.0, -1.0, 0.0, 1.0, 100.0])
    >>> np.round(softcap(x, 5.0), 4) + 0.0  # small values almost unchanged, large ones to +-5
    array([-5.    , -0.9869,  0.    ,  0.9869,  5.    ])
    """
    x, cap, out_dtype = _softcap_args(x, cap)
    return (cap * np.tanh(x / cap)).astype(out_dtype, copy=False)


def softcap_backward(d_y: ArrayLike, x: ArrayLike, cap: float) -> np.ndarray:
    r"""Gradient of ``sum(d_y * softcap(x, cap))`` with respect to ``x``.

    Parameters
    ----------
    d_y : array_like
        Gradient with respect to the result, shaped like ``x``.
    x, cap
        As in :func:`softcap`.

    Returns
    -------
    d_x : np.ndarray
        ``d_y * (1 - tanh(x / cap) ** 2)``.

    Raises
    ------
    TypeError
        As :func:`softcap`.
    ValueError
        As :func:`softcap`; also if ``d_y`` does not have the shape of ``x``.

    Notes
    -----
    :math:`\frac{d}{dx}\, c \tanh(x/c) = 1 - \tanh^2(x/c)`: one at zero, and
    :math:`4 e^{-2|x|/c}` or less far out, so that a capped value which has saturated
    passes almost no gradient back.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa.nn import softcap_backward
    >>> x = np.array([0.0, 5.0, 50.0])
    >>> np.round(softcap_backward(np.ones(3), x, 5.0), 4)  # 1, 1 - tanh(1)^2, almost 0
    array([1.  , 0.42, 0.  ])
    """
    x, cap, out_dtype = _softcap_args(x, cap)
    (d_y,), _ = float_arrays(d_y=d_y)
    d_y = d_y.astype(x.dtype, copy=False)
    check_grad_shape(d_y, x.shape, "(the shape of x)")
    th = np.tanh(x / cap)
    return (d_y * (1.0 - th * th)).astype(out_dtype, copy=False)


def softcapped_attention(q, k, v, cap: float, allowed: np.ndarray, sinks=None):
    r"""Attention with soft-capped scores, the whole ``(T, S)`` matrix at once.

    ``out = softmax(where(allowed, cap * tanh(q k^T / sqrt(Dk) / cap), -inf)) v``, with an
    optional sink logit per row in the softmax's denominator (not capped: it is a parameter,
    not a score). :func:`sdpa.scaled_dot_product_attention` has no cap, so this is written out
    (for the short sequences of :class:`sdpa.nn.DecoderLM`).

    ``q`` is ``(B, Hq, T, Dk)``; ``k``, ``v`` are ``(B, Hkv, S, Dk)`` (query head ``h`` uses
    key/value head ``h // (Hq / Hkv)``, as ``enable_gqa``); ``allowed`` ``(T, S)`` bool leaves
    every row a key; ``sinks`` broadcasts to ``(B, Hq, T)``. Float arrays of one dtype, not
    checked (internal). Returns ``out`` ``(B, Hq, T, Dk)``, ``weights`` ``(B, Hq, T, S)`` and
    ``lse`` ``(B, Hq, T)``, the log of the softmax's denominator (with the sink's term).
    """
    G = q.shape[1] // k.shape[1]  # query heads per key/value head
    k, v = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)  # (B, Hkv, S, Dk) -> (B, Hq, S, Dk)
    # (B, Hq, T, Dk) @ (B, Hq, Dk, S) -> (B, Hq, T, S)
    scores = q @ k.swapaxes(-1, -2) * (1.0 / math.sqrt(q.shape[-1]))
    capped = np.where(allowed, softcap(scores, cap), -np.inf)  # (B, Hq, T, S)
    if sinks is None:
        weights, lse = softmax_and_lse(capped)
    else:
        weights, lse = softmax_with_sinks(capped, sinks)
    return weights @ v, weights, lse[..., 0]  # (B, Hq, T, S) @ (B, Hq, S, Dk) -> (B, Hq, T, Dk)


def softcapped_attention_backward(d_out, q, k, v, cap: float, weights, lse, sinks=None):
    r"""Gradients ``(d_q, d_k, d_v, d_sinks)`` of ``sum(d_out * out)`` for
    :func:`softcapped_attention`, given its ``weights`` and ``lse``.

    The chain, stage by stage backwards: ``out = A V`` gives ``dV = A^T dO`` and
    ``dA = dO V^T``; the softmax gives ``dZc = A * (dA - delta)`` with
    ``delta_i = sum_j a_ij dA_ij = do_i . o_i`` (zero where masked, since ``a_ij = 0``); the cap
    multiplies by ``1 - tanh^2(z / cap)`` (:func:`softcap_backward`); ``z = q k^T / sqrt(Dk)``
    gives ``dQ = dZ K / sqrt(Dk)``, ``dK = dZ^T Q / sqrt(Dk)``. The sink is one more column of
    the softmax, with weight ``exp(s_i - lse_i)`` and no value (its ``dA`` is 0), so
    ``d_sinks_i = -exp(s_i - lse_i) delta_i``, ``(B, Hq, T)`` (None without sinks). Grouped
    heads: ``d_k`` and ``d_v`` sum the gradients of the query heads that share a head.
    """
    B, Hkv, S, Dk = k.shape
    G = q.shape[1] // Hkv
    scale = 1.0 / math.sqrt(Dk)
    k_rep, v_rep = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)  # (B, Hq, S, Dk)
    scores = q @ k_rep.swapaxes(-1, -2) * scale  # recomputed: the cap's slope needs them
    d_v = weights.swapaxes(-1, -2) @ d_out  # (B, Hq, S, T) @ (B, Hq, T, Dk) -> (B, Hq, S, Dk)
    d_weights = d_out @ v_rep.swapaxes(-1, -2)  # (B, Hq, T, Dk) @ (B, Hq, Dk, S) -> (B, Hq, T, S)
    delta = np.sum(weights * d_weights, axis=-1, keepdims=True)  # (B, Hq, T, 1)
    d_capped = weights * (d_weights - delta)  # through the softmax
    d_scores = softcap_backward(d_capped, scores, cap) * scale  # through the cap and the scale
    d_q = d_scores @ k_rep  # (B, Hq, T, S) @ (B, Hq, S, Dk) -> (B, Hq, T, Dk)
    d_k = d_scores.swapaxes(-1, -2) @ q  # (B, Hq, S, T) @ (B, Hq, T, Dk) -> (B, Hq, S, Dk)
    d_sinks = None
    if sinks is not None:
        d_sinks = -np.exp(sinks - lse) * delta[..., 0]  # (B, Hq, T)
    # the query heads of a group share their key/value head: (B, Hq, S, Dk) -> (B, Hkv, S, Dk)
    d_k = d_k.reshape(B, Hkv, G, S, Dk).sum(axis=2)
    d_v = d_v.reshape(B, Hkv, G, S, Dk).sum(axis=2)
    return d_q, d_k, d_v, d_sinks
