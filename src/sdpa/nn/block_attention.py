"""The attention inside a :class:`sdpa.nn.DecoderLM` block, as one object per variant.

A block's attention is used three ways: in the forward pass, in the backward pass and in cached
decoding. The plain variant goes through :func:`sdpa.scaled_dot_product_attention`, its
backward and :meth:`sdpa.KVCache.attend`; the soft-capped one (``attn_softcap``) writes the
whole score matrix out, with the cap between the scores and the softmax. The model picks one
of these when it is made (:func:`block_attention`) and calls it, instead of branching on the
option in each of the three places.

Shape letters: ``B`` batch, ``Hq``/``Hkv`` query and key/value heads, ``T`` queries, ``S``
keys, ``Dk`` head width.
"""

from __future__ import annotations

import numpy as np

from ..attention import scaled_dot_product_attention
from ..backward import scaled_dot_product_attention_backward
from ..kvcache import KVCache
from .config import DecoderConfig
from .differential import DifferentialAttention
from .softcap import softcapped_attention, softcapped_attention_backward

__all__: list[str] = []  # the model's own machinery: no public names

# The whole-matrix attention path: a small model's sequences are short, and for them it is
# several times faster than the tiled path.
ATTENTION = "reference"


def _causal(T: int, attn_mask: np.ndarray | None) -> np.ndarray:
    """The allowed ``(T, T)`` entries: ``attn_mask`` (which includes the causal mask) or causal."""
    return np.tril(np.ones((T, T), dtype=bool)) if attn_mask is None else attn_mask


class CausalAttention:
    """Causal attention through :func:`sdpa.scaled_dot_product_attention` (grouped-query when
    ``n_kv_heads < n_heads``), with a learned sink logit per head when given."""

    def __init__(self, config: DecoderConfig):
        self.enable_gqa = config.n_kv_heads != config.n_heads

    def forward(self, q, k, v, attn_mask, sinks, return_weights: bool, return_lse: bool):
        """``(out, weights, lse)`` of ``q`` ``(B, Hq, T, Dk)`` over ``k``, ``v``
        ``(B, Hkv, T, Dk)``, restricted further by ``attn_mask`` (a bool ``(T, T)`` that
        includes the causal mask) when given; weights and lse None unless asked for."""
        result = scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            is_causal=attn_mask is None,
            enable_gqa=self.enable_gqa,
            implementation=ATTENTION,
            return_weights=return_weights,
            return_lse=return_lse,
            sinks=sinks,
        )  # (B, Hq, T, Dk), then the weights (B, Hq, T, T) and lse (B, Hq, T) if asked
        if not isinstance(result, tuple):
            return result, None, None
        return result[0], result[1] if return_weights else None, result[-1] if return_lse else None

    def backward(self, d_out, q, k, v, out, weights, lse, sinks):
        """``(d_q, d_k, d_v, d_sinks)``; ``d_sinks`` ``(Hq,)``, summed over the rows, or None."""
        d_q, d_k, d_v, *d_sinks = scaled_dot_product_attention_backward(
            d_out,
            q,
            k,
            v,
            is_causal=True,
            enable_gqa=self.enable_gqa,
            out=out,
            lse=lse,
            implementation=ATTENTION,
            sinks=sinks,
        )  # with sinks, d_sinks = [(Hq, 1)], summed over the rows that share a logit
        return d_q, d_k, d_v, (d_sinks[0][:, 0] if d_sinks else None)

    def decode(self, q, cache: KVCache, i: int, start: int, sinks):
        """New queries ``(B, Hq, T, Dk)`` at positions ``start, ...`` over layer ``i``'s cached
        keys (which already hold theirs): causal, aligned bottom right."""
        return cache.attend(i, q, sinks=sinks)


class SoftcappedAttention:
    """Causal attention with every score soft-capped, ``z = cap * tanh(z / cap)``, written out
    over the whole ``(T, S)`` matrix (:func:`sdpa.nn.softcap.softcapped_attention`)."""

    def __init__(self, config: DecoderConfig):
        self.cap = config.attn_softcap

    def forward(self, q, k, v, attn_mask, sinks, return_weights: bool, return_lse: bool):
        """As :meth:`CausalAttention.forward`, but always returns the weights and the lse (the
        backward pass needs both)."""
        return softcapped_attention(q, k, v, self.cap, _causal(q.shape[2], attn_mask), sinks)

    def backward(self, d_out, q, k, v, out, weights, lse, sinks):
        """As :meth:`CausalAttention.backward`, through the cap's slope ``1 - tanh^2(z / cap)``."""
        d_q, d_k, d_v, d_sinks = softcapped_attention_backward(
            d_out, q, k, v, self.cap, weights, lse, sinks
        )  # d_sinks: (B, Hq, T), one per row, or None
        return d_q, d_k, d_v, (None if d_sinks is None else d_sinks.sum(axis=(0, 2)))

    def decode(self, q, cache: KVCache, i: int, start: int, sinks):
        """As :meth:`CausalAttention.decode`: new query ``t``, at position ``start + t``, sees
        the keys ``s <= start + t``."""
        T, S = q.shape[2], start + q.shape[2]
        allowed = np.arange(S) <= start + np.arange(T)[:, None]  # (T, S)
        keys, values = cache.keys(i), cache.values(i)  # (B, Hkv, S, Dk)
        return softcapped_attention(q, keys, values, self.cap, allowed, sinks)[0]


def block_attention(config: DecoderConfig):
    """The attention variant ``config`` asks for."""
    if config.differential:
        return DifferentialAttention(config)
    return CausalAttention(config) if config.attn_softcap is None else SoftcappedAttention(config)
