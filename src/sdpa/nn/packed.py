r"""A :class:`sdpa.nn.DecoderLM` pass over packed tokens: many sequences' new tokens at once.

A serving engine runs the model once per step over the new tokens of every request it
schedules (a decode token for some, a chunk of prompt for others), laid end to end in one
array of ``N`` tokens with their positions. Every part of the model that works token by
token (embeddings, norms, projections, RoPE, the gate, the MLP, the logits) runs on the
packed array at once; only the attention is per sequence: the new tokens of a sequence attend
to its past keys and values (read from a paged cache) followed by their own, causally.

The attention goes through the model's own cached-decoding path
(:meth:`DecoderLM.attention.decode <sdpa.nn.block_attention.CausalAttention.decode>`), handed a
view that serves one sequence's keys and values, so every option of the model (sinks, the
soft-capped scores, grouped-query heads) is computed as :meth:`sdpa.nn.DecoderLM.generate`
computes it.

Shape letters: ``N`` packed tokens, ``L`` layers, ``Hq``/``Hkv`` query and key/value heads,
``S`` a sequence's past tokens, ``Dk`` head width, ``E`` model width, ``V`` vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..attention import scaled_dot_product_attention
from ..multihead import merge_heads, split_heads
from ..positional import sinusoidal_positional_encoding
from ..rope import apply_rotary_embedding
from .functional import rms_norm

__all__: list[str] = []  # the engine's machinery: no public names


@dataclass
class Segment:
    """One sequence's new tokens in the packed array: ``tokens[start:stop]``, after ``past``
    tokens whose keys and values are ``past_keys``/``past_values`` ``(L, Hkv, S, Dk)``."""

    start: int
    stop: int
    past_keys: np.ndarray
    past_values: np.ndarray


class _SequenceKV:
    """What ``attention.decode`` reads of a KV cache, for one sequence and the current layer:
    its keys and values ``(1, Hkv, S + T, Dk)`` (past, then the new tokens')."""

    def __init__(self, keys: np.ndarray, values: np.ndarray):
        self._keys, self._values = keys, values

    def keys(self, layer: int) -> np.ndarray:
        return self._keys

    def values(self, layer: int) -> np.ndarray:
        return self._values

    def attend(self, layer: int, q: np.ndarray, sinks=None) -> np.ndarray:
        # As sdpa.KVCache.attend: the new queries are the last T positions (bottom right).
        return scaled_dot_product_attention(
            q,
            self._keys,
            self._values,
            is_causal=True,
            causal_alignment="bottom_right",
            enable_gqa=q.shape[1] != self._keys.shape[1],
            sinks=sinks,
        )


def embed(model, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Token embeddings plus each token's absolute position: ``(1, N, E)``."""
    x = model.params["token_embedding"][tokens][None]  # (N,) -> (1, N, E)
    if model.positional == "learned":
        x = x + model.params["position_embedding"][positions]
    elif model.positional == "sinusoidal":
        table = sinusoidal_positional_encoding(int(positions.max()) + 1, model.d_model)
        x = x + table[positions].astype(model.dtype)
    return x


def qkv(model, i: int, h: np.ndarray, positions: np.ndarray):
    """Block ``i``'s queries ``(1, Hq, N, Dk)``, keys and values ``(1, Hkv, N, Dk)``, each
    token rotated by its own position."""
    p = f"blocks.{i}.attn."
    q = split_heads(h @ model.params[p + "w_q"], model.n_heads)
    k = split_heads(h @ model.params[p + "w_k"], model.n_kv_heads)
    v = split_heads(h @ model.params[p + "w_v"], model.n_kv_heads)
    if model.qk_norm:
        q = rms_norm(q, model.params[p + "q_norm.weight"])
        k = rms_norm(k, model.params[p + "k_norm.weight"])
    if model.positional == "rope":
        q = apply_rotary_embedding(q, positions)
        k = apply_rotary_embedding(k, positions)
    return q, k, v


def packed_forward(
    model,
    tokens: np.ndarray,
    positions: np.ndarray,
    segments: list[Segment],
    logit_rows: np.ndarray,
):
    """One pass of ``model`` over packed tokens.

    Parameters
    ----------
    model : DecoderLM
    tokens, positions : (N,) np.ndarray of int
        The new tokens and their absolute positions (``past + 0, past + 1, ...`` within a
        segment).
    segments : list of Segment
        Covering ``0 .. N`` in order, one per sequence.
    logit_rows : (R,) np.ndarray of int
        The packed rows whose next-token logits are wanted.

    Returns
    -------
    logits : (R, V) np.ndarray
    keys, values : (L, Hkv, N, Dk) np.ndarray
        Every layer's keys (after QK-norm and RoPE) and values of the new tokens, for the
        cache.
    """
    L, Hkv, N, Dk = model.n_layers, model.n_kv_heads, len(tokens), model.head_dim
    new_keys = np.empty((L, Hkv, N, Dk), dtype=model.dtype)
    new_values = np.empty_like(new_keys)
    x = embed(model, tokens, positions)  # (1, N, E)
    for i in range(L):
        p = f"blocks.{i}."
        h = model._norm(x, p + "attn_norm")
        q, k, v = qkv(model, i, h, positions)  # (1, Hq, N, Dk), (1, Hkv, N, Dk)
        new_keys[i], new_values[i] = k[0], v[0]
        out = np.empty_like(q)
        for seg in segments:  # each sequence attends to its own past and new tokens only
            a, b = seg.start, seg.stop
            keys = np.concatenate([seg.past_keys[i], k[0, :, a:b]], axis=1)[None]
            values = np.concatenate([seg.past_values[i], v[0, :, a:b]], axis=1)[None]
            past = seg.past_keys.shape[2]
            view = _SequenceKV(keys, values)
            out[:, :, a:b] = model.attention.decode(q[:, :, a:b], view, i, past, model._sinks(i))
        heads = merge_heads(out)  # (1, N, Hq Dk)
        if model.output_gate:
            heads = heads * model._gate(i, h)
        x = x + heads @ model.params[p + "attn.w_o"]
        if not model.attention_only:
            x = model._mlp(i, x, None)
    logits = model._logits(x[:, logit_rows])[0]  # (R, V)
    return logits, new_keys, new_values
