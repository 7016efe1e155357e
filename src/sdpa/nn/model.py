r"""A decoder-only Transformer language model in NumPy, with hand-written backward passes.

The model is the GPT layout with pre-normalisation: token embedding (plus a positional
encoding), ``n_layers`` blocks, a final normalisation and an unembedding to logits. Each block
updates the *residual stream* ``x`` twice,

.. code-block:: text

    x = x + attention(norm(x))     # causal multi-head attention
    x = x + mlp(norm(x))           # absent when attention_only

The attention goes through :func:`sdpa.scaled_dot_product_attention` and its gradient through
:func:`sdpa.scaled_dot_product_attention_backward`; decoding uses :class:`sdpa.KVCache`.

Six options, all off by default, add what recent models use to keep attention stable or to
let a head attend to nothing: QK-norm (``qk_norm``), soft-capped logits and attention scores
(``logit_softcap``, ``attn_softcap``), a learned sink logit per head (``sink``), a gate on
each head's output (``output_gate``) and differential attention (``differential``). Each is in the forward pass, the exact gradient and the
cached decoding; without them the model is the plain one, bit for bit.

Shape letters: ``B`` batch, ``T`` sequence length, ``E`` model width (``d_model``), ``Hq`` query
heads, ``Hkv`` key/value heads, ``Dk`` head width (``E / Hq``), ``Dff`` MLP width (``d_ff``),
``V`` vocabulary size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

# The public attention API of sdpa, which this model is built on, from the modules that
# define it (never from the package face, which imports sdpa.nn).
from .._checks import check_rng
from ..kvcache import KVCache
from ..multihead import merge_heads, split_heads
from ..positional import sinusoidal_positional_encoding
from ..rope import apply_rotary_embedding
from .block_attention import block_attention
from .config import FIELDS as CONFIG_FIELDS
from .config import DecoderConfig
from .differential import block_lambdas, init_lambdas
from .functional import (
    gelu,
    gelu_backward,
    layer_norm,
    layer_norm_backward,
    linear,
    linear_backward,
    rms_norm,
    rms_norm_backward,
)
from .generation import check_generation, pick_tokens
from .inputs import check_attn_mask, check_flags, check_targets, check_tokens, checked_kv
from .losses import cross_entropy, cross_entropy_backward, embedding_backward
from .softcap import softcap, softcap_backward

__all__ = ["DecoderLM"]

GELU = "tanh"  # the MLP's activation: GPT-2's tanh form of GELU (fast; see sdpa.nn.gelu)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    """``1 / (1 + exp(-z))``, without overflow for either sign of ``z``."""
    e = np.exp(-np.abs(z))  # in (0, 1]
    return np.where(z >= 0, 1.0, e) / (1.0 + e)


@dataclass
class _BlockCache:
    """What one block's backward pass needs from its forward pass (None: not needed)."""

    x_in: np.ndarray  # (B, T, E) stream entering the block
    h: np.ndarray  # (B, T, E) normalised input of the attention
    q_raw: np.ndarray | None = None  # (B, Hq, T, Dk) queries before QK-norm (qk_norm only)
    k_raw: np.ndarray | None = None  # (B, Hkv, T, Dk) keys before QK-norm (qk_norm only)
    q: np.ndarray | None = None  # (B, Hq, T, Dk) after RoPE
    k: np.ndarray | None = None  # (B, Hkv, T, Dk) after RoPE
    v: np.ndarray | None = None  # (B, Hkv, T, Dk)
    out: np.ndarray | None = None  # (B, Hq, T, Dk) attention output
    lse: np.ndarray | None = None  # (B, Hq, T) its log-sum-exp
    weights: np.ndarray | None = None  # (B, Hq, T, T) attention weights (attn_softcap only)
    heads: np.ndarray | None = None  # (B, T, Hq * Dk) merged heads (gated), the input of w_o
    gate: np.ndarray | None = None  # (B, T, Hq * Dk) the output gate (output_gate only)
    x_mid: np.ndarray | None = None  # (B, T, E) stream after the attention
    h2: np.ndarray | None = None  # (B, T, E) normalised input of the MLP
    u: np.ndarray | None = None  # (B, T, Dff) pre-activation
    g: np.ndarray | None = None  # (B, T, Dff) activation


class DecoderLM:
    r"""A decoder-only Transformer language model whose only state is a dict of arrays.

    Parameters
    ----------
    config : DecoderConfig, optional
        The sizes and options (:class:`sdpa.nn.DecoderConfig`, where each is documented).
    rng : numpy.random.Generator
        Source of the initial parameters.
    **options
        Instead of ``config``: its fields as keywords (``vocab_size=``, ``d_model=``,
        ``n_layers=``, ``n_heads=``, ``max_len=`` and any of the optional ones), from which the
        model makes its config.

    Attributes
    ----------
    config : DecoderConfig
        The sizes and options, checked. Each field (and ``head_dim``) also reads as an
        attribute of the model: ``model.d_model`` is ``model.config.d_model``.
    params : dict of str to np.ndarray
        Every parameter, by name; the model's only state (see Notes). Replace or modify the
        arrays to change the model; :class:`sdpa.nn.AdamW` updates them in place.
    attention : CausalAttention or SoftcappedAttention
        The blocks' attention variant (``sdpa.nn.block_attention``), chosen from
        ``attn_softcap``: its forward pass, backward pass and cached decoding.

    Raises
    ------
    TypeError
        If both ``config`` and keyword options are given, ``config`` is not a
        ``DecoderConfig``, ``rng`` is not a ``numpy.random.Generator``, or an option is of the
        wrong kind (see :class:`sdpa.nn.DecoderConfig`).
    ValueError
        If an option's value is invalid (see :class:`sdpa.nn.DecoderConfig`).

    Notes
    -----
    **Parameters** (``i`` the block index; the ``.bias`` of a norm exists only for
    ``norm="layer"``, the MLP only without ``attention_only``):

    ==================================  ========================  ====================================
    name                                shape                     role
    ==================================  ========================  ====================================
    ``token_embedding``                 ``(V, E)``                row ``t``: the vector of token ``t``
    ``position_embedding``              ``(max_len, E)``          learned positions only
    ``blocks.i.attn_norm.weight/bias``  ``(E,)``                  norm before the attention
    ``blocks.i.attn.w_q``               ``(E, Hq Dk)``            queries; head ``h`` in columns
                                                                  ``h Dk : (h+1) Dk``
    ``blocks.i.attn.w_k``, ``w_v``      ``(E, Hkv Dk)``           keys and values
    ``blocks.i.attn.w_o``               ``(Hq Dk, E)``            heads to the stream; head ``h``
                                                                  in rows ``h Dk : (h+1) Dk``
    ``blocks.i.attn.q_norm.weight``     ``(Dk,)``                 ``qk_norm`` only: the gain of
                                                                  every head's query norm
    ``blocks.i.attn.k_norm.weight``     ``(Dk,)``                 the same for the keys
    ``blocks.i.attn.sink``              ``(Hq,)``                 ``sink`` only: each head's sink
                                                                  logit, zero at first
    ``blocks.i.attn.w_g``               ``(E, Hq Dk)``            ``output_gate`` only: the gate
                                                                  ``sigmoid(h W_g)`` of the heads
    ``blocks.i.mlp_norm.weight/bias``   ``(E,)``                  norm before the MLP
    ``blocks.i.mlp.w_in``, ``b_in``     ``(E, Dff)``, ``(Dff,)``  ``u = h W_in + b_in``
    ``blocks.i.mlp.w_out``, ``b_out``   ``(Dff, E)``, ``(E,)``    ``gelu(u) W_out + b_out``
    ``final_norm.weight/bias``          ``(E,)``                  norm before the unembedding
    ``unembedding``                     ``(E, V)``                stream to logits
    ==================================  ========================  ====================================

    Zeroing rows ``h Dk : (h+1) Dk`` of ``w_o`` removes head ``h``'s contribution exactly
    (an ablation).

    **Initialisation.** Embeddings are standard normal; every other matrix is normal with
    variance ``1 / fan_in``, and the two matrices that write into the stream (``w_o``,
    ``w_out``) are further divided by ``sqrt(2 n_layers)`` so that the stream's variance
    does not grow with depth (GPT-2's rule); norm gains are one and biases zero. The
    options' parameters: QK-norm gains one, sink logits zero, and ``w_g`` normal with variance
    ``1 / E``, drawn after every other parameter, so that a model with options starts from
    the same values of the shared parameters as the plain model of the same ``rng`` seed.

    **Attention** is causal multi-head attention without biases, scaled by ``1 / sqrt(Dk)``,
    on the whole-matrix path of :func:`sdpa.scaled_dot_product_attention`
    (``implementation="reference"``), the fastest for the short sequences of a small model;
    with ``attn_softcap``, the same whole-matrix computation written out in NumPy, with the
    cap between the scores and the softmax. In one block, with every option on:

    .. code-block:: text

        q, k, v = h W_q, h W_k, h W_v                    # split into heads
        q, k = rms_norm(q) * g_q, rms_norm(k) * g_k      # qk_norm, over Dk
        q, k = rope(q), rope(k)
        z = cap * tanh(q k^T / sqrt(Dk) / cap)           # attn_softcap
        a = exp(z) / (sum exp(z) + exp(sink))            # causal; sink: not normalised to 1
        x = x + (merge_heads(a v) * sigmoid(h W_g)) W_o  # output_gate

    and at the end ``logits = cap * tanh(logits / cap)`` (``logit_softcap``). The MLP's
    activation is the ``tanh`` form of GELU, as in GPT-2.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa.nn import DecoderLM
    >>> model = DecoderLM(vocab_size=11, d_model=16, n_layers=2, n_heads=4, max_len=8,
    ...                   rng=np.random.default_rng(0))
    >>> tokens = np.array([[1, 2, 3, 4, 5]])                    # (B=1, T=5)
    >>> logits, attention = model.forward(tokens, return_attention=True)
    >>> logits.shape, len(attention), attention[0].shape      # (B, T, V); (B, H, T, T)
    ((1, 5, 11), 2, (1, 4, 5, 5))
    >>> bool(np.all(np.triu(attention[0][0, 0], k=1) == 0))  # causal: no weight on the future
    True
    >>> # embedding V E; per block 2 norms (2 x 2E), w_q w_k w_v w_o (4 E^2), MLP (2 E Dff + Dff + E);
    >>> # final norm 2E; unembedding E V, with V = 11, E = 16, Dff = 64:
    >>> sum(p.size for p in model.params.values())
    6816

    The options add parameters to each block's attention (QK-norm gains of size ``Dk``, a
    sink per head, the gate's matrix) and leave the others as they were:

    >>> steady = DecoderLM(vocab_size=11, d_model=16, n_layers=2, n_heads=4, max_len=8,
    ...                    qk_norm=True, logit_softcap=15.0, attn_softcap=50.0, sink=True,
    ...                    output_gate=True, rng=np.random.default_rng(0))
    >>> {name: p.shape for name, p in steady.params.items() if name not in model.params}
    ... # doctest: +NORMALIZE_WHITESPACE
    {'blocks.0.attn.q_norm.weight': (4,), 'blocks.0.attn.k_norm.weight': (4,),
     'blocks.0.attn.sink': (4,), 'blocks.0.attn.w_g': (16, 16),
     'blocks.1.attn.q_norm.weight': (4,), 'blocks.1.attn.k_norm.weight': (4,),
     'blocks.1.attn.sink': (4,), 'blocks.1.attn.w_g': (16, 16)}
    >>> all(np.array_equal(steady.params[name], p) for name, p in model.params.items())
    True
    >>> float(np.abs(steady.forward(tokens)).max()) < 15.0  # the capped logits
    True
    """

    def __init__(self, config: DecoderConfig | None = None, *, rng: np.random.Generator, **options):
        if config is None:
            config = DecoderConfig(**options)
        elif options:
            raise TypeError(
                f"give DecoderLM a config or its options as keywords, not both; got config and "
                f"{sorted(options)}"
            )
        elif not isinstance(config, DecoderConfig):
            raise TypeError(f"config must be a DecoderConfig; got {config!r:.80}")
        self.config = config
        self.attention = block_attention(config)  # the attention variant of every block
        self.params = self._init_params(check_rng(rng))

    def __getattr__(self, name: str):
        # Called only when normal lookup fails: the config's fields read as the model's own.
        config = self.__dict__.get("config")
        if config is not None and name in CONFIG_FIELDS:
            return getattr(config, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        options = "".join(f", {name}={value!r}" for name, value in self.config.options.items())
        return (
            f"DecoderLM(vocab_size={self.vocab_size}, d_model={self.d_model}, "
            f"n_layers={self.n_layers}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, "
            f"d_ff={self.d_ff}, max_len={self.max_len}, positional={self.positional!r}, "
            f"norm={self.norm!r}, attention_only={self.attention_only}, "
            f"dtype={self.dtype.name}{options})"
        )

    # -- parameters ----------------------------------------------------------------------------

    def _init_params(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        E, V, Dk, L = self.d_model, self.vocab_size, self.head_dim, self.n_layers
        residual = 1.0 / np.sqrt(2 * L)  # the writers into the stream, GPT-2's rule

        def normal(shape, std=1.0):
            return (std * rng.standard_normal(shape)).astype(self.dtype)

        def matrix(fan_in, fan_out, gain=1.0):
            return normal((fan_in, fan_out), gain / np.sqrt(fan_in))

        params = {"token_embedding": normal((V, E))}
        if self.positional == "learned":
            params["position_embedding"] = normal((self.max_len, E))
        for i in range(L):
            p = f"blocks.{i}."
            params.update(self._norm_params(p + "attn_norm"))
            params[p + "attn.w_q"] = matrix(E, self.n_heads * Dk)
            params[p + "attn.w_k"] = matrix(E, self.n_kv_heads * Dk)
            params[p + "attn.w_v"] = matrix(E, self.n_kv_heads * Dk)
            params[p + "attn.w_o"] = matrix(self.n_heads * Dk, E, residual)
            if self.qk_norm:  # gains over Dk, shared by the heads
                params[p + "attn.q_norm.weight"] = np.ones(Dk, self.dtype)
                params[p + "attn.k_norm.weight"] = np.ones(Dk, self.dtype)
            if self.sink:  # one logit per query head; exp(0) = 1 is "softmax plus one"
                params[p + "attn.sink"] = np.zeros(self.n_heads, self.dtype)
            if self.output_gate:
                params[p + "attn.w_g"] = None  # its place in the order; drawn below
            if not self.attention_only:
                params.update(self._norm_params(p + "mlp_norm"))
                params[p + "mlp.w_in"] = matrix(E, self.d_ff)
                params[p + "mlp.b_in"] = np.zeros(self.d_ff, self.dtype)
                params[p + "mlp.w_out"] = matrix(self.d_ff, E, residual)
                params[p + "mlp.b_out"] = np.zeros(E, self.dtype)
        params.update(self._norm_params("final_norm"))
        params["unembedding"] = matrix(E, V)
        # The options' random parameters are drawn last, so that a model with options starts
        # from the same values of the shared parameters as the plain model of the same seed.
        for i in range(L if self.output_gate else 0):
            params[f"blocks.{i}.attn.w_g"] = matrix(E, self.n_heads * Dk)
        for i in range(L if self.differential else 0):
            params.update(init_lambdas(rng, Dk, self.dtype, f"blocks.{i}.attn."))
        return params

    def _norm_params(self, prefix: str) -> dict[str, np.ndarray]:
        out = {prefix + ".weight": np.ones(self.d_model, self.dtype)}
        if self.norm == "layer":
            out[prefix + ".bias"] = np.zeros(self.d_model, self.dtype)
        return out

    # -- building blocks -----------------------------------------------------------------------

    def _norm(self, x: np.ndarray, prefix: str) -> np.ndarray:
        w = self.params[prefix + ".weight"]
        if self.norm == "layer":
            return layer_norm(x, w, self.params[prefix + ".bias"])
        return rms_norm(x, w)

    def _norm_backward(self, d_y, x, prefix: str, grads: dict) -> np.ndarray:
        w = self.params[prefix + ".weight"]
        if self.norm == "layer":
            d_x, grads[prefix + ".weight"], grads[prefix + ".bias"] = layer_norm_backward(
                d_y, x, w, self.params[prefix + ".bias"]
            )
        else:
            d_x, grads[prefix + ".weight"] = rms_norm_backward(d_y, x, w)
        return d_x

    def _embed(self, tokens: np.ndarray, start: int) -> np.ndarray:
        """Token embeddings plus absolute positions ``start, start + 1, ...``: ``(B, T, E)``."""
        x = self.params["token_embedding"][tokens]  # (B, T) -> (B, T, E), a copy
        T = tokens.shape[1]
        if self.positional == "learned":
            x = x + self.params["position_embedding"][start : start + T]
        elif self.positional == "sinusoidal":
            table = sinusoidal_positional_encoding(start + T, self.d_model)[start:]
            x = x + table.astype(self.dtype)
        return x

    def _qkv(self, i: int, h: np.ndarray, start: int, cache: _BlockCache | None = None):
        """Queries ``(B, Hq, T, Dk)``, keys and values ``(B, Hkv, T, Dk)`` of block ``i``;
        fills ``cache`` when given."""
        p = f"blocks.{i}.attn."
        # (B, T, E) @ (E, Hq Dk) -> (B, T, Hq Dk) -> (B, Hq, T, Dk); keys and values with Hkv
        q = split_heads(h @ self.params[p + "w_q"], self.n_heads)
        k = split_heads(h @ self.params[p + "w_k"], self.n_kv_heads)
        v = split_heads(h @ self.params[p + "w_v"], self.n_kv_heads)
        if self.qk_norm:  # every query and key to RMS one over Dk, times a learned gain
            if cache is not None:
                cache.q_raw, cache.k_raw = q, k
            q = rms_norm(q, self.params[p + "q_norm.weight"])
            k = rms_norm(k, self.params[p + "k_norm.weight"])
        if self.positional == "rope":
            positions = np.arange(start, start + h.shape[1])
            q = apply_rotary_embedding(q, positions)
            k = apply_rotary_embedding(k, positions)
        return q, k, v

    def _mlp(self, i: int, x: np.ndarray, cache: _BlockCache | None) -> np.ndarray:
        """``x + mlp(norm(x))`` for block ``i``; fills ``cache`` when given."""
        p = f"blocks.{i}."
        h2 = self._norm(x, p + "mlp_norm")
        u = linear(h2, self.params[p + "mlp.w_in"], self.params[p + "mlp.b_in"])  # (B, T, Dff)
        g = gelu(u, approximate=GELU)
        if cache is not None:
            cache.x_mid, cache.h2, cache.u, cache.g = x, h2, u, g
        return x + linear(g, self.params[p + "mlp.w_out"], self.params[p + "mlp.b_out"])

    # -- forward -------------------------------------------------------------------------------

    def _forward(
        self,
        tokens: np.ndarray,
        *,
        keep: bool,
        return_attention: bool,
        kv_transform=None,
        attn_mask: np.ndarray | None = None,
        scores: list | None = None,
    ):
        """Logits ``(B, T, V)``, the final stream and per-block caches / attention weights;
        each block's scores appended to ``scores`` when given."""
        x = self._embed(tokens, 0)
        if attn_mask is not None:  # the causal mask and the caller's, combined
            T = tokens.shape[1]
            attn_mask = attn_mask & np.tril(np.ones((T, T), dtype=bool))
        caches, weights = [], []
        for i in range(self.n_layers):
            p = f"blocks.{i}."
            h = self._norm(x, p + "attn_norm")
            cache = _BlockCache(x, h) if keep else None
            q, k, v = self._qkv(i, h, 0, cache)
            if kv_transform is not None:
                k, v = checked_kv(kv_transform, i, k, v, self.dtype)
            if scores is not None:
                scores.append(self._scores(q, k, attn_mask))
            # (B, Hq, T, Dk); the weights (B, Hq, T, T) and the lse (B, Hq, T), or None
            out, a, lse = self.attention.forward(
                q, k, v, attn_mask, self._sinks(i), return_attention, keep
            )
            if return_attention:
                weights.append(a)
            heads = merge_heads(out)  # (B, Hq, T, Dk) -> (B, T, Hq Dk)
            gate = self._gate(i, h) if self.output_gate else None
            if gate is not None:
                heads = heads * gate  # (B, T, Hq Dk), elementwise
            if keep:
                cache.q, cache.k, cache.v, cache.out, cache.lse = q, k, v, out, lse
                cache.weights, cache.heads, cache.gate = a, heads, gate
            x = x + heads @ self.params[p + "attn.w_o"]  # (B, T, Hq Dk) @ (Hq Dk, E)
            if not self.attention_only:
                x = self._mlp(i, x, cache)
            caches.append(cache)
        return self._logits(x), x, caches, weights

    @staticmethod
    def _scores(q: np.ndarray, k: np.ndarray, attn_mask: np.ndarray | None) -> np.ndarray:
        """The scaled scores ``q k^T / sqrt(Dk)`` ``(B, Hq, T, T)``, -inf where masked."""
        T = q.shape[2]
        k = np.repeat(k, q.shape[1] // k.shape[1], axis=1)  # (B, Hkv, T, Dk) -> (B, Hq, T, Dk)
        z = q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1]).astype(q.dtype)  # (B, Hq, T, T)
        allowed = np.tril(np.ones((T, T), dtype=bool)) if attn_mask is None else attn_mask
        return np.where(allowed, z, q.dtype.type(-np.inf))

    def _gate(self, i: int, h: np.ndarray) -> np.ndarray:
        """Block ``i``'s output gate ``sigmoid(h W_g)``, ``(B, T, Hq Dk)``."""
        return _sigmoid(h @ self.params[f"blocks.{i}.attn.w_g"])  # (B, T, E) @ (E, Hq Dk)

    def _sinks(self, i: int) -> np.ndarray | dict | None:
        """Block ``i``'s sink logits as ``sinks=`` takes them, ``(Hq, 1)``; None without; with
        ``differential``, its lambda vectors instead (``sdpa.nn.differential``)."""
        if self.differential:
            return block_lambdas(self.params, i)
        return self.params[f"blocks.{i}.attn.sink"][:, None] if self.sink else None

    def _logits(self, x: np.ndarray) -> np.ndarray:
        """The final norm, the unembedding and the logits' soft-cap: ``(B, T, E) -> (B, T, V)``."""
        h_final = self._norm(x, "final_norm")
        logits = h_final @ self.params["unembedding"]  # (B, T, E) @ (E, V) -> (B, T, V)
        if self.logit_softcap is not None:
            logits = softcap(logits, self.logit_softcap)
        return logits

    def forward(
        self,
        tokens: ArrayLike,
        *,
        return_attention: bool = False,
        return_scores: bool = False,
        kv_transform=None,
        attn_mask: ArrayLike | None = None,
    ):
        """Logits of the next token at every position.

        Parameters
        ----------
        tokens : (B, T) or (T,) array_like of int
            Token ids in ``[0, vocab_size)``, with ``1 <= T <= max_len``.
        return_attention : bool, default False
            Also return the attention weights of every block.
        return_scores : bool, default False
            Also return the scores that enter every block's softmax,
            ``q k^T / sqrt(Dk)`` (after QK-norm and RoPE, before ``attn_softcap``), ``-inf``
            where masked: to watch the logits grow in training.
        kv_transform : callable, optional
            ``kv_transform(layer, k, v) -> (k, v)``, applied to every block's keys and values
            ``(B, Hkv, T, Dk)`` (after QK-norm and RoPE) before its attention: to measure what changing the
            cache (quantising it, perturbing it) does to the model. It gets copies, and must
            return arrays of the same shapes.
        attn_mask : (T, T) array_like of bool, optional
            Which keys each query may attend to, on top of the causal mask (``True``: may):
            a window, a set of kept tokens. Every row must keep at least one key.

        Returns
        -------
        logits : (B, T, V) np.ndarray
            ``logits[b, t]`` scores the token that follows ``tokens[b, :t + 1]``
            (``(T, V)`` for 1-D tokens).
        attention : list of (B, Hq, T, T) np.ndarray
            Only with ``return_attention``: one array per block, each row a causal
            distribution over the keys (``(Hq, T, T)`` for 1-D tokens); with ``sink``, each
            row sums to one minus the sink's weight.
        scores : list of (B, Hq, T, T) np.ndarray
            Only with ``return_scores``: one array per block, after ``attention`` when both
            are asked for.

        Raises
        ------
        TypeError
            If ``tokens`` is not an integer array, ``return_attention`` or ``return_scores``
            not a bool,
            ``kv_transform`` not callable or it does not return a pair.
        ValueError
            If ``tokens`` is not 1-D or 2-D, is empty, longer than ``max_len``, or holds an
            id outside ``[0, vocab_size)``; if ``attn_mask`` is not a boolean ``(T, T)`` array
            or leaves a query no key; if ``kv_transform`` changes a shape.

        Examples
        --------
        >>> import numpy as np
        >>> from sdpa.nn import DecoderLM
        >>> model = DecoderLM(vocab_size=7, d_model=8, n_layers=1, n_heads=2, max_len=6,
        ...                   rng=np.random.default_rng(0))
        >>> logits = model.forward(np.array([3, 1, 4]))
        >>> logits.shape
        (3, 7)
        >>> # causal: the logits at position 0 do not depend on the later tokens
        >>> bool(np.allclose(model.forward(np.array([3, 5, 6]))[0], logits[0]))
        True
        """
        check_flags(kv_transform, return_attention=return_attention, return_scores=return_scores)
        tokens, one_d = check_tokens(tokens, "tokens", self.config)
        mask = check_attn_mask(attn_mask, tokens.shape[1])
        scores = [] if return_scores else None
        logits, _, _, weights = self._forward(
            tokens,
            keep=False,
            return_attention=return_attention,
            kv_transform=kv_transform,
            attn_mask=mask,
            scores=scores,
        )
        if one_d:
            logits, weights = logits[0], [w[0] for w in weights]
            scores = None if scores is None else [z[0] for z in scores]
        result = (
            (logits,)
            + ((weights,) if return_attention else ())
            + ((scores,) if return_scores else ())
        )
        return result if len(result) > 1 else logits

    # -- training ------------------------------------------------------------------------------

    def loss_and_grads(self, tokens: ArrayLike, targets: ArrayLike):
        r"""The mean cross-entropy of ``targets`` given ``tokens``, and its gradient.

        Parameters
        ----------
        tokens : (B, T) or (T,) array_like of int
            Inputs, as in :meth:`forward`.
        targets : array_like of int
            The shape of ``tokens``: the token expected at each position (for language
            modelling, ``tokens`` shifted left by one).

        Returns
        -------
        loss : float
            :func:`sdpa.nn.cross_entropy` of the logits and the targets, in nats.
        grads : dict of str to np.ndarray
            The gradient of ``loss`` with respect to every parameter, keyed and shaped like
            ``params``.

        Raises
        ------
        TypeError
            If ``tokens`` or ``targets`` is not an integer array.
        ValueError
            As :meth:`forward`; also if ``targets`` does not have the shape of ``tokens`` or
            holds an id outside ``[0, vocab_size)``.

        Notes
        -----
        The backward pass runs the forward pass in reverse, one hand-derived rule per step
        (``sdpa.nn.functional``, ``sdpa.nn.softcap``, ``sdpa.nn.losses``), and the attention through
        :func:`sdpa.scaled_dot_product_attention_backward`, which reuses the forward output
        and log-sum-exp instead of recomputing them (with ``attn_softcap``, through the
        written-out attention's own backward, which adds the cap's slope
        ``1 - tanh^2(z / cap)`` between the softmax and the scores). The sink's gradient is
        ``-sum over rows of a_sink * delta``, with ``a_sink`` the sink's weight and
        ``delta_i = do_i . o_i``; the gate's, through ``sigmoid' = gate (1 - gate)``. RoPE is a rotation, so its backward is
        the rotation by the opposite angle. Parameters shared by all positions (every one)
        receive the sum of the gradients of all their uses.

        Examples
        --------
        One gradient entry checked against a central difference:

        >>> import numpy as np
        >>> from sdpa.nn import DecoderLM
        >>> model = DecoderLM(vocab_size=5, d_model=8, n_layers=1, n_heads=2, max_len=4,
        ...                   rng=np.random.default_rng(0))
        >>> tokens, targets = np.array([[0, 1, 2, 3]]), np.array([[1, 2, 3, 4]])
        >>> loss, grads = model.loss_and_grads(tokens, targets)
        >>> w = model.params["blocks.0.attn.w_q"]
        >>> w[2, 3] += 1e-6; up = model.loss_and_grads(tokens, targets)[0]
        >>> w[2, 3] -= 2e-6; down = model.loss_and_grads(tokens, targets)[0]
        >>> w[2, 3] += 1e-6
        >>> bool(np.isclose(grads["blocks.0.attn.w_q"][2, 3], (up - down) / 2e-6, rtol=1e-6))
        True
        """
        tokens, _ = check_tokens(tokens, "tokens", self.config)
        targets = check_targets(targets, tokens)
        logits, x, caches, _ = self._forward(tokens, keep=True, return_attention=False)
        loss = cross_entropy(logits, targets)  # checks the range of the targets
        grads: dict[str, np.ndarray] = {}

        # soft-cap, unembedding and final norm
        d_logits = cross_entropy_backward(logits, targets)  # (B, T, V)
        h_final = self._norm(x, "final_norm")
        if self.logit_softcap is not None:  # back through the cap, at the logits before it
            raw = h_final @ self.params["unembedding"]
            d_logits = softcap_backward(d_logits, raw, self.logit_softcap)
        d_h, grads["unembedding"], _ = linear_backward(
            d_logits, h_final, self.params["unembedding"]
        )
        d_x = self._norm_backward(d_h, x, "final_norm", grads)

        for i in reversed(range(self.n_layers)):
            d_x = self._block_backward(i, d_x, caches[i], grads)

        # embeddings
        grads["token_embedding"] = embedding_backward(d_x, tokens, self.vocab_size)
        if self.positional == "learned":
            d_pos = np.zeros_like(self.params["position_embedding"])
            d_pos[: tokens.shape[1]] = d_x.sum(axis=0)  # every sequence uses rows 0..T-1
            grads["position_embedding"] = d_pos
        return loss, {name: grads[name] for name in self.params}

    def _block_backward(self, i: int, d_x: np.ndarray, c: _BlockCache, grads: dict) -> np.ndarray:
        """Given ``dL/dx`` at the output of block ``i``, fill its grads; return ``dL/dx_in``."""
        p = f"blocks.{i}."
        if not self.attention_only:  # x = x_mid + gelu(u) W_out + b_out
            d_g, grads[p + "mlp.w_out"], grads[p + "mlp.b_out"] = linear_backward(
                d_x, c.g, self.params[p + "mlp.w_out"], self.params[p + "mlp.b_out"]
            )
            d_u = gelu_backward(d_g, c.u, approximate=GELU)
            d_h2, grads[p + "mlp.w_in"], grads[p + "mlp.b_in"] = linear_backward(
                d_u, c.h2, self.params[p + "mlp.w_in"], self.params[p + "mlp.b_in"]
            )
            d_x = d_x + self._norm_backward(d_h2, c.x_mid, p + "mlp_norm", grads)
        # x_mid = x_in + heads W_o, heads = merge_heads(out) * gate with the output gate
        d_heads, grads[p + "attn.w_o"], _ = linear_backward(
            d_x, c.heads, self.params[p + "attn.w_o"]
        )
        d_h = np.zeros_like(c.h)
        if self.output_gate:  # gate = sigmoid(h W_g), whose slope is gate (1 - gate)
            d_z = d_heads * merge_heads(c.out) * c.gate * (1.0 - c.gate)  # (B, T, Hq Dk)
            d_h, grads[p + "attn.w_g"], _ = linear_backward(d_z, c.h, self.params[p + "attn.w_g"])
            d_heads = d_heads * c.gate
        d_out = split_heads(d_heads, self.n_heads)  # (B, T, Hq Dk) -> (B, Hq, T, Dk)
        d_q, d_k, d_v, d_sinks = self.attention.backward(
            d_out, c.q, c.k, c.v, c.out, c.weights, c.lse, self._sinks(i)
        )
        if self.sink:
            grads[p + "attn.sink"] = d_sinks
        if self.differential:  # the gradients of the four lambda vectors
            grads.update({p + "attn." + name: d for name, d in d_sinks.items()})
        if self.positional == "rope":  # the transpose of a rotation is the opposite rotation
            back = -np.arange(c.q.shape[2])
            d_q = apply_rotary_embedding(d_q, back)
            d_k = apply_rotary_embedding(d_k, back)
        if self.qk_norm:  # back through the norms to the raw projections; the gains' grads
            d_q, grads[p + "attn.q_norm.weight"] = rms_norm_backward(
                d_q, c.q_raw, self.params[p + "attn.q_norm.weight"]
            )
            d_k, grads[p + "attn.k_norm.weight"] = rms_norm_backward(
                d_k, c.k_raw, self.params[p + "attn.k_norm.weight"]
            )
        for name, d in (("w_q", d_q), ("w_k", d_k), ("w_v", d_v)):
            d_in, grads[p + "attn." + name], _ = linear_backward(
                merge_heads(d), c.h, self.params[p + "attn." + name]
            )
            d_h += d_in
        return d_x + self._norm_backward(d_h, c.x_in, p + "attn_norm", grads)

    # -- generation ----------------------------------------------------------------------------

    def _new_cache(self, B: int, capacity: int) -> KVCache:
        """An empty KV cache for ``B`` sequences of up to ``capacity`` tokens."""
        return KVCache(
            self.n_layers,
            self.n_kv_heads,
            self.head_dim,
            batch_size=B,
            dtype=self.dtype,
            capacity=capacity,
        )

    def _forward_cached(self, tokens: np.ndarray, cache: KVCache, start: int) -> np.ndarray:
        """Logits of the new ``tokens`` ``(B, T)`` at positions ``start, ...``; fills ``cache``."""
        x = self._embed(tokens, start)
        for i in range(self.n_layers):
            p = f"blocks.{i}."
            h = self._norm(x, p + "attn_norm")
            q, k, v = self._qkv(i, h, start)
            cache.append(i, k, v)  # the cache now holds S = start + T keys
            out = self.attention.decode(q, cache, i, start, self._sinks(i))  # (B, Hq, T, Dk)
            heads = merge_heads(out)  # (B, Hq, T, Dk) -> (B, T, Hq Dk)
            if self.output_gate:
                heads = heads * self._gate(i, h)
            x = x + heads @ self.params[p + "attn.w_o"]
            if not self.attention_only:
                x = self._mlp(i, x, None)
        return self._logits(x)

    def generate(
        self,
        prompt: ArrayLike,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        rng: np.random.Generator | None = None,
        use_cache: bool = True,
    ) -> np.ndarray:
        """Continue ``prompt`` by ``max_new_tokens`` tokens, one at a time.

        Parameters
        ----------
        prompt : (B, T0) or (T0,) array_like of int
            Token ids to continue, ``T0 >= 1``.
        max_new_tokens : int
            How many tokens to append; ``T0 + max_new_tokens`` must not exceed ``max_len``.
        temperature : float, default 1.0
            Divides the logits before sampling; ``0`` picks the most likely token (greedy),
            and a tiny positive one (even ``5e-324``) samples as its limit, see Notes.
        top_k : int, optional
            Sample only among the ``top_k`` most likely tokens: exactly ``top_k`` of them,
            ties broken by the lowest token id, see Notes.
        rng : numpy.random.Generator, optional
            Source of the samples; required when ``temperature > 0``.
        use_cache : bool, default True
            Keep every layer's keys and values in a :class:`sdpa.KVCache` and run the model
            on the new token only (the prompt at once, first). Without it, every step runs the
            model on the whole sequence so far. Both give the same tokens, with every option
            (the cache holds the keys after QK-norm and RoPE; the soft-capped attention reads
            them back from it).

        Returns
        -------
        tokens : (B, T0 + max_new_tokens) np.ndarray of int
            The prompt followed by the generated tokens (1-D for a 1-D prompt).

        Raises
        ------
        TypeError
            If ``prompt`` is not an integer array, ``max_new_tokens`` or ``top_k`` is not an
            integer, ``temperature`` is not a real number, ``use_cache`` is not a bool, or
            ``rng`` is missing or not a ``numpy.random.Generator`` when sampling.
        ValueError
            If ``prompt`` is invalid (as in :meth:`forward`), the result would be longer than
            ``max_len``, ``temperature`` is negative or not finite, or ``top_k`` is outside
            ``[1, vocab_size]``.

        Notes
        -----
        **Ties** are broken by the lowest token id, as a stable sort of the logits in
        decreasing order (``np.argsort(-logits, kind="stable")``) ranks them: ``top_k`` keeps
        the first ``top_k`` tokens of that order, so that exactly ``top_k`` survive even when
        several share the ``top_k``-th largest logit, and ``temperature=0`` takes the first
        (``np.argmax``). Sampling gives tokens with equal logits equal chances.

        **Small temperatures.** Each row's largest logit is subtracted before the division by
        ``temperature``, so the scaled logits are ``<= 0`` and cannot overflow: as
        ``temperature`` tends to 0, every token but those with the largest logit gets
        probability 0, and sampling becomes greedy. Tokens tied for the largest logit stay
        equally likely, as they are in the limit; only ``temperature=0`` takes the lowest id.

        Examples
        --------
        >>> import numpy as np
        >>> from sdpa.nn import DecoderLM
        >>> model = DecoderLM(vocab_size=7, d_model=8, n_layers=2, n_heads=2, max_len=10,
        ...                   rng=np.random.default_rng(0))
        >>> prompt = np.array([1, 2, 3])
        >>> out = model.generate(prompt, 5, temperature=0)  # greedy
        >>> out.shape
        (8,)
        >>> bool(np.array_equal(out, model.generate(prompt, 5, temperature=0, use_cache=False)))
        True
        """
        tokens, one_d = check_tokens(prompt, "prompt", self.config)
        n_new = check_generation(
            self.config, tokens.shape[1], max_new_tokens, temperature, top_k, rng, use_cache
        )
        B, T0 = tokens.shape
        out = np.empty((B, T0 + n_new), dtype=np.int64)
        out[:, :T0] = tokens
        if n_new == 0:
            return out[0] if one_d else out
        if use_cache:
            cache = self._new_cache(B, T0 + n_new)
            logits = self._forward_cached(tokens, cache, 0)[:, -1]  # prefill: the whole prompt
        else:
            logits = self._forward(tokens, keep=False, return_attention=False)[0][:, -1]
        for t in range(T0, T0 + n_new):
            out[:, t] = pick_tokens(logits, temperature, top_k, rng)
            if t + 1 == T0 + n_new:
                break
            if use_cache:
                logits = self._forward_cached(out[:, t : t + 1], cache, t)[:, -1]
            else:
                logits = self._forward(out[:, : t + 1], keep=False, return_attention=False)[0]
                logits = logits[:, -1]
        return out[0] if one_d else out
