r"""A decoder-only Transformer language model in NumPy, with hand-written backward passes.

The model is the GPT layout with pre-normalisation: token embedding (plus a positional
encoding), ``n_layers`` blocks, a final normalisation and an unembedding to logits. Each block
updates the *residual stream* ``x`` twice,

.. code-block:: text

    x = x + attention(norm(x))     # causal multi-head attention
    x = x + mlp(norm(x))           # absent when attention_only

The attention goes through :func:`sdpa.scaled_dot_product_attention` and its gradient through
:func:`sdpa.scaled_dot_product_attention_backward`; decoding uses :class:`sdpa.KVCache`.

Five options, all off by default, add what recent models use to keep attention stable or to
let a head attend to nothing: QK-norm (``qk_norm``), soft-capped logits and attention scores
(``logit_softcap``, ``attn_softcap``), a learned sink logit per head (``sink``) and a gate on
each head's output (``output_gate``). Each is in the forward pass, the exact gradient and the
cached decoding; without them the model is the plain one, bit for bit.

Shape letters: ``B`` batch, ``T`` sequence length, ``E`` model width (``d_model``), ``Hq`` query
heads, ``Hkv`` key/value heads, ``Dk`` head width (``E / Hq``), ``Dff`` MLP width (``d_ff``),
``V`` vocabulary size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real

import numpy as np
from numpy.typing import ArrayLike

# The public attention API of sdpa, which this model is built on, from the modules that
# define it (never from the package face, which imports sdpa.nn).
from .._checks import check_nonneg_int, check_real, check_rng
from ..attention import scaled_dot_product_attention
from ..backward import scaled_dot_product_attention_backward
from ..kvcache import KVCache
from ..multihead import merge_heads, split_heads
from ..positional import sinusoidal_positional_encoding
from ..rope import apply_rotary_embedding
from ..softmax_stable import softmax
from .functional import (
    cross_entropy,
    cross_entropy_backward,
    embedding_backward,
    gelu,
    gelu_backward,
    layer_norm,
    layer_norm_backward,
    linear,
    linear_backward,
    rms_norm,
    rms_norm_backward,
    softcap,
    softcap_backward,
    softcapped_attention,
    softcapped_attention_backward,
)

__all__ = ["DecoderLM"]

POSITIONALS = ("rope", "sinusoidal", "learned", None)
NORMS = ("layer", "rms")
# The keyword options that add to the plain model, all off by default.
OPTIONS = ("qk_norm", "logit_softcap", "attn_softcap", "sink", "output_gate")
GELU = "tanh"  # the MLP's activation: GPT-2's tanh form of GELU (fast; see sdpa.nn.gelu)
# The whole-matrix attention path: a small model's sequences are short, and for them it is
# several times faster than the tiled path, which "auto" picks from the total number of scores
# (batch x heads x T x S) however short each sequence is.
ATTENTION = "reference"


def _positive_int(value, name: str) -> int:
    value = check_nonneg_int(value, name)
    if value == 0:
        raise ValueError(f"{name} must be a positive integer; got 0")
    return value


def _check_bool(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool; got {value!r}")
    return bool(value)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    """``1 / (1 + exp(-z))``, without overflow for either sign of ``z``."""
    e = np.exp(-np.abs(z))  # in (0, 1]
    return np.where(z >= 0, 1.0, e) / (1.0 + e)


def _check_cap(value, name: str) -> float | None:
    """A soft-cap: None (off) or a positive finite real number, as a float."""
    if value is None:
        return None
    return check_real(
        value, name, "None or a positive, finite real number", lambda c: math.isfinite(c) and c > 0
    )


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
    vocab_size : int
        ``V``, the number of token ids.
    d_model : int
        ``E``, the width of the residual stream.
    n_layers : int
        Number of blocks (at least 1).
    n_heads : int
        ``Hq``, query heads per block; must divide ``d_model``. Each head has width
        ``Dk = d_model // n_heads`` (even, with RoPE).
    n_kv_heads : int, optional
        ``Hkv``, key/value heads; a divisor of ``n_heads`` (grouped-query attention when
        smaller, multi-query when 1). Default ``n_heads``.
    d_ff : int, optional
        ``Dff``, the hidden width of the MLP; default ``4 * d_model``. Unused when
        ``attention_only``.
    max_len : int
        The longest sequence the model accepts (the context length), for training and for
        generation alike; the size of the positional tables.
    positional : {"rope", "sinusoidal", "learned", None}, default "rope"
        How position enters: rotary embeddings of queries and keys in every layer
        (:func:`sdpa.apply_rotary_embedding`), the fixed sinusoidal table added to the token
        embeddings (:func:`sdpa.sinusoidal_positional_encoding`), a learned table added to
        them (parameter ``"position_embedding"``), or nothing (the causal mask alone).
    norm : {"layer", "rms"}, default "layer"
        :func:`sdpa.nn.layer_norm` (with gain and bias, ``eps = 1e-5``) or
        :func:`sdpa.nn.rms_norm` (gain only, ``eps = 1e-6``).
    attention_only : bool, default False
        Leave out the MLPs: each block is only ``x + attention(norm(x))``.
    qk_norm : bool, default False
        QK-norm (as OLMo 2, Qwen3 and Gemma 3): RMS-normalise each head's queries and keys
        over ``Dk`` (:func:`sdpa.nn.rms_norm`, ``eps = 1e-6``), times learned gains
        ``q_norm.weight`` and ``k_norm.weight`` shared by the heads, before RoPE. A score is
        then at most ``Dk * max|gain_q| * max|gain_k| / sqrt(Dk)`` whatever the projections.
    logit_softcap : float, optional
        Soft-cap the final logits: ``cap * tanh(logits / cap)`` (:func:`sdpa.nn.softcap`; as
        Gemma 2 at 30 and nanochat at 15), so that every logit lies in ``(-cap, cap)``. A
        positive finite number; default None, no cap.
    attn_softcap : float, optional
        Soft-cap every attention score after the ``1 / sqrt(Dk)`` scale and before the
        causal mask: ``z = cap * tanh(z / cap)`` (Gemma 2, at 50). The attention is then
        computed explicitly, the whole ``(T, T)`` matrix at once, with a hand-derived
        backward pass (:func:`sdpa.scaled_dot_product_attention` has no cap). A positive
        finite number; default None, no cap.
    sink : bool, default False
        A learned attention sink per query head (as gpt-oss): one logit ``blocks.i.attn.sink``
        per head, initialised to 0, joins each softmax's denominator as a column with no
        value (``sinks=`` of :func:`sdpa.scaled_dot_product_attention`), so that a head can
        attend to nothing; its weights then sum to less than one. The sink logit is not
        soft-capped.
    output_gate : bool, default False
        Gated attention (Qiu et al. 2025, as Qwen3-Next): multiply each head's output
        elementwise by ``sigmoid(h W_g)`` before ``w_o``, where ``h`` is the block's normed
        input and ``W_g`` the parameter ``blocks.i.attn.w_g``. A head can then turn its
        output down without parking its attention on some token.
    dtype : {np.float64, np.float32}, default np.float64
        The dtype of the parameters and of every computation.
    rng : numpy.random.Generator
        Source of the initial parameters.

    Attributes
    ----------
    params : dict of str to np.ndarray
        Every parameter, by name; the model's only state (see Notes). Replace or modify the
        arrays to change the model; :class:`sdpa.nn.AdamW` updates them in place.
    vocab_size, d_model, n_layers, n_heads, n_kv_heads, d_ff, max_len : int
        The sizes; ``d_ff`` is None when ``attention_only``.
    head_dim : int
        ``Dk = d_model // n_heads``.
    positional, norm, attention_only, dtype
        The other choices, as given.
    qk_norm : bool
        As given (the options default off, and a model without them is the plain one).
    logit_softcap, attn_softcap : float or None
        As given.
    sink, output_gate : bool
        As given.

    Raises
    ------
    TypeError
        If a size is not an integer, ``attention_only``, ``qk_norm``, ``sink`` or
        ``output_gate`` is not a bool, a soft-cap is not a real number, or ``rng`` is not a
        ``numpy.random.Generator``.
    ValueError
        If a size is not positive, ``n_heads`` does not divide ``d_model``, ``n_kv_heads``
        does not divide ``n_heads``, the head width is odd with RoPE, ``positional``,
        ``norm`` or ``dtype`` is not one of the choices, or a soft-cap is not positive and
        finite.

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

    def __init__(
        self,
        *,
        vocab_size: int,
        d_model: int,
        n_layers: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        d_ff: int | None = None,
        max_len: int,
        positional: str | None = "rope",
        norm: str = "layer",
        attention_only: bool = False,
        qk_norm: bool = False,
        logit_softcap: float | None = None,
        attn_softcap: float | None = None,
        sink: bool = False,
        output_gate: bool = False,
        dtype=np.float64,
        rng: np.random.Generator,
    ):
        self.vocab_size = _positive_int(vocab_size, "vocab_size")
        self.d_model = _positive_int(d_model, "d_model")
        self.n_layers = _positive_int(n_layers, "n_layers")
        self.n_heads = _positive_int(n_heads, "n_heads")
        self.n_kv_heads = (
            self.n_heads if n_kv_heads is None else _positive_int(n_kv_heads, "n_kv_heads")
        )
        self.max_len = _positive_int(max_len, "max_len")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"n_heads must divide d_model; got d_model={self.d_model}, n_heads={self.n_heads}"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_kv_heads must divide n_heads; got n_heads={self.n_heads}, "
                f"n_kv_heads={self.n_kv_heads}"
            )
        self.head_dim = self.d_model // self.n_heads
        if positional not in POSITIONALS:
            raise ValueError(
                f"positional must be 'rope', 'sinusoidal', 'learned' or None; got {positional!r}"
            )
        if positional == "rope" and self.head_dim % 2:
            raise ValueError(
                f"positional='rope' needs an even head width d_model // n_heads; got "
                f"{self.d_model} // {self.n_heads} = {self.head_dim}"
            )
        self.positional = positional
        if norm not in NORMS:
            raise ValueError(f"norm must be 'layer' or 'rms'; got {norm!r}")
        self.norm = norm
        self.attention_only = _check_bool(attention_only, "attention_only")
        self.qk_norm = _check_bool(qk_norm, "qk_norm")
        self.logit_softcap = _check_cap(logit_softcap, "logit_softcap")
        self.attn_softcap = _check_cap(attn_softcap, "attn_softcap")
        self.sink = _check_bool(sink, "sink")
        self.output_gate = _check_bool(output_gate, "output_gate")
        if self.attention_only:
            self.d_ff = None
        else:
            self.d_ff = 4 * self.d_model if d_ff is None else _positive_int(d_ff, "d_ff")
        try:
            self.dtype = np.dtype(dtype)
        except TypeError:
            raise ValueError(f"dtype must be np.float32 or np.float64; got {dtype!r}") from None
        if self.dtype not in (np.float32, np.float64):
            raise ValueError(f"dtype must be np.float32 or np.float64; got {dtype!r}")
        self.params = self._init_params(check_rng(rng))

    def __repr__(self) -> str:
        options = "".join(f", {name}={value!r}" for name, value in self._options().items())
        return (
            f"DecoderLM(vocab_size={self.vocab_size}, d_model={self.d_model}, "
            f"n_layers={self.n_layers}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, "
            f"d_ff={self.d_ff}, max_len={self.max_len}, positional={self.positional!r}, "
            f"norm={self.norm!r}, attention_only={self.attention_only}, "
            f"dtype={self.dtype.name}{options})"
        )

    def _options(self) -> dict:
        """The stability and sink options that are on (a model without them is the plain one)."""
        return {name: getattr(self, name) for name in OPTIONS if getattr(self, name)}

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

    def _check_tokens(self, tokens: ArrayLike, name: str) -> tuple[np.ndarray, bool]:
        """Tokens as a ``(B, T)`` integer array, and whether a 1-D ``(T,)`` was given."""
        arr = np.asarray(tokens)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"{name} must be an integer array of token ids; got dtype {arr.dtype}")
        if arr.ndim not in (1, 2) or arr.shape[-1] == 0:
            raise ValueError(
                f"{name} must have shape (T,) or (B, T) with T >= 1; got {name}.shape={arr.shape}"
            )
        if arr.shape[-1] > self.max_len:
            raise ValueError(
                f"{name} holds T={arr.shape[-1]} tokens, more than max_len={self.max_len}"
            )
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            bad = arr[(arr < 0) | (arr >= self.vocab_size)].flat[0]
            raise ValueError(
                f"{name} must hold token ids in [0, vocab_size={self.vocab_size}); got {bad}"
            )
        return (arr[None] if arr.ndim == 1 else arr), arr.ndim == 1

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
                k, v = self._transformed(kv_transform, i, k, v)
            if scores is not None:
                scores.append(self._scores(q, k, attn_mask))
            # (B, Hq, T, Dk); the weights (B, Hq, T, T) and the lse (B, Hq, T), or None
            out, a, lse = self._attention(i, q, k, v, attn_mask, return_attention, keep)
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

    def _attention(self, i: int, q, k, v, attn_mask, return_weights: bool, return_lse: bool):
        """Block ``i``'s causal attention, restricted further by ``attn_mask`` (a bool ``(T, T)``
        that includes the causal mask) when given: ``(out, weights, lse)``, the last two None
        unless asked for (the soft-capped path always returns them)."""
        sinks = self._sinks(i)
        if self.attn_softcap is not None:
            T = q.shape[2]
            allowed = np.tril(np.ones((T, T), dtype=bool)) if attn_mask is None else attn_mask
            return softcapped_attention(q, k, v, self.attn_softcap, allowed, sinks)
        result = scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            is_causal=attn_mask is None,
            enable_gqa=self.n_kv_heads != self.n_heads,
            implementation=ATTENTION,
            return_weights=return_weights,
            return_lse=return_lse,
            sinks=sinks,
        )  # (B, Hq, T, Dk), then the weights (B, Hq, T, T) and lse (B, Hq, T) if asked
        if not isinstance(result, tuple):
            return result, None, None
        return result[0], result[1] if return_weights else None, result[-1] if return_lse else None

    def _gate(self, i: int, h: np.ndarray) -> np.ndarray:
        """Block ``i``'s output gate ``sigmoid(h W_g)``, ``(B, T, Hq Dk)``."""
        return _sigmoid(h @ self.params[f"blocks.{i}.attn.w_g"])  # (B, T, E) @ (E, Hq Dk)

    def _sinks(self, i: int) -> np.ndarray | None:
        """Block ``i``'s sink logits as ``sinks=`` takes them, ``(Hq, 1)``; None without."""
        return self.params[f"blocks.{i}.attn.sink"][:, None] if self.sink else None

    def _logits(self, x: np.ndarray) -> np.ndarray:
        """The final norm, the unembedding and the logits' soft-cap: ``(B, T, E) -> (B, T, V)``."""
        h_final = self._norm(x, "final_norm")
        logits = h_final @ self.params["unembedding"]  # (B, T, E) @ (E, V) -> (B, T, V)
        if self.logit_softcap is not None:
            logits = softcap(logits, self.logit_softcap)
        return logits

    def _transformed(self, kv_transform, i: int, k: np.ndarray, v: np.ndarray):
        """``kv_transform(i, k, v)``, checked: new arrays of the same shapes."""
        result = kv_transform(i, k.copy(), v.copy())
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(f"kv_transform must return a (keys, values) pair; got {result!r:.80}")
        new_k, new_v = (np.asarray(a, dtype=self.dtype) for a in result)
        if new_k.shape != k.shape or new_v.shape != v.shape:
            raise ValueError(
                f"kv_transform must keep the shapes {k.shape} and {v.shape}; got "
                f"{new_k.shape} and {new_v.shape}"
            )
        return new_k, new_v

    def _check_mask(self, attn_mask, T: int) -> np.ndarray | None:
        if attn_mask is None:
            return None
        mask = np.asarray(attn_mask)
        if mask.dtype != bool or mask.shape != (T, T):
            raise ValueError(
                f"attn_mask must be a boolean (T, T) = ({T}, {T}) array; got "
                f"dtype {mask.dtype}, shape {mask.shape}"
            )
        if not (mask & np.tril(np.ones_like(mask))).any(axis=1).all():
            raise ValueError(
                "attn_mask leaves a query no key at or before it (with the causal mask)"
            )
        return mask

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
        for name, flag in (
            ("return_attention", return_attention),
            ("return_scores", return_scores),
        ):
            if not isinstance(flag, (bool, np.bool_)):
                raise TypeError(f"{name} must be a bool; got {flag!r}")
        if kv_transform is not None and not callable(kv_transform):
            raise TypeError(f"kv_transform must be callable; got {kv_transform!r:.80}")
        tokens, one_d = self._check_tokens(tokens, "tokens")
        mask = self._check_mask(attn_mask, tokens.shape[1])
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
        (``sdpa.nn.functional``), and the attention through
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
        tokens, _ = self._check_tokens(tokens, "tokens")
        targets = np.asarray(targets)
        if targets.dtype.kind not in "iu":
            raise TypeError(
                f"targets must be an integer array of token ids; got dtype {targets.dtype}"
            )
        if targets.ndim == 1:
            targets = targets[None]
        if targets.shape != tokens.shape:
            raise ValueError(
                f"targets must have the shape of tokens, {tokens.shape}; got {targets.shape}"
            )
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
        sinks = self._sinks(i)
        if self.attn_softcap is not None:  # the written-out attention's own backward
            d_q, d_k, d_v, d_sinks = softcapped_attention_backward(
                d_out, c.q, c.k, c.v, self.attn_softcap, c.weights, c.lse, sinks
            )  # d_sinks: (B, Hq, T), one per row, or None
            d_sinks = None if d_sinks is None else d_sinks.sum(axis=(0, 2))  # -> (Hq,)
        else:
            d_q, d_k, d_v, *d_sinks = scaled_dot_product_attention_backward(
                d_out,
                c.q,
                c.k,
                c.v,
                is_causal=True,
                enable_gqa=self.n_kv_heads != self.n_heads,
                out=c.out,
                lse=c.lse,
                implementation=ATTENTION,
                sinks=sinks,
            )  # with sinks, d_sinks = [(Hq, 1)], summed over the rows that share a logit
            d_sinks = d_sinks[0][:, 0] if d_sinks else None  # -> (Hq,)
        if self.sink:
            grads[p + "attn.sink"] = d_sinks
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
            sinks = self._sinks(i)
            if self.attn_softcap is None:  # (B, Hq, T, Dk): causal, aligned bottom right
                out = cache.attend(i, q, sinks=sinks)
            else:  # written out: new query t, at position start + t, sees keys s <= start + t
                T, S = q.shape[2], start + q.shape[2]
                allowed = np.arange(S) <= start + np.arange(T)[:, None]  # (T, S)
                keys, values = cache.keys(i), cache.values(i)  # (B, Hkv, S, Dk)
                out = softcapped_attention(q, keys, values, self.attn_softcap, allowed, sinks)[0]
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
        tokens, one_d = self._check_tokens(prompt, "prompt")
        n_new = check_nonneg_int(max_new_tokens, "max_new_tokens")
        if tokens.shape[1] + n_new > self.max_len:
            raise ValueError(
                f"the prompt's T0={tokens.shape[1]} tokens plus max_new_tokens={n_new} exceed "
                f"max_len={self.max_len}"
            )
        if isinstance(temperature, (bool, np.bool_)) or not isinstance(temperature, Real):
            raise TypeError(f"temperature must be a real number; got {temperature!r}")
        if not (np.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0; got {temperature!r}")
        if top_k is not None:
            top_k = check_nonneg_int(top_k, "top_k")
            if not 1 <= top_k <= self.vocab_size:
                raise ValueError(
                    f"top_k must be in [1, vocab_size={self.vocab_size}] or None; got {top_k}"
                )
        if temperature > 0 and rng is None:
            raise TypeError("sampling (temperature > 0) needs rng=np.random.default_rng(seed)")
        if rng is not None:
            check_rng(rng)
        if not isinstance(use_cache, (bool, np.bool_)):
            raise TypeError(f"use_cache must be a bool; got {use_cache!r}")

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
            out[:, t] = self._pick(logits, temperature, top_k, rng)
            if t + 1 == T0 + n_new:
                break
            if use_cache:
                logits = self._forward_cached(out[:, t : t + 1], cache, t)[:, -1]
            else:
                logits = self._forward(out[:, : t + 1], keep=False, return_attention=False)[0]
                logits = logits[:, -1]
        return out[0] if one_d else out

    @staticmethod
    def _pick(logits: np.ndarray, temperature: float, top_k: int | None, rng) -> np.ndarray:
        """One token per row of ``logits`` ``(B, V)``: greedy, or sampled by inverse CDF."""
        if temperature == 0:
            return np.argmax(logits, axis=-1)  # the lowest id among the largest logits
        z = logits.astype(np.float64)  # (B, V)
        if top_k is not None:
            order = np.argsort(-z, axis=-1, kind="stable")  # (B, V), ties: lowest id first
            kept = np.zeros(z.shape, dtype=bool)  # (B, V)
            np.put_along_axis(kept, order[:, :top_k], True, axis=-1)  # exactly top_k per row
            z = np.where(kept, z, -np.inf)
        with np.errstate(over="ignore"):  # a tiny temperature: -inf for all but the largest
            z = (z - z.max(axis=-1, keepdims=True)) / temperature  # (B, V), <= 0
        cdf = np.cumsum(softmax(z, axis=-1), axis=-1)  # (B, V)
        u = rng.random((z.shape[0], 1)) * cdf[:, -1:]
        return np.minimum((cdf <= u).sum(axis=-1), z.shape[1] - 1)
