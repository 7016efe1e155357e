r"""The options of :class:`sdpa.nn.DecoderLM`, checked once: :class:`DecoderConfig`.

A model's sizes and choices are data: a frozen dataclass that validates every field when it is
made, so that the model itself reads as its forward pass (as nanochat's ``GPTConfig``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

from .._checks import check_bool, check_positive_int, check_real

__all__ = ["DecoderConfig"]

POSITIONALS = ("rope", "sinusoidal", "learned", None)
NORMS = ("layer", "rms")
# The options that add to the plain model, all off by default.
OPTIONS = ("qk_norm", "logit_softcap", "attn_softcap", "sink", "output_gate", "differential")


@dataclass(frozen=True)
class DecoderConfig:
    r"""The sizes and options of a :class:`sdpa.nn.DecoderLM`, checked when made.

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
    max_len : int
        The longest sequence the model accepts (the context length), for training and for
        generation alike; the size of the positional tables.
    n_kv_heads : int, optional
        ``Hkv``, key/value heads; a divisor of ``n_heads`` (grouped-query attention when
        smaller, multi-query when 1). Default (None): ``n_heads``.
    d_ff : int, optional
        ``Dff``, the hidden width of the MLP; default (None) ``4 * d_model``. None when
        ``attention_only``, whatever was given.
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
    differential : bool, default False
        Differential attention (Ye et al. 2024, ``sdpa.nn.differential``): heads ``2j`` and
        ``2j + 1`` form one head that subtracts its second softmax map from its first,
        ``(A1 - lam A2) [v_2j, v_2j+1]``, then RMS-normalises the result per head and scales
        it by ``1 - lam_init``; ``lam = exp(lq1 . lk1) - exp(lq2 . lk2) + lam_init`` from four
        learned vectors ``blocks.i.attn.lambda_q1`` ... of length ``Dk`` per block. Needs an
        even ``n_heads``, ``n_kv_heads == n_heads``, and neither ``sink`` nor ``attn_softcap``.
    dtype : {np.float64, np.float32}, default np.float64
        The dtype of the parameters and of every computation (stored as a ``numpy.dtype``).

    Attributes
    ----------
    head_dim : int
        ``Dk = d_model // n_heads``.
    options : dict
        The options of ``OPTIONS`` that are on, by name (empty for the plain model).

    Raises
    ------
    TypeError
        If a size is not an integer, ``attention_only``, ``qk_norm``, ``sink``,
        ``output_gate`` or ``differential`` is not a bool, or a soft-cap is not a real number.
    ValueError
        If a size is not positive, ``n_heads`` does not divide ``d_model``, ``n_kv_heads``
        does not divide ``n_heads``, the head width is odd with RoPE, ``positional``,
        ``norm`` or ``dtype`` is not one of the choices, a soft-cap is not positive and
        finite, or ``differential`` is combined with what it does not support.

    Examples
    --------
    >>> from sdpa.nn import DecoderConfig
    >>> config = DecoderConfig(vocab_size=11, d_model=16, n_layers=2, n_heads=4, max_len=8,
    ...                        n_kv_heads=2, sink=True)
    >>> config.head_dim, config.n_kv_heads, config.d_ff, config.options
    (4, 2, 64, {'sink': True})
    >>> DecoderConfig(vocab_size=11, d_model=16, n_layers=2, n_heads=3, max_len=8)
    Traceback (most recent call last):
    ...
    ValueError: n_heads must divide d_model; got d_model=16, n_heads=3
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    max_len: int
    n_kv_heads: int | None = None
    d_ff: int | None = None
    positional: str | None = "rope"
    norm: str = "layer"
    attention_only: bool = False
    qk_norm: bool = False
    logit_softcap: float | None = None
    attn_softcap: float | None = None
    sink: bool = False
    output_gate: bool = False
    differential: bool = False
    dtype: np.dtype = np.dtype(np.float64)

    def __post_init__(self):
        checked = {name: check_positive_int(getattr(self, name), name) for name in _SIZES}
        checked["n_kv_heads"] = _optional_size(self.n_kv_heads, "n_kv_heads", checked["n_heads"])
        _check_heads(checked["d_model"], checked["n_heads"], checked["n_kv_heads"])
        checked["positional"] = _choice(self.positional, "positional", POSITIONALS)
        if checked["positional"] == "rope" and checked["d_model"] // checked["n_heads"] % 2:
            raise ValueError(
                f"positional='rope' needs an even head width d_model // n_heads; got "
                f"{checked['d_model']} // {checked['n_heads']} = "
                f"{checked['d_model'] // checked['n_heads']}"
            )
        checked["norm"] = _choice(self.norm, "norm", NORMS)
        for name in ("attention_only", "qk_norm", "sink", "output_gate", "differential"):
            checked[name] = check_bool(getattr(self, name), name)
        for name in ("logit_softcap", "attn_softcap"):
            checked[name] = _check_cap(getattr(self, name), name)
        if checked["differential"]:
            _check_differential(checked)
        default_d_ff = None if checked["attention_only"] else 4 * checked["d_model"]
        checked["d_ff"] = (
            None if checked["attention_only"] else _optional_size(self.d_ff, "d_ff", default_d_ff)
        )
        checked["dtype"] = _model_dtype(self.dtype)
        for name, value in checked.items():  # frozen: the checked values replace the given
            object.__setattr__(self, name, value)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def options(self) -> dict:
        return {name: getattr(self, name) for name in OPTIONS if getattr(self, name)}


FIELDS = frozenset(f.name for f in fields(DecoderConfig)) | {"head_dim"}
_SIZES = ("vocab_size", "d_model", "n_layers", "n_heads", "max_len")


def _optional_size(value, name: str, default: int | None) -> int | None:
    return default if value is None else check_positive_int(value, name)


def _check_heads(d_model: int, n_heads: int, n_kv_heads: int) -> None:
    if d_model % n_heads:
        raise ValueError(f"n_heads must divide d_model; got d_model={d_model}, n_heads={n_heads}")
    if n_heads % n_kv_heads:
        raise ValueError(
            f"n_kv_heads must divide n_heads; got n_heads={n_heads}, n_kv_heads={n_kv_heads}"
        )


def _check_differential(checked: dict) -> None:
    """Differential attention pairs the heads, each pair with its own keys and values."""
    heads, kv = checked["n_heads"], checked["n_kv_heads"]
    if heads % 2 or kv != heads:
        raise ValueError(
            f"differential=True needs an even n_heads and n_kv_heads == n_heads; got "
            f"n_heads={heads}, n_kv_heads={kv}"
        )
    for name in ("sink", "attn_softcap"):
        if checked[name]:
            raise ValueError(
                f"differential=True does not combine with {name}; got {name}={checked[name]!r}"
            )


def _choice(value, name: str, choices: tuple):
    if value not in choices:
        listed = ", ".join(repr(c) for c in choices[:-1]) + f" or {choices[-1]!r}"
        raise ValueError(f"{name} must be {listed}; got {value!r}")
    return value


def _check_cap(value, name: str) -> float | None:
    """A soft-cap: None (off) or a positive finite real number, as a float."""
    if value is None:
        return None
    return check_real(
        value, name, "None or a positive, finite real number", lambda c: math.isfinite(c) and c > 0
    )


def _model_dtype(dtype) -> np.dtype:
    message = f"dtype must be np.float32 or np.float64; got {dtype!r}"
    try:
        checked = np.dtype(dtype)
    except TypeError:
        raise ValueError(message) from None
    if checked not in (np.float32, np.float64):
        raise ValueError(message)
    return checked
