r"""A key/value cache for autoregressive decoding.

A decoder generates one token at a time, and each new token's query must attend to the keys and
values of every earlier token. Those keys and values do not change once computed (causal
attention: the past never sees the future), so a :class:`KVCache` stores them per layer and the
model computes only the new tokens' projections at each step. Attention of ``T`` new queries
against the ``S`` cached keys (the new ones included) is causal with *bottom-right* alignment:
new query ``i`` sits at position ``S - T + i``.

Shape letters: ``B`` batch, ``Hq`` query heads, ``Hkv`` key/value heads (``Hq`` for multi-head,
1 for multi-query, a divisor of ``Hq`` for grouped-query attention), ``S`` cached length, ``T``
new tokens, ``Dk`` and ``Dv`` per-head widths.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from ._checks import (
    ATTENTION_MASK_HINT,
    as_float_array,
    check_bool,
    check_float_dtype,
    check_int,
    check_nonneg_int,
    check_positive_int,
    check_range,
)
from .attention import scaled_dot_product_attention

__all__ = ["KVCache"]


class KVCache:
    r"""Per-layer key and value buffers ``(B, Hkv, S, D)`` that grow as tokens are decoded.

    Each layer owns a preallocated buffer with room for ``capacity`` tokens; when an append
    does not fit, the buffer is replaced by one at least twice as large and the filled part is
    copied once. Appending ``n`` tokens one at a time therefore copies fewer than ``2 n``
    tokens in total (amortised O(1) per token), where concatenating at every step would copy
    O(n^2).

    Parameters
    ----------
    n_layers : int
        Number of attention layers, each with its own keys and values.
    n_kv_heads : int
        ``Hkv``.
    head_dim : int
        ``Dk``, the width of each key head.
    value_dim : int, optional
        ``Dv``; defaults to ``head_dim``.
    batch_size : int, default 1
        ``B``.
    dtype : floating dtype, default float64
        Storage dtype: float16, float32 or float64 (None is refused rather than read as
        float64). Appended keys and values are converted to it (so a float16 cache halves the
        memory of a float32 model's cache, at float16 precision); a finite value beyond its
        range (above 65504 in float16) is a ``ValueError``, never a stored ``inf``.
    capacity : int, default 16
        Initial room per layer, in tokens. Buffers are allocated at the first append to a layer.

    Raises
    ------
    TypeError
        If a size is not an integer, or ``dtype`` is not a floating dtype (None included).
    ValueError
        If a size is not positive (``n_layers``, ``n_kv_heads``, ``batch_size``, ``capacity``)
        or negative (``head_dim``, ``value_dim``).

    See Also
    --------
    scaled_dot_product_attention : What :meth:`attend` calls.

    Notes
    -----
    **Memory.** Each token stores a key and a value in every layer and key/value head:
    ``bytes_per_token = n_layers * B * Hkv * (Dk + Dv) * itemsize``. Grouped-query attention
    divides it by ``Hq / Hkv`` compared with multi-head attention; multi-query attention
    (``Hkv = 1``) by ``Hq``.

    **Views.** :meth:`keys`, :meth:`values` and :meth:`append` return read-only views of the
    filled part of the buffers, not copies, and a view never changes afterwards: appends write
    past the positions it shows, a full buffer is replaced rather than resized in place, and
    an append after :meth:`crop` that would overwrite positions a view shows first moves the
    layer to a new buffer (one copy of the kept tokens).

    Examples
    --------
    Prefill a prompt of 5 tokens, then decode one token at a time; 4 query heads share 2
    key/value heads (grouped-query attention):

    >>> import numpy as np
    >>> from sdpa import KVCache, scaled_dot_product_attention
    >>> rng = np.random.default_rng(0)
    >>> B, Hq, Hkv, D, n = 1, 4, 2, 8, 7
    >>> q = rng.standard_normal((B, Hq, n, D))
    >>> k = rng.standard_normal((B, Hkv, n, D))
    >>> v = rng.standard_normal((B, Hkv, n, D))
    >>> cache = KVCache(n_layers=1, n_kv_heads=Hkv, head_dim=D, capacity=4)
    >>> _ = cache.append(0, k[:, :, :5], v[:, :, :5])           # prompt
    >>> outs = [cache.attend(0, q[:, :, :5])]
    >>> for t in range(5, n):                                   # one new token per step
    ...     _ = cache.append(0, k[:, :, t:t + 1], v[:, :, t:t + 1])
    ...     outs.append(cache.attend(0, q[:, :, t:t + 1]))
    >>> full = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    >>> bool(np.allclose(np.concatenate(outs, axis=2), full, rtol=0, atol=1e-12))
    True
    >>> cache.length(0), cache.capacity(0)  # room for the prompt (5), then doubled once
    (7, 10)
    >>> cache.bytes_per_token  # n_layers * B * Hkv * (Dk + Dv) * 8 bytes = 1 * 1 * 2 * 16 * 8
    256
    """

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        value_dim: int | None = None,
        batch_size: int = 1,
        dtype=np.float64,
        capacity: int = 16,
    ):
        self.n_layers = check_positive_int(n_layers, "n_layers")
        self.n_kv_heads = check_positive_int(n_kv_heads, "n_kv_heads")
        self.head_dim = check_nonneg_int(head_dim, "head_dim")
        self.value_dim = (
            self.head_dim if value_dim is None else check_nonneg_int(value_dim, "value_dim")
        )
        self.batch_size = check_positive_int(batch_size, "batch_size")
        self.dtype = check_float_dtype(dtype)
        self._initial_capacity = check_positive_int(capacity, "capacity")
        self._keys: list[np.ndarray | None] = [None] * self.n_layers
        self._values: list[np.ndarray | None] = [None] * self.n_layers
        self._lengths = [0] * self.n_layers
        # Per layer: how many positions of the current buffers some returned view shows. An
        # append that would write below this mark moves to new buffers, so views never change.
        self._shown = [0] * self.n_layers

    def __repr__(self) -> str:
        return (
            f"KVCache(n_layers={self.n_layers}, n_kv_heads={self.n_kv_heads}, "
            f"head_dim={self.head_dim}, value_dim={self.value_dim}, batch_size={self.batch_size}, "
            f"dtype={self.dtype}, lengths={self._lengths})"
        )

    # -- bookkeeping ---------------------------------------------------------------------------

    def _layer(self, layer) -> int:
        layer = check_int(layer, "layer")
        if not 0 <= layer < self.n_layers:
            raise ValueError(f"layer must be in [0, n_layers={self.n_layers}); got layer={layer}")
        return int(layer)

    def length(self, layer: int) -> int:
        """Number of tokens cached in ``layer``."""
        return self._lengths[self._layer(layer)]

    def capacity(self, layer: int) -> int:
        """Tokens that fit in ``layer``'s current buffers before they grow (0 before any append)."""
        buf = self._keys[self._layer(layer)]
        return 0 if buf is None else buf.shape[-2]

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies across all layers: ``n_layers * B * Hkv * (Dk + Dv) * itemsize``."""
        per_layer = self.batch_size * self.n_kv_heads * (self.head_dim + self.value_dim)
        return self.n_layers * per_layer * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes held by the filled part of all buffers (what the tokens need)."""
        return sum(
            k[..., :n, :].nbytes + v[..., :n, :].nbytes
            for k, v, n in zip(self._keys, self._values, self._lengths)
            if k is not None
        )

    @property
    def nbytes_allocated(self) -> int:
        """Bytes held by all buffers, spare capacity included."""
        return sum(k.nbytes + v.nbytes for k, v in zip(self._keys, self._values) if k is not None)

    # -- reading and writing -------------------------------------------------------------------

    def _view(self, buffers: list, layer: int, width: int) -> np.ndarray:
        buf = buffers[layer]
        if buf is None:
            view = np.empty((self.batch_size, self.n_kv_heads, 0, width), dtype=self.dtype)
        else:
            view = buf[:, :, : self._lengths[layer]]
            self._shown[layer] = max(self._shown[layer], self._lengths[layer])
        view.flags.writeable = False
        return view

    def keys(self, layer: int) -> np.ndarray:
        """Read-only view ``(B, Hkv, S, Dk)`` of the keys cached in ``layer``."""
        return self._view(self._keys, self._layer(layer), self.head_dim)

    def values(self, layer: int) -> np.ndarray:
        """Read-only view ``(B, Hkv, S, Dv)`` of the values cached in ``layer``."""
        return self._view(self._values, self._layer(layer), self.value_dim)

    def _check_new(self, x: np.ndarray, name: str, width: int) -> None:
        want = (self.batch_size, self.n_kv_heads, width)
        if x.ndim != 4 or (x.shape[0], x.shape[1], x.shape[3]) != want:
            raise ValueError(
                f"{name} must have shape (B, Hkv, T, D) = ({want[0]}, {want[1]}, T, {want[2]}) "
                f"for this cache; got {name}.shape={x.shape}"
            )

    def append(self, layer: int, key: ArrayLike, value: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """Append ``T`` new tokens' keys and values to ``layer``; return all of its keys and values.

        Parameters
        ----------
        layer : int
            In ``[0, n_layers)``.
        key : (B, Hkv, T, Dk) array_like
        value : (B, Hkv, T, Dv) array_like
            Converted to the cache's ``dtype``; the inputs are not modified or kept.

        Returns
        -------
        keys : (B, Hkv, S, Dk) np.ndarray
        values : (B, Hkv, S, Dv) np.ndarray
            Read-only views of everything cached in ``layer``, ``S`` = old length + ``T``.

        Raises
        ------
        TypeError
            If ``layer`` is not an integer, or ``key``/``value`` are complex, object or masked
            arrays.
        ValueError
            If ``layer`` is out of range, the shapes do not match the cache or each other, or
            a finite entry does not fit in the cache's dtype.

        Examples
        --------
        >>> import numpy as np
        >>> from sdpa import KVCache
        >>> cache = KVCache(n_layers=2, n_kv_heads=1, head_dim=2, capacity=1)
        >>> k, v = cache.append(1, np.ones((1, 1, 3, 2)), np.zeros((1, 1, 3, 2)))
        >>> k, v = cache.append(1, np.full((1, 1, 1, 2), 2.0), np.ones((1, 1, 1, 2)))
        >>> k[0, 0]
        array([[1., 1.],
               [1., 1.],
               [1., 1.],
               [2., 2.]])
        >>> cache.length(0), cache.length(1), cache.capacity(1)
        (0, 4, 6)
        """
        layer = self._layer(layer)
        k = as_float_array(key, "key", masked_hint=ATTENTION_MASK_HINT)
        v = as_float_array(value, "value", masked_hint=ATTENTION_MASK_HINT)
        self._check_new(k, "key", self.head_dim)
        self._check_new(v, "value", self.value_dim)
        if k.shape[2] != v.shape[2]:
            raise ValueError(
                f"key and value must hold the same number of new tokens T (axis 2); got "
                f"key.shape={k.shape}, value.shape={v.shape}"
            )
        check_range(k, self.dtype, "key", ", the cache's dtype")
        check_range(v, self.dtype, "value", ", the cache's dtype")
        n, t = self._lengths[layer], k.shape[2]
        old = self._keys[layer]
        if old is None or n + t > old.shape[2] or (t and n < self._shown[layer]):
            if old is None:
                room = max(self._initial_capacity, n + t)
            elif n + t > old.shape[2]:
                room = max(2 * old.shape[2], n + t)
            else:  # after a crop, a view shows positions this append would overwrite
                room = old.shape[2]
            self._keys[layer] = self._grow(old, n, room, self.head_dim)
            self._values[layer] = self._grow(self._values[layer], n, room, self.value_dim)
            self._shown[layer] = 0
        self._keys[layer][:, :, n : n + t] = k  # converts to the cache dtype
        self._values[layer][:, :, n : n + t] = v
        self._lengths[layer] = n + t
        return self.keys(layer), self.values(layer)

    def _grow(self, old: np.ndarray | None, n: int, room: int, width: int) -> np.ndarray:
        new = np.empty((self.batch_size, self.n_kv_heads, room, width), dtype=self.dtype)
        if old is not None:
            new[:, :, :n] = old[:, :, :n]  # the one copy of the filled part
        return new

    def crop(self, length: int) -> None:
        """Forget every token from position ``length`` on, in every layer (e.g. rejected drafts).

        Views returned before the crop keep showing the forgotten tokens; the next append
        writes into new buffers rather than under them.

        Raises
        ------
        TypeError
            If ``length`` is not an integer.
        ValueError
            If ``length`` is negative.

        Examples
        --------
        >>> import numpy as np
        >>> from sdpa import KVCache
        >>> cache = KVCache(n_layers=1, n_kv_heads=1, head_dim=2)
        >>> _ = cache.append(0, np.ones((1, 1, 5, 2)), np.ones((1, 1, 5, 2)))
        >>> cache.crop(3)
        >>> cache.keys(0).shape
        (1, 1, 3, 2)
        """
        length = check_nonneg_int(length, "length")
        self._lengths = [min(n, length) for n in self._lengths]

    def attend(
        self,
        layer: int,
        query: ArrayLike,
        *,
        scale: float | None = None,
        window: tuple[int | None, int | None] | None = None,
        sinks: ArrayLike | None = None,
        return_lse: bool = False,
    ):
        """Causal attention of the newest ``T`` queries to every key and value of ``layer``.

        The queries are the last ``T`` positions of the sequence, so the causal mask is aligned
        bottom-right: query ``i`` sees keys ``j <= S - T + i``. Append the new tokens' keys and
        values first.

        Parameters
        ----------
        layer : int
            In ``[0, n_layers)``.
        query : (B, Hq, T, Dk) array_like
            ``Hq`` must be a multiple of ``Hkv`` (grouped-query attention when larger).
        scale : float, optional
            As in :func:`scaled_dot_product_attention`; default ``1 / sqrt(Dk)``.
        window : (left, right), optional
            Sliding window, positioned bottom-right like the causal mask.
        sinks : (B, Hq, T) array_like, optional
            Attention sinks, as in :func:`scaled_dot_product_attention` (a per-head logit
            as ``sinks[:, None]``, of shape ``(Hq, 1)``).
        return_lse : bool, default False
            Also return the log-sum-exp ``(B, Hq, T)``.

        Returns
        -------
        out : (B, Hq, T, Dv) np.ndarray
            Alone, or ``(out, lse)``.

        Raises
        ------
        TypeError
            If ``return_lse`` is not a bool, or as :func:`scaled_dot_product_attention`.
        ValueError
            If ``T`` exceeds the cached length, or ``query``'s batch, heads or width do not
            fit the cache.

        Examples
        --------
        >>> import numpy as np
        >>> from sdpa import KVCache
        >>> cache = KVCache(n_layers=1, n_kv_heads=1, head_dim=2)
        >>> _ = cache.append(0, np.zeros((1, 1, 3, 2)), np.arange(6.0).reshape(1, 1, 3, 2))
        >>> cache.attend(0, np.zeros((1, 2, 1, 2)))  # equal scores: the mean of all three values
        array([[[[2., 3.]],
        <BLANKLINE>
                [[2., 3.]]]])
        """
        layer = self._layer(layer)
        return_lse = check_bool(return_lse, "return_lse")
        q = as_float_array(query, "query", masked_hint=ATTENTION_MASK_HINT)
        S = self._lengths[layer]
        if q.ndim != 4 or q.shape[0] != self.batch_size or q.shape[3] != self.head_dim:
            raise ValueError(
                f"query must have shape (B, Hq, T, Dk) = ({self.batch_size}, Hq, T, "
                f"{self.head_dim}) for this cache; got query.shape={q.shape}"
            )
        if q.shape[1] % self.n_kv_heads:
            raise ValueError(
                f"query heads Hq must be a multiple of the cache's n_kv_heads={self.n_kv_heads}; "
                f"got query.shape={q.shape}"
            )
        if q.shape[2] > S:
            raise ValueError(
                f"query holds T={q.shape[2]} new tokens but layer {layer} caches only S={S}; "
                "append the new keys and values before attending"
            )
        return scaled_dot_product_attention(
            q,
            self.keys(layer),
            self.values(layer),
            is_causal=True,
            causal_alignment="bottom_right",
            enable_gqa=q.shape[1] != self.n_kv_heads,
            scale=scale,
            window=window,
            sinks=sinks,
            return_lse=return_lse,
        )
