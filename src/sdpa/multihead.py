"""Multi-head attention with explicit NumPy weights: project, split, attend, merge, project.

Shape letters: ``B`` batch, ``T`` queries, ``S`` keys, ``E`` model width, ``Hq`` query heads,
``Hkv`` key/value heads, ``Dk``/``Dv`` per-head widths.

Weights multiply from the right, as in the equations of the paper (``Q = X W_q``), so
``W_q`` has shape ``(E, Hq * Dk)``. PyTorch's ``nn.Linear`` stores the transpose:
``torch.nn.MultiheadAttention.in_proj_weight`` is ``[W_q.T; W_k.T; W_v.T]`` and
``out_proj.weight`` is ``W_o.T``.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike

from ._checks import (
    ATTENTION_MASK_HINT,
    as_array,
    as_float_array,
    check_bool,
    check_float_dtype,
    check_nonneg_int,
    check_rng,
    deprecated_name,
    renamed_keyword,
)
from .attention import scaled_dot_product_attention

__all__ = ["MultiHeadAttention", "split_heads", "merge_heads"]


def split_heads(x: ArrayLike, n_heads: int) -> np.ndarray:
    """Split the last axis into heads: ``(..., T, H * D) -> (..., H, T, D)``.

    Parameters
    ----------
    x : (..., T, H * D) array_like
        The heads side by side along the last axis.
    n_heads : int
        ``H``; must divide the last axis.

    Returns
    -------
    (..., H, T, D) np.ndarray
        A view where possible.

    Raises
    ------
    ValueError
        If ``x`` has fewer than 2 dimensions, or ``n_heads`` is not positive or does not divide
        the last axis.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa import split_heads, merge_heads
    >>> x = np.arange(12).reshape(2, 6)  # (T=2, E=6)
    >>> split_heads(x, 3)[1]             # head 1 owns columns 2:4
    array([[2, 3],
           [8, 9]])
    >>> bool((merge_heads(split_heads(x, 3)) == x).all())
    True
    """
    x = as_array(x, "x")
    n_heads = check_nonneg_int(n_heads, "n_heads")
    if x.ndim < 2:
        raise ValueError(f"x must have at least 2 dimensions (..., T, E); got x.shape={x.shape}")
    if n_heads == 0 or x.shape[-1] % n_heads:
        raise ValueError(
            f"n_heads={n_heads} must be positive and divide the last axis of x; got x.shape={x.shape}"
        )
    *lead, T, E = x.shape
    return np.swapaxes(x.reshape(*lead, T, n_heads, E // n_heads), -3, -2)


def merge_heads(x: ArrayLike) -> np.ndarray:
    """Concatenate heads: ``(..., H, T, D) -> (..., T, H * D)``, the inverse of :func:`split_heads`.

    Parameters
    ----------
    x : (..., H, T, D) array_like
        One array per head along axis -3.

    Returns
    -------
    (..., T, H * D) np.ndarray
        The heads side by side along the last axis (head ``h`` in columns ``h*D : (h+1)*D``).

    Raises
    ------
    ValueError
        If ``x`` has fewer than 3 dimensions.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa import merge_heads
    >>> merge_heads(np.zeros((2, 4, 5, 8))).shape  # (B, H, T, D) -> (B, T, H * D)
    (2, 5, 32)
    """
    x = as_array(x, "x")
    if x.ndim < 3:
        raise ValueError(f"x must have at least 3 dimensions (..., H, T, D); got x.shape={x.shape}")
    *lead, H, T, D = x.shape
    return np.swapaxes(x, -3, -2).reshape(*lead, T, H * D)


def _check_matrix(W, name: str, rows: int | None = None, cols: int | None = None) -> np.ndarray:
    W = as_float_array(W, name)
    if (
        W.ndim != 2
        or (rows is not None and W.shape[0] != rows)
        or (cols is not None and W.shape[1] != cols)
    ):
        want = f"({'any' if rows is None else rows}, {'any' if cols is None else cols})"
        raise ValueError(f"{name} must be a matrix of shape {want}; got {name}.shape={W.shape}")
    return W


def _check_bias(b, name: str, width: int) -> np.ndarray | None:
    if b is None:
        return None
    b = as_float_array(b, name)
    if b.shape != (width,):
        raise ValueError(f"{name} must have shape ({width},); got {name}.shape={b.shape}")
    return b


class MultiHeadAttention:
    r"""Multi-head attention, ``concat(head_0, ..., head_{Hq-1}) W_o``, with explicit weights.

    Heads are numbered from 0, as the book numbers them:
    ``head_h = attention(X_q W_q^{(h)}, X_kv W_k^{(g)}, X_kv W_v^{(g)})`` where ``g = h // G``
    and ``G = Hq / Hkv`` (``G = 1``: multi-head; ``Hkv = 1``: multi-query; otherwise
    grouped-query attention). ``W_q^{(h)}`` is the ``h``-th block of ``Dk`` columns of ``W_q``,
    and head ``h`` is at index ``h`` of the weights' head axis.

    Parameters
    ----------
    W_q : (E, Hq * Dk) array_like
        Query projection: the input of width ``E`` to ``Hq`` heads of width ``Dk``.
    W_k : (Ek, Hkv * Dk) array_like
        Key projection; ``Ek`` is the width of the key input (``E`` for self-attention).
    W_v : (Ev, Hkv * Dv) array_like
        Value projection; ``Ev`` is the width of the value input.
    W_o : (Hq * Dv, E_out) array_like
        Output projection of the merged heads.
    n_heads : int
        ``Hq``.
    n_kv_heads : int, optional
        ``Hkv``; defaults to ``n_heads``. Must divide ``n_heads``.
    b_q, b_k, b_v, b_o : array_like, optional
        Biases of the four projections.

    Raises
    ------
    ValueError
        If a weight or bias shape does not fit the head counts.

    See Also
    --------
    MultiHeadAttention.random : Initialise the weights from a generator.

    Notes
    -----
    With ``W_q.T, W_k.T, W_v.T`` stacked as ``in_proj_weight`` and ``W_o.T`` as
    ``out_proj.weight``, the output equals ``torch.nn.MultiheadAttention(E, Hq,
    batch_first=True)``; that module's boolean masks mean ``True`` = masked out, so pass
    ``~mask`` to it.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa import MultiHeadAttention
    >>> rng = np.random.default_rng(0)
    >>> mha = MultiHeadAttention.random(16, 4, n_kv_heads=2, rng=rng)  # E=16, Hq=4, Hkv=2
    >>> x = rng.standard_normal((2, 5, 16))  # (B, T, E)
    >>> out, w = mha(x, is_causal=True, return_weights=True)
    >>> out.shape, w.shape  # (B, T, E), (B, Hq, T, S)
    ((2, 5, 16), (2, 4, 5, 5))
    >>> float(np.round(w[0, 3, 0, 0], 6))  # the first token can only attend to itself
    1.0

    Head 0 uses the first ``Dk`` columns of ``W_q`` and key/value head ``0 // G = 0``:

    >>> from sdpa import scaled_dot_product_attention
    >>> Dk = mha.W_q.shape[1] // 4
    >>> q0, k0 = x @ mha.W_q[:, :Dk], x @ mha.W_k[:, :Dk]
    >>> v0 = x @ mha.W_v[:, : mha.W_v.shape[1] // 2]
    >>> _, w0 = scaled_dot_product_attention(q0, k0, v0, is_causal=True, return_weights=True)
    >>> bool(np.allclose(w0, w[:, 0]))
    True
    """

    def __init__(
        self,
        W_q: ArrayLike,
        W_k: ArrayLike,
        W_v: ArrayLike,
        W_o: ArrayLike,
        *,
        n_heads: int,
        n_kv_heads: int | None = None,
        b_q: ArrayLike | None = None,
        b_k: ArrayLike | None = None,
        b_v: ArrayLike | None = None,
        b_o: ArrayLike | None = None,
    ):
        n_heads = check_nonneg_int(n_heads, "n_heads")
        n_kv_heads = n_heads if n_kv_heads is None else check_nonneg_int(n_kv_heads, "n_kv_heads")
        if n_heads == 0 or n_kv_heads == 0 or n_heads % n_kv_heads:
            raise ValueError(
                f"n_kv_heads must be positive and divide n_heads; got n_heads={n_heads}, "
                f"n_kv_heads={n_kv_heads}"
            )
        W_q = _check_matrix(W_q, "W_q")
        if W_q.shape[1] % n_heads:
            raise ValueError(
                f"W_q must have Hq * Dk columns with Hq=n_heads={n_heads}; got W_q.shape={W_q.shape}"
            )
        head_dim = W_q.shape[1] // n_heads
        W_k = _check_matrix(W_k, "W_k", cols=n_kv_heads * head_dim)
        W_v = _check_matrix(W_v, "W_v")
        if W_v.shape[1] % n_kv_heads:
            raise ValueError(
                f"W_v must have Hkv * Dv columns with Hkv={n_kv_heads}; got W_v.shape={W_v.shape}"
            )
        value_dim = W_v.shape[1] // n_kv_heads
        W_o = _check_matrix(W_o, "W_o", rows=n_heads * value_dim)
        self.W_q, self.W_k, self.W_v, self.W_o = W_q, W_k, W_v, W_o
        self.b_q = _check_bias(b_q, "b_q", W_q.shape[1])
        self.b_k = _check_bias(b_k, "b_k", W_k.shape[1])
        self.b_v = _check_bias(b_v, "b_v", W_v.shape[1])
        self.b_o = _check_bias(b_o, "b_o", W_o.shape[1])
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim, self.value_dim = head_dim, value_dim

    @property
    def d_model(self) -> int:
        """``E``, the width of inputs and outputs."""
        return self.W_q.shape[0]

    @property
    def d_k(self) -> int:
        """Deprecated name of ``head_dim``."""
        deprecated_name("MultiHeadAttention.d_k", "head_dim")
        return self.head_dim

    @property
    def d_v(self) -> int:
        """Deprecated name of ``value_dim``."""
        deprecated_name("MultiHeadAttention.d_v", "value_dim")
        return self.value_dim

    @classmethod
    def random(
        cls,
        d_model: int,
        n_heads: int,
        *,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        bias: bool = False,
        rng: np.random.Generator,
        dtype=np.float64,
        d_k: int | None = None,
    ) -> MultiHeadAttention:
        """Glorot-uniform weights (as ``torch.nn.MultiheadAttention``), zero biases.

        Parameters
        ----------
        d_model : int
            ``E``, the width of inputs and outputs.
        n_heads : int
            ``Hq``.
        n_kv_heads : int, optional
            ``Hkv``; defaults to ``n_heads``.
        head_dim : int, optional
            Per-head width ``Dk = Dv``; defaults to ``d_model // n_heads``.
        bias : bool, default False
            Include (zero-initialised) biases.
        rng : numpy.random.Generator
            Source of the weights.
        dtype : float dtype, default float64
            The weights' dtype: float16, float32 or float64. Integer dtypes are refused: Glorot weights are below
            one, so they would all round to zero.
        d_k : int, optional
            Deprecated name of ``head_dim`` (a ``DeprecationWarning``); to be removed in the
            next release.

        Returns
        -------
        MultiHeadAttention

        Raises
        ------
        TypeError
            If ``rng`` is not a ``numpy.random.Generator``, a size is not an integer, ``bias``
            is not a bool, ``dtype`` is not a floating dtype, or both ``head_dim`` and its
            deprecated name ``d_k`` are given.
        ValueError
            If a size is negative, or ``n_heads`` does not divide ``d_model`` when
            ``head_dim`` is not given.

        Examples
        --------
        >>> import numpy as np
        >>> from sdpa import MultiHeadAttention
        >>> mqa = MultiHeadAttention.random(12, 4, n_kv_heads=1, rng=np.random.default_rng(0))
        >>> mqa  # multi-query: four query heads share one key/value head
        MultiHeadAttention(d_model=12, n_heads=4, n_kv_heads=1, head_dim=3, value_dim=3, bias=False)
        >>> mqa.W_q.shape, mqa.W_k.shape, mqa.W_o.shape  # (E, Hq*Dk), (E, Hkv*Dk), (Hq*Dv, E)
        ((12, 12), (12, 3), (12, 12))
        """
        head_dim = renamed_keyword(head_dim, d_k, "head_dim", "d_k")
        rng = check_rng(rng)
        bias = check_bool(bias, "bias")
        dtype = check_float_dtype(dtype)
        d_model = check_nonneg_int(d_model, "d_model")
        n_heads = check_nonneg_int(n_heads, "n_heads")
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if head_dim is None:
            if n_heads == 0 or d_model % n_heads:
                raise ValueError(
                    f"n_heads={n_heads} must divide d_model={d_model} when head_dim is not given"
                )
            head_dim = d_model // n_heads
        head_dim = check_nonneg_int(head_dim, "head_dim")

        def glorot(fan_in, fan_out):
            limit = math.sqrt(6.0 / max(fan_in + fan_out, 1))
            return rng.uniform(-limit, limit, size=(fan_in, fan_out)).astype(dtype)

        kv_width = check_nonneg_int(n_kv_heads, "n_kv_heads") * head_dim
        weights = dict(
            W_q=glorot(d_model, n_heads * head_dim),
            W_k=glorot(d_model, kv_width),
            W_v=glorot(d_model, kv_width),
            W_o=glorot(n_heads * head_dim, d_model),
        )
        if bias:
            for name, W in list(weights.items()):
                weights["b" + name[1:]] = np.zeros(W.shape[1], dtype=dtype)
        return cls(**weights, n_heads=n_heads, n_kv_heads=n_kv_heads)

    def __repr__(self) -> str:
        return (
            f"MultiHeadAttention(d_model={self.d_model}, n_heads={self.n_heads}, "
            f"n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, value_dim={self.value_dim}, "
            f"bias={self.b_q is not None})"
        )

    @staticmethod
    def _project(x: np.ndarray, W: np.ndarray, b: np.ndarray | None) -> np.ndarray:
        y = x @ W  # (..., L, E_in) @ (E_in, H * D) -> (..., L, H * D)
        return y if b is None else y + b

    def __call__(
        self,
        query: ArrayLike,
        key: ArrayLike | None = None,
        value: ArrayLike | None = None,
        *,
        attn_mask: ArrayLike | None = None,
        is_causal: bool = False,
        causal_alignment: str = "top_left",
        window=None,
        dropout_p: float = 0.0,
        rng: np.random.Generator | None = None,
        return_weights: bool = False,
    ):
        """Attend from ``query`` to ``key``/``value``.

        Parameters
        ----------
        query : (..., T, E) array_like
        key : (..., S, Ek) array_like, optional
            Defaults to ``query`` (self-attention); pass an encoder output for
            cross-attention.
        value : (..., S, Ev) array_like, optional
            Defaults to ``key``.
        attn_mask, is_causal, causal_alignment, window, dropout_p, rng
            As in :func:`scaled_dot_product_attention`, against weights ``(..., Hq, T, S)``.
        return_weights : bool, default False
            Also return the per-head weights ``(..., Hq, T, S)``.

        Returns
        -------
        out : (..., T, E_out) np.ndarray
            Alone, or ``(out, weights)``.

        Raises
        ------
        ValueError
            If an input's last axis does not match its projection.

        Examples
        --------
        Cross-attention from 5 target positions to 7 source positions, with a padding mask:

        >>> import numpy as np
        >>> from sdpa import MultiHeadAttention, padding_mask
        >>> rng = np.random.default_rng(0)
        >>> mha = MultiHeadAttention.random(12, 4, rng=rng)  # E=12, Hq=Hkv=4
        >>> x = rng.standard_normal((2, 5, 12))       # (B, T, E): the queries' inputs
        >>> memory = rng.standard_normal((2, 7, 12))  # (B, S, E): keys and values
        >>> mask = padding_mask([7, 4], 7)            # (B, 1, 1, S): True = may attend
        >>> out, w = mha(x, memory, attn_mask=mask, return_weights=True)
        >>> out.shape, w.shape  # (B, T, E), (B, Hq, T, S)
        ((2, 5, 12), (2, 4, 5, 7))
        >>> bool(np.all(w[1, :, :, 4:] == 0))  # no weight on the padding of sequence 1
        True
        """
        hint = ATTENTION_MASK_HINT
        x_q = as_float_array(query, "query", masked_hint=hint)
        x_k = x_q if key is None else as_float_array(key, "key", masked_hint=hint)
        x_v = x_k if value is None else as_float_array(value, "value", masked_hint=hint)
        for name, x, W in (
            ("query", x_q, self.W_q),
            ("key", x_k, self.W_k),
            ("value", x_v, self.W_v),
        ):
            if x.ndim < 2 or x.shape[-1] != W.shape[0]:
                raise ValueError(
                    f"{name} must have shape (..., L, {W.shape[0]}) to match W_{name[0]}.shape="
                    f"{W.shape}; got {name}.shape={x.shape}"
                )
        q = split_heads(self._project(x_q, self.W_q, self.b_q), self.n_heads)  # (..., Hq, T, Dk)
        k = split_heads(
            self._project(x_k, self.W_k, self.b_k), self.n_kv_heads
        )  # (..., Hkv, S, Dk)
        v = split_heads(
            self._project(x_v, self.W_v, self.b_v), self.n_kv_heads
        )  # (..., Hkv, S, Dv)
        result = scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask,
            dropout_p,
            is_causal,
            enable_gqa=self.n_kv_heads != self.n_heads,
            causal_alignment=causal_alignment,
            window=window,
            rng=rng,
            return_weights=return_weights,
        )
        heads, weights = result if return_weights else (result, None)
        out = self._project(merge_heads(heads), self.W_o, self.b_o)  # (..., T, Hq*Dv) @ W_o
        return (out, weights) if return_weights else out
