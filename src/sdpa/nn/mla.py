r"""Multi-head latent attention (DeepSeek-V2): a low-rank latent cached instead of keys and values.

Every token's keys and values are up-projected from one latent vector ``c_kv`` of width
``Dc`` (``d_latent``), shared by all heads, so a decoding cache need only hold ``c_kv``. Position
enters through a separate, *decoupled* RoPE part: each head has a rotated query part of width
``Dr`` (``d_rope``), and all heads share one rotated key of width ``Dr`` computed from the
input. The score of query ``i`` against key ``j`` in head ``h`` is

.. math::

    z_{ij} = \frac{q^{\text{nope}}_{h,i} \cdot k^{\text{nope}}_{h,j}
                  + q^{\text{rope}}_{h,i} \cdot k^{\text{rope}}_{j}}{\sqrt{D_n + D_r}},
    \qquad k^{\text{nope}}_{h,j} = W^{UK}_h{}^{\top} c_j,\quad v_{h,j} = W^{UV}_h{}^{\top} c_j,

with ``Dn`` (``d_nope``) the width of the part without position. Two forms compute the same
output:

* the **naive** form (:meth:`MultiHeadLatentAttention.forward`) up-projects the latents to
  per-head keys and values and calls :func:`sdpa.scaled_dot_product_attention`;
* the **absorbed** form (:meth:`MultiHeadLatentAttention.decode`) folds ``W_uk`` into the
  query, :math:`q \cdot (W^{UK\top} c) = (W^{UK} q) \cdot c`, and ``W_uv`` into the output
  projection, so it attends over the cached latents directly: multi-query attention with
  one key head of width ``Dc + Dr`` (the latent and the RoPE key) and one value head of
  width ``Dc`` (the latent). :class:`LatentKVCache` holds exactly ``Dc + Dr`` numbers per
  token.

Shape letters: ``B`` batch, ``T`` new tokens, ``S`` cached tokens, ``E`` model width, ``H``
heads, ``Dc`` latent width, ``Dcq`` query latent width, ``Dn`` and ``Dr`` the key widths without
and with RoPE, ``Dv`` value width per head.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from .._checks import as_float_array, check_positive_int, check_range, check_rng
from ..attention import scaled_dot_product_attention
from ..backward import scaled_dot_product_attention_backward
from ..multihead import merge_heads, split_heads
from ..rope import apply_rotary_embedding
from .functional import linear_backward

__all__ = ["LatentKVCache", "MultiHeadLatentAttention"]


def _float_dtype(dtype) -> np.dtype:
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype must be np.float32 or np.float64; got {dtype!r}") from None
    if dtype not in (np.float32, np.float64):
        raise ValueError(f"dtype must be np.float32 or np.float64; got {dtype!r}")
    return dtype


class LatentKVCache:
    r"""The decoding cache of multi-head latent attention: the latent and the RoPE key.

    Parameters
    ----------
    batch_size : int
        ``B``, sequences decoded together.
    d_latent : int
        ``Dc``, the width of the latent ``c_kv``.
    d_rope : int
        ``Dr``, the width of the shared RoPE key.
    capacity : int
        The most tokens the cache can hold.
    dtype : {np.float64, np.float32}, default np.float64
        The dtype of the stored numbers.

    Attributes
    ----------
    length : int
        ``S``, tokens held so far.
    numbers_per_token : int
        ``Dc + Dr``: all the cache holds for one token of one sequence (one layer).

    Raises
    ------
    TypeError
        If a size is not an integer.
    ValueError
        If a size is not positive or ``dtype`` is not float32 or float64.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa.nn import LatentKVCache
    >>> cache = LatentKVCache(batch_size=2, d_latent=6, d_rope=4, capacity=10)
    >>> cache.append(np.ones((2, 3, 6)), np.ones((2, 3, 4)))    # three tokens
    >>> cache.length, cache.numbers_per_token, cache.latent.shape, cache.rope_key.shape
    (3, 10, (2, 3, 6), (2, 3, 4))
    """

    def __init__(
        self, *, batch_size: int, d_latent: int, d_rope: int, capacity: int, dtype=np.float64
    ):
        self.batch_size = check_positive_int(batch_size, "batch_size")
        self.d_latent = check_positive_int(d_latent, "d_latent")
        self.d_rope = check_positive_int(d_rope, "d_rope")
        self.capacity = check_positive_int(capacity, "capacity")
        self.dtype = _float_dtype(dtype)
        B, C = self.batch_size, self.capacity
        self._latent = np.zeros((B, C, self.d_latent), self.dtype)  # (B, capacity, Dc)
        self._rope_key = np.zeros((B, C, self.d_rope), self.dtype)  # (B, capacity, Dr)
        self.length = 0

    @property
    def numbers_per_token(self) -> int:
        """``Dc + Dr``: the numbers stored per token per sequence."""
        return self.d_latent + self.d_rope

    @property
    def latent(self) -> np.ndarray:
        """``(B, S, Dc)``: the latents of the tokens so far (a read-only view)."""
        view = self._latent[:, : self.length]
        view.flags.writeable = False
        return view

    @property
    def rope_key(self) -> np.ndarray:
        """``(B, S, Dr)``: the rotated RoPE keys of the tokens so far (a read-only view)."""
        view = self._rope_key[:, : self.length]
        view.flags.writeable = False
        return view

    def append(self, latent: ArrayLike, rope_key: ArrayLike) -> None:
        """Store ``T`` new tokens: ``latent`` ``(B, T, Dc)`` and ``rope_key`` ``(B, T, Dr)``.

        Raises
        ------
        ValueError
            If a shape is not the expected one, the cache would exceed its capacity, or a
            finite entry does not fit in the cache's dtype (it would become ``inf``); the
            cache is then unchanged.
        """
        self._store(*self._checked(latent, rope_key))

    def _checked(self, latent: ArrayLike, rope_key: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """``latent`` and ``rope_key`` checked for an append, in the cache's dtype."""
        latent = as_float_array(latent, "latent")
        rope_key = as_float_array(rope_key, "rope_key")
        B, Dc, Dr = self.batch_size, self.d_latent, self.d_rope
        if latent.ndim != 3 or latent.shape[0] != B or latent.shape[2] != Dc:
            raise ValueError(
                f"latent must have shape (B, T, Dc) = ({B}, T, {Dc}); got "
                f"latent.shape={latent.shape}"
            )
        T = latent.shape[1]
        if rope_key.shape != (B, T, Dr):
            raise ValueError(
                f"rope_key must have shape (B, T, Dr) = ({B}, {T}, {Dr}); got "
                f"rope_key.shape={rope_key.shape}"
            )
        if self.length + T > self.capacity:
            raise ValueError(
                f"the cache holds {self.length} tokens of capacity={self.capacity}; "
                f"cannot append T={T} more"
            )
        check_range(latent, self.dtype, "latent", ", the cache's dtype")
        check_range(rope_key, self.dtype, "rope_key", ", the cache's dtype")
        return latent.astype(self.dtype, copy=False), rope_key.astype(self.dtype, copy=False)

    def _store(self, latent: np.ndarray, rope_key: np.ndarray) -> None:
        """Write checked tokens (from :meth:`_checked`) after the ones held; cannot fail."""
        T = latent.shape[1]
        self._latent[:, self.length : self.length + T] = latent
        self._rope_key[:, self.length : self.length + T] = rope_key
        self.length += T


class MultiHeadLatentAttention:
    r"""Causal multi-head latent attention with decoupled RoPE, forward, backward and decoding.

    Parameters
    ----------
    d_model : int
        ``E``, the width of the input and the output.
    n_heads : int
        ``H``, attention heads.
    d_latent : int
        ``Dc``, the width of the key-value latent ``c_kv`` (the cache).
    d_nope : int
        ``Dn``, the per-head width of the query and key parts without position.
    d_rope : int
        ``Dr``, the per-head width of the rotated query part and of the shared rotated key;
        even.
    d_value : int, optional
        ``Dv``, the per-head value width; default ``d_nope``.
    d_query_latent : int, optional
        ``Dcq``: when given, queries are computed from a latent of this width too
        (``c_q = x W_dq``), as in DeepSeek-V2; default None, queries from ``x`` directly.
    rope_base : float, default 10000.0
        The base of the RoPE frequencies (:func:`sdpa.apply_rotary_embedding`).
    dtype : {np.float64, np.float32}, default np.float64
        The dtype of the parameters and of every computation.
    rng : numpy.random.Generator
        Source of the initial parameters.

    Attributes
    ----------
    params : dict of str to np.ndarray
        Every parameter by name (see Notes); the layer's only state.
    scale : float
        ``1 / sqrt(Dn + Dr)``, the scale of the scores.

    Raises
    ------
    TypeError
        If a size is not an integer or ``rng`` is not a ``numpy.random.Generator``.
    ValueError
        If a size is not positive, ``d_rope`` is odd, or ``dtype`` is not float32 or float64.

    Notes
    -----
    **Parameters** (``Din`` is ``Dcq`` with a query latent, else ``E``):

    ==========  ==================  =========================================================
    name        shape               role
    ==========  ==================  =========================================================
    ``w_dq``    ``(E, Dcq)``        query down-projection (only with ``d_query_latent``)
    ``w_uq``    ``(Din, H Dn)``     queries without position, head ``h`` in columns
                                    ``h Dn : (h+1) Dn``
    ``w_qr``    ``(Din, H Dr)``     the per-head RoPE queries (rotated after projection)
    ``w_dkv``   ``(E, Dc)``         the key-value down-projection: ``c_kv = x W_dkv``
    ``w_uk``    ``(Dc, H Dn)``      keys without position from the latent
    ``w_uv``    ``(Dc, H Dv)``      values from the latent
    ``w_kr``    ``(E, Dr)``         the shared RoPE key (rotated after projection)
    ``w_o``     ``(H Dv, E)``       heads to the output
    ==========  ==================  =========================================================

    DeepSeek-V2 also normalises the latents (RMSNorm) before the up-projections; this layer
    leaves the norms to the model around it. Matrices are initialised normal with variance
    ``1 / fan_in``.

    **Why the RoPE part is separate.** Were RoPE applied to the up-projected keys, the score
    would be :math:`q^\top R_i^\top R_j W^{UK\top} c_j`: the matrix between the query and the
    latent would depend on the pair of positions, and could not be folded into the query once.
    The decoupled key carries position on its own, so ``W_uk`` folds into the query.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa.nn import MultiHeadLatentAttention
    >>> mla = MultiHeadLatentAttention(d_model=16, n_heads=4, d_latent=8, d_nope=6, d_rope=4,
    ...                                rng=np.random.default_rng(0))
    >>> x = np.random.default_rng(1).standard_normal((2, 5, 16))   # (B, T, E)
    >>> mla.forward(x).shape
    (2, 5, 16)
    >>> cache = mla.new_cache(batch_size=2, capacity=5)
    >>> steps = [mla.decode(x[:, t : t + 1], cache) for t in range(5)]  # token by token
    >>> bool(np.allclose(np.concatenate(steps, axis=1), mla.forward(x)))
    True
    >>> cache.numbers_per_token   # Dc + Dr = 8 + 4; multi-head: H (Dk + Dv) = 4 x (10 + 6)
    12
    """

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        d_latent: int,
        d_nope: int,
        d_rope: int,
        d_value: int | None = None,
        d_query_latent: int | None = None,
        rope_base: float = 10000.0,
        dtype=np.float64,
        rng: np.random.Generator,
    ):
        self.d_model = check_positive_int(d_model, "d_model")
        self.n_heads = check_positive_int(n_heads, "n_heads")
        self.d_latent = check_positive_int(d_latent, "d_latent")
        self.d_nope = check_positive_int(d_nope, "d_nope")
        self.d_rope = check_positive_int(d_rope, "d_rope")
        if self.d_rope % 2:
            raise ValueError(
                f"d_rope must be even (RoPE rotates pairs of features); got d_rope={self.d_rope}"
            )
        self.d_value = self.d_nope if d_value is None else check_positive_int(d_value, "d_value")
        self.d_query_latent = (
            None if d_query_latent is None else check_positive_int(d_query_latent, "d_query_latent")
        )
        self.rope_base = float(rope_base)
        self.dtype = _float_dtype(dtype)
        self.scale = 1.0 / float(np.sqrt(self.d_nope + self.d_rope))
        self.params = self._init_params(check_rng(rng))

    def __repr__(self) -> str:
        return (
            f"MultiHeadLatentAttention(d_model={self.d_model}, n_heads={self.n_heads}, "
            f"d_latent={self.d_latent}, d_nope={self.d_nope}, d_rope={self.d_rope}, "
            f"d_value={self.d_value}, d_query_latent={self.d_query_latent}, "
            f"dtype={self.dtype.name})"
        )

    def _init_params(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        E, H, Dc = self.d_model, self.n_heads, self.d_latent
        Dn, Dr, Dv = self.d_nope, self.d_rope, self.d_value

        def matrix(fan_in, fan_out):
            return (rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in)).astype(self.dtype)

        params = {}
        d_in = E
        if self.d_query_latent is not None:
            params["w_dq"] = matrix(E, self.d_query_latent)
            d_in = self.d_query_latent
        params["w_uq"] = matrix(d_in, H * Dn)
        params["w_qr"] = matrix(d_in, H * Dr)
        params["w_dkv"] = matrix(E, Dc)
        params["w_uk"] = matrix(Dc, H * Dn)
        params["w_uv"] = matrix(Dc, H * Dv)
        params["w_kr"] = matrix(E, Dr)
        params["w_o"] = matrix(H * Dv, E)
        return params

    # -- checks --------------------------------------------------------------------------------

    def _check_x(self, x: ArrayLike, name: str = "x") -> np.ndarray:
        arr = as_float_array(x, name)
        if arr.ndim != 3 or arr.shape[1] == 0 or arr.shape[2] != self.d_model:
            raise ValueError(
                f"{name} must have shape (B, T, E) with T >= 1 and E = d_model = "
                f"{self.d_model}; got {name}.shape={arr.shape}"
            )
        return arr.astype(self.dtype, copy=False)

    # -- the pieces both forms share -----------------------------------------------------------

    def _queries(self, x: np.ndarray, positions: np.ndarray):
        """``c_q``, ``q_nope`` ``(B, H, T, Dn)`` and the rotated ``q_rope`` ``(B, H, T, Dr)``."""
        p = self.params
        c_q = x @ p["w_dq"] if self.d_query_latent is not None else x  # (B, T, Din)
        q_nope = split_heads(c_q @ p["w_uq"], self.n_heads)  # (B, T, H Dn) -> (B, H, T, Dn)
        q_rope = split_heads(c_q @ p["w_qr"], self.n_heads)  # (B, T, H Dr) -> (B, H, T, Dr)
        return c_q, q_nope, apply_rotary_embedding(q_rope, positions, base=self.rope_base)

    def _latent_and_rope_key(self, x: np.ndarray, positions: np.ndarray):
        """The latent ``c_kv`` ``(B, T, Dc)`` and the rotated shared key ``(B, T, Dr)``."""
        c_kv = x @ self.params["w_dkv"]  # (B, T, E) @ (E, Dc) -> (B, T, Dc)
        k_rope = apply_rotary_embedding(x @ self.params["w_kr"], positions, base=self.rope_base)
        return c_kv, k_rope

    def _naive(self, x: np.ndarray):
        """The naive forward's output and everything its backward needs."""
        H, T = self.n_heads, x.shape[1]
        positions = np.arange(T)
        c_q, q_nope, q_rope = self._queries(x, positions)
        c_kv, k_rope = self._latent_and_rope_key(x, positions)
        k_nope = split_heads(c_kv @ self.params["w_uk"], H)  # (B, T, H Dn) -> (B, H, T, Dn)
        v = split_heads(c_kv @ self.params["w_uv"], H)  # (B, T, H Dv) -> (B, H, T, Dv)
        k_rope_heads = np.broadcast_to(k_rope[:, None], (*k_nope.shape[:3], self.d_rope))
        q = np.concatenate([q_nope, q_rope], axis=-1)  # (B, H, T, Dn + Dr)
        k = np.concatenate([k_nope, k_rope_heads], axis=-1)  # (B, H, T, Dn + Dr)
        out, lse = scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.scale, return_lse=True, implementation="reference"
        )  # (B, H, T, Dv), (B, H, T)
        heads = merge_heads(out)  # (B, H, T, Dv) -> (B, T, H Dv)
        y = heads @ self.params["w_o"]  # (B, T, H Dv) @ (H Dv, E) -> (B, T, E)
        saved = dict(c_q=c_q, c_kv=c_kv, q=q, k=k, v=v, out=out, lse=lse, heads=heads)
        return y, saved

    # -- the naive form ------------------------------------------------------------------------

    def forward(self, x: ArrayLike) -> np.ndarray:
        """The causal output of the layer, in the naive form: latents up-projected to K and V.

        Parameters
        ----------
        x : (B, T, E) array_like
            The input at positions ``0, ..., T - 1``.

        Returns
        -------
        y : (B, T, E) np.ndarray
            Row ``t`` depends on ``x[:, :t + 1]`` only.

        Raises
        ------
        TypeError
            If ``x`` is not a real array.
        ValueError
            If ``x`` is not ``(B, T, E)`` with ``T >= 1`` and ``E = d_model``.

        Examples
        --------
        >>> import numpy as np
        >>> from sdpa.nn import MultiHeadLatentAttention
        >>> mla = MultiHeadLatentAttention(d_model=8, n_heads=2, d_latent=4, d_nope=4,
        ...                                d_rope=2, rng=np.random.default_rng(0))
        >>> x = np.random.default_rng(1).standard_normal((1, 3, 8))
        >>> later = x.copy(); later[0, 2] = 0.0      # change the last token only
        >>> bool(np.allclose(mla.forward(x)[0, :2], mla.forward(later)[0, :2]))  # causal
        True
        """
        return self._naive(self._check_x(x))[0]

    def backward(self, x: ArrayLike, d_y: ArrayLike) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        r"""Gradients of ``sum(d_y * forward(x))`` with respect to ``x`` and every parameter.

        Parameters
        ----------
        x : (B, T, E) array_like
            The input, as in :meth:`forward`.
        d_y : (B, T, E) array_like
            The gradient of a scalar loss with respect to the output.

        Returns
        -------
        d_x : (B, T, E) np.ndarray
            The gradient with respect to ``x``.
        grads : dict of str to np.ndarray
            The gradient with respect to every parameter, keyed and shaped like ``params``.

        Raises
        ------
        TypeError
            If ``x`` or ``d_y`` is not a real array.
        ValueError
            If ``x`` is invalid (as in :meth:`forward`) or ``d_y`` does not have its shape.

        Notes
        -----
        The forward pass runs again and its steps are reversed: the output projection, the
        attention (:func:`sdpa.scaled_dot_product_attention_backward`), the split of queries
        and keys into their two parts, the rotations (whose transpose is the rotation by the
        opposite angle), the shared RoPE key (its gradient summed over the heads), and the
        projections; ``x`` feeds four of them (three with a query latent) and receives the sum.

        Examples
        --------
        >>> import numpy as np
        >>> from sdpa.nn import MultiHeadLatentAttention
        >>> mla = MultiHeadLatentAttention(d_model=8, n_heads=2, d_latent=4, d_nope=4,
        ...                                d_rope=2, rng=np.random.default_rng(0))
        >>> x = np.random.default_rng(1).standard_normal((1, 3, 8))
        >>> d_x, grads = mla.backward(x, np.ones((1, 3, 8)))     # d/dx of sum(forward(x))
        >>> w = mla.params["w_dkv"]
        >>> w[2, 1] += 1e-6; up = mla.forward(x).sum()
        >>> w[2, 1] -= 2e-6; down = mla.forward(x).sum()
        >>> w[2, 1] += 1e-6
        >>> bool(np.isclose(grads["w_dkv"][2, 1], (up - down) / 2e-6, rtol=1e-6))
        True
        """
        x = self._check_x(x)
        d_y = as_float_array(d_y, "d_y")
        if d_y.shape != x.shape:
            raise ValueError(
                f"d_y must have the shape of x, (B, T, E) = {x.shape}; got d_y.shape={d_y.shape}"
            )
        d_y = d_y.astype(self.dtype, copy=False)
        p, H, Dn = self.params, self.n_heads, self.d_nope
        _, s = self._naive(x)
        grads: dict[str, np.ndarray] = {}
        back = -np.arange(x.shape[1])  # the inverse rotations

        d_heads, grads["w_o"], _ = linear_backward(d_y, s["heads"], p["w_o"])
        d_out = split_heads(d_heads, H)  # (B, T, H Dv) -> (B, H, T, Dv)
        d_q, d_k, d_v = scaled_dot_product_attention_backward(
            d_out,
            s["q"],
            s["k"],
            s["v"],
            is_causal=True,
            scale=self.scale,
            out=s["out"],
            lse=s["lse"],
            implementation="reference",
        )  # (B, H, T, Dn + Dr) twice, (B, H, T, Dv)
        d_q_nope, d_q_rope = d_q[..., :Dn], d_q[..., Dn:]
        d_k_nope = d_k[..., :Dn]
        d_k_rope = d_k[..., Dn:].sum(axis=1)  # one key shared by the heads: (B, T, Dr)

        # the latent: k_nope = c_kv W_uk, v = c_kv W_uv, c_kv = x W_dkv
        d_c_uk, grads["w_uk"], _ = linear_backward(merge_heads(d_k_nope), s["c_kv"], p["w_uk"])
        d_c_uv, grads["w_uv"], _ = linear_backward(merge_heads(d_v), s["c_kv"], p["w_uv"])
        d_x, grads["w_dkv"], _ = linear_backward(d_c_uk + d_c_uv, x, p["w_dkv"])
        # the shared RoPE key: k_rope = rope(x W_kr)
        d_kr = apply_rotary_embedding(d_k_rope, back, base=self.rope_base)
        d_x_kr, grads["w_kr"], _ = linear_backward(d_kr, x, p["w_kr"])
        d_x = d_x + d_x_kr
        # the queries: q_nope = c_q W_uq, q_rope = rope(c_q W_qr), c_q = x W_dq (or x)
        d_qr = merge_heads(apply_rotary_embedding(d_q_rope, back, base=self.rope_base))
        d_c_q, grads["w_uq"], _ = linear_backward(merge_heads(d_q_nope), s["c_q"], p["w_uq"])
        d_c_qr, grads["w_qr"], _ = linear_backward(d_qr, s["c_q"], p["w_qr"])
        d_c_q = d_c_q + d_c_qr
        if self.d_query_latent is not None:
            d_c_q, grads["w_dq"], _ = linear_backward(d_c_q, x, p["w_dq"])
        d_x = d_x + d_c_q
        return d_x, {name: grads[name] for name in p}

    # -- the absorbed form ---------------------------------------------------------------------

    def absorbed_weights(self) -> tuple[np.ndarray, np.ndarray]:
        r"""``W_uk`` folded into the query and ``W_uv`` into the output projection.

        Returns
        -------
        w_q_latent : (H, Din, Dc) np.ndarray
            ``W_uq_h @ W_uk_h^T`` per head: ``c_q @ w_q_latent[h]`` is head ``h``'s query in
            the latent's coordinates, whose dot product with a latent ``c`` equals the query
            without position dotted with the key ``W_uk_h^T c``.
        w_o_latent : (H, Dc, E) np.ndarray
            ``W_uv_h @ W_o_h`` per head: head ``h``'s weighted sum of latents times it is the
            head's contribution to the output.

        Examples
        --------
        >>> import numpy as np
        >>> from sdpa.nn import MultiHeadLatentAttention
        >>> mla = MultiHeadLatentAttention(d_model=8, n_heads=2, d_latent=3, d_nope=4,
        ...                                d_rope=2, rng=np.random.default_rng(0))
        >>> w_q_latent, w_o_latent = mla.absorbed_weights()
        >>> w_q_latent.shape, w_o_latent.shape       # (H, E, Dc), (H, Dc, E)
        ((2, 8, 3), (2, 3, 8))
        """
        p, H, Dc = self.params, self.n_heads, self.d_latent
        w_uq = p["w_uq"].reshape(-1, H, self.d_nope)  # (Din, H Dn) -> (Din, H, Dn)
        w_uk = p["w_uk"].reshape(Dc, H, self.d_nope)  # (Dc, H Dn) -> (Dc, H, Dn)
        w_q_latent = np.einsum("ahn,chn->hac", w_uq, w_uk)  # (H, Din, Dc)
        w_uv = p["w_uv"].reshape(Dc, H, self.d_value)  # (Dc, H, Dv)
        w_o = p["w_o"].reshape(H, self.d_value, self.d_model)  # (H, Dv, E)
        w_o_latent = np.einsum("chv,hve->hce", w_uv, w_o)  # (H, Dc, E)
        return w_q_latent, w_o_latent

    def new_cache(self, *, batch_size: int, capacity: int) -> LatentKVCache:
        """An empty :class:`LatentKVCache` for this layer (``Dc + Dr`` numbers per token)."""
        return LatentKVCache(
            batch_size=batch_size,
            d_latent=self.d_latent,
            d_rope=self.d_rope,
            capacity=capacity,
            dtype=self.dtype,
        )

    def decode(self, x: ArrayLike, cache: LatentKVCache) -> np.ndarray:
        r"""The output for new tokens in the absorbed form, attending over a latent cache.

        Attends over the cached tokens and the new ones without ever forming per-head keys or
        values, then appends the new tokens' latents and RoPE keys to ``cache``: a call that
        raises leaves the cache as it was.

        Parameters
        ----------
        x : (B, T, E) array_like
            The new tokens, at positions ``S0, ..., S0 + T - 1`` where ``S0 = cache.length``
            (a whole prompt at once, or one token at a time).
        cache : LatentKVCache
            From :meth:`new_cache`; it grows by ``T`` tokens.

        Returns
        -------
        y : (B, T, E) np.ndarray
            The same numbers as the rows ``S0, ...`` of :meth:`forward` on the whole sequence.

        Raises
        ------
        TypeError
            If ``x`` is not a real array or ``cache`` is not a :class:`LatentKVCache`.
        ValueError
            If ``x`` is invalid (as in :meth:`forward`), its batch or the cache's widths do not
            match, or the cache is full.

        Notes
        -----
        With ``c_q`` the query input, head ``h``'s scores against the cached latents ``C``
        ``(S, Dc)`` and RoPE keys ``K_r`` ``(S, Dr)`` are
        ``(c_q W_q_latent[h] C^T + q_rope K_r^T) / sqrt(Dn + Dr)`` (see
        :meth:`absorbed_weights`). This is multi-query attention in which one key head
        ``[C, K_r]`` of width ``Dc + Dr`` and one value head ``C`` of width ``Dc`` serve all
        ``H`` query heads, computed by :func:`sdpa.scaled_dot_product_attention` with
        ``enable_gqa=True`` and the causal mask aligned bottom right; each head's output is
        then multiplied by ``w_o_latent[h]`` and the heads summed.

        Examples
        --------
        >>> import numpy as np
        >>> from sdpa.nn import MultiHeadLatentAttention
        >>> mla = MultiHeadLatentAttention(d_model=8, n_heads=2, d_latent=4, d_nope=4,
        ...                                d_rope=2, rng=np.random.default_rng(0))
        >>> x = np.random.default_rng(1).standard_normal((1, 6, 8))
        >>> cache = mla.new_cache(batch_size=1, capacity=6)
        >>> prompt = mla.decode(x[:, :4], cache)          # prefill four tokens at once
        >>> nxt = mla.decode(x[:, 4:5], cache)            # then one more
        >>> bool(np.allclose(nxt, mla.forward(x)[:, 4:5])), cache.length
        (True, 5)
        """
        x = self._check_x(x)
        if not isinstance(cache, LatentKVCache):
            raise TypeError(f"cache must be a LatentKVCache; got {type(cache).__name__}")
        if (cache.d_latent, cache.d_rope) != (self.d_latent, self.d_rope):
            raise ValueError(
                f"cache must hold d_latent={self.d_latent} and d_rope={self.d_rope} numbers; "
                f"got d_latent={cache.d_latent}, d_rope={cache.d_rope}"
            )
        if x.shape[0] != cache.batch_size:
            raise ValueError(
                f"x must have the cache's batch size B={cache.batch_size}; got x.shape={x.shape}"
            )
        T, start = x.shape[1], cache.length
        positions = np.arange(start, start + T)
        c_q, _, q_rope = self._queries(x, positions)
        # checked (capacity, range) and in the cache's dtype, but stored only once all went well
        c_kv, k_rope = cache._checked(*self._latent_and_rope_key(x, positions))
        latent = np.concatenate([cache.latent, c_kv], axis=1)  # (B, S, Dc): old and new tokens
        rope_key = np.concatenate([cache.rope_key, k_rope], axis=1)  # (B, S, Dr)
        w_q_latent, w_o_latent = self.absorbed_weights()
        q_latent = np.einsum("bta,hac->bhtc", c_q, w_q_latent)  # (B, H, T, Dc)
        query = np.concatenate([q_latent, q_rope], axis=-1)  # (B, H, T, Dc + Dr)
        key = np.concatenate([latent, rope_key], axis=-1)[:, None]  # (B, 1, S, Dc + Dr)
        value = latent[:, None]  # (B, 1, S, Dc)
        out_latent = scaled_dot_product_attention(
            query,
            key,
            value,
            is_causal=True,
            causal_alignment="bottom_right",
            scale=self.scale,
            enable_gqa=True,
            implementation="reference",
        )  # (B, H, T, Dc): each head's weighted sum of latents
        y = np.einsum("bhtc,hce->bte", out_latent, w_o_latent)  # (B, T, E)
        cache._store(c_kv, k_rope)  # last: a call that raised has changed nothing
        return y
