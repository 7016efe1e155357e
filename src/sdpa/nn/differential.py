r"""Differential attention (Ye et al. 2024), the attention variant of ``differential=True``.

A differential head computes two softmax maps from two halves of its queries and keys and
subtracts one from the other, so that weight both maps put on the same keys (noise spread over
irrelevant tokens) cancels:

.. code-block:: text

    A1 = softmax(q1 k1^T / sqrt(Dk)),  A2 = softmax(q2 k2^T / sqrt(Dk))     # causal
    lam = exp(lq1 . lk1) - exp(lq2 . lk2) + lam_init                        # per block
    o = rms_norm((A1 - lam A2) [v1, v2]) * (1 - lam_init)                  # over 2 Dk

In :class:`sdpa.nn.DecoderLM` the ``Hq`` heads of width ``Dk`` pair up: heads ``2j`` and
``2j + 1`` are the two halves of differential head ``j`` (their queries ``q1``, ``q2``, their
keys ``k1``, ``k2``, and their values side by side as one value of width ``2 Dk``), and the
normalised output's two halves go back to heads ``2j`` and ``2j + 1`` before ``w_o``. The
parameters are those of the plain model plus four vectors ``lambda_q1``, ``lambda_k1``,
``lambda_q2``, ``lambda_k2`` of length ``Dk`` per block. ``lam_init = 0.8 - 0.6 exp(-0.3 i)``
for block ``i`` (counted from 0). The norm has no gain of its own: one per channel, shared by
the heads, would be absorbed by ``w_o``'s rows.

Shape letters: ``B`` batch, ``Hq`` heads (``H2 = Hq / 2`` differential heads), ``T`` queries,
``S`` keys, ``Dk`` head width.
"""

from __future__ import annotations

import math

import numpy as np

from ..kvcache import KVCache
from ..softmax_stable import softmax_and_lse
from .config import DecoderConfig
from .functional import rms_norm, rms_norm_backward

__all__: list[str] = []  # the model's own machinery: no public names

LAMBDAS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")
EPS = 1e-5  # the per-head norm's epsilon, as the paper's code


def lambda_init(i: int) -> float:
    """``0.8 - 0.6 exp(-0.3 i)``: the paper's initial ``lam`` of block ``i`` (from 0)."""
    return 0.8 - 0.6 * math.exp(-0.3 * i)


def init_lambdas(rng: np.random.Generator, Dk: int, dtype, prefix: str) -> dict:
    """The four vectors of one block, normal with standard deviation 0.1 (the paper's code)."""
    return {prefix + n: (0.1 * rng.standard_normal(Dk)).astype(dtype) for n in LAMBDAS}


def block_lambdas(params: dict, i: int) -> dict:
    """What block ``i``'s attention needs: its four vectors and ``lam_init``."""
    p = f"blocks.{i}.attn."
    return {n: params[p + n] for n in LAMBDAS} | {"init": lambda_init(i)}


def _lam(lams: dict) -> tuple[float, float, float]:
    """``lam`` and its two exponentials."""
    e1 = np.exp(np.dot(lams["lambda_q1"], lams["lambda_k1"]))
    e2 = np.exp(np.dot(lams["lambda_q2"], lams["lambda_k2"]))
    return e1 - e2 + lams["init"], e1, e2


def _maps(q, k, allowed):
    """The two softmax maps ``(B, H2, T, S)`` of the pairs of heads."""
    scale = q.dtype.type(1.0 / math.sqrt(q.shape[-1]))
    maps = []
    for half in (0, 1):  # heads 2j (q1, k1) and 2j + 1 (q2, k2)
        z = q[:, half::2] @ k[:, half::2].swapaxes(-1, -2) * scale
        maps.append(softmax_and_lse(np.where(allowed, z, -np.inf))[0])
    return maps


def _pair_values(v):
    """``(B, Hq, S, Dk) -> (B, H2, S, 2 Dk)``: the two heads' values side by side."""
    return np.concatenate([v[:, 0::2], v[:, 1::2]], axis=-1)


def _unpair(x):
    """``(B, H2, T, 2 Dk) -> (B, Hq, T, Dk)``: halves back to heads ``2j`` and ``2j + 1``."""
    B, H2, T, D2 = x.shape
    out = np.empty((B, 2 * H2, T, D2 // 2), dtype=x.dtype)
    out[:, 0::2], out[:, 1::2] = x[..., : D2 // 2], x[..., D2 // 2 :]
    return out


def differential_attention(q, k, v, lams: dict, allowed: np.ndarray):
    """``(out, diff, saved)``: the output ``(B, Hq, T, Dk)``, the differential maps
    ``A1 - lam A2`` ``(B, H2, T, S)``, and what the backward pass needs."""
    a1, a2 = _maps(q, k, allowed)
    lam, _, _ = _lam(lams)
    diff = a1 - q.dtype.type(lam) * a2
    o = diff @ _pair_values(v)  # (B, H2, T, S) @ (B, H2, S, 2 Dk) -> (B, H2, T, 2 Dk)
    ones = np.ones(o.shape[-1], dtype=o.dtype)
    out = rms_norm(o, ones, eps=EPS) * o.dtype.type(1.0 - lams["init"])
    return _unpair(out), diff, (a1, a2, o)


class DifferentialAttention:
    """Causal differential attention over pairs of heads (:func:`differential_attention`);
    the interface of :class:`sdpa.nn.block_attention.CausalAttention`, with ``sinks`` standing
    for the block's lambda vectors (:func:`block_lambdas`)."""

    def __init__(self, config: DecoderConfig):
        self.config = config

    def forward(self, q, k, v, attn_mask, lams, return_weights: bool, return_lse: bool):
        """``(out, diff, saved)``; ``diff`` the differential maps, ``saved`` for backward."""
        T = q.shape[2]
        allowed = np.tril(np.ones((T, T), dtype=bool)) if attn_mask is None else attn_mask
        return differential_attention(q, k, v, lams, allowed)

    def backward(self, d_out, q, k, v, out, diff, saved, lams):
        """``(d_q, d_k, d_v, d_lams)``, ``d_lams`` a dict of the four vectors' gradients."""
        a1, a2, o = saved
        lam, e1, e2 = _lam(lams)
        d_o = _pair_values(d_out) * o.dtype.type(1.0 - lams["init"])  # (B, H2, T, 2 Dk)
        d_o, _ = rms_norm_backward(d_o, o, np.ones(o.shape[-1], dtype=o.dtype), eps=EPS)
        vp = _pair_values(v)
        d_vp = diff.swapaxes(-1, -2) @ d_o  # (B, H2, S, 2 Dk)
        d_diff = d_o @ vp.swapaxes(-1, -2)  # (B, H2, T, S)
        d_lam = -np.sum(d_diff * a2)
        scale = q.dtype.type(1.0 / math.sqrt(q.shape[-1]))
        d_q, d_k = np.empty_like(q), np.empty_like(k)
        for half, a, d_a in ((0, a1, d_diff), (1, a2, -q.dtype.type(lam) * d_diff)):
            d_z = a * (d_a - np.sum(a * d_a, axis=-1, keepdims=True)) * scale  # softmax
            d_q[:, half::2] = d_z @ k[:, half::2]
            d_k[:, half::2] = d_z.swapaxes(-1, -2) @ q[:, half::2]
        d_lams = {  # lam = exp(lq1 . lk1) - exp(lq2 . lk2) + init
            "lambda_q1": d_lam * e1 * lams["lambda_k1"],
            "lambda_k1": d_lam * e1 * lams["lambda_q1"],
            "lambda_q2": -d_lam * e2 * lams["lambda_k2"],
            "lambda_k2": -d_lam * e2 * lams["lambda_q2"],
        }
        return d_q, d_k, _unpair(d_vp), d_lams

    def decode(self, q, cache: KVCache, i: int, start: int, lams):
        """New queries ``(B, Hq, T, Dk)`` at positions ``start, ...`` over the cached keys."""
        T, S = q.shape[2], start + q.shape[2]
        allowed = np.arange(S) <= start + np.arange(T)[:, None]  # (T, S)
        return differential_attention(q, cache.keys(i), cache.values(i), lams, allowed)[0]
