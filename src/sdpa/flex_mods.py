r"""A library of named mods for :func:`sdpa.flex_attention`: the standard masks and score changes.

Each function here is a *generator*: called with its settings, it returns a ``mask_mod(b, h,
q_idx, kv_idx)`` or a ``score_mod(score, b, h, q_idx, kv_idx)`` whose ``__name__`` says what
it is (``sliding_window(256)``), ready for :func:`sdpa.create_block_mask` or ``flex_attention``:

========================================  ==================================================
mask_mods                                 score_mods
========================================  ==================================================
:func:`causal`                            :func:`alibi` (a slope per head)
:func:`sliding_window` (causal, ``w``)    :func:`tanh_softcap` (Gemma 2, Grok)
:func:`dilated_sliding_window`            :func:`relative_bias` (a learned bias per distance)
:func:`chunked_local` (Llama 4)
:func:`prefix_lm`
:func:`document` (from lengths, offsets)
:func:`tree` (speculative decoding)
========================================  ==================================================

Combine masks with :func:`sdpa.and_masks` and :func:`sdpa.or_masks`.

**One expression for NumPy and PyTorch.** The mods are written with operators (``>=``, ``&``,
``//``, ``%``, ``abs``) and array methods that NumPy arrays and torch tensors share
(``.clip``), so that the same mod object runs here on index arrays and in PyTorch's
FlexAttention on the scalar tensors it traces. Where a mod reads a table (the slopes of
:func:`alibi`, the documents of :func:`document`, a tree's ancestors) it takes the table on
the indices' side: the NumPy array for NumPy indices, ``index.new_tensor(table)`` for torch
(made on every call, in the dtype of the indices for an integer table and of the scores
for a float one). That runs in PyTorch's eager ``flex_attention`` and in its
``create_block_mask``, but not under ``torch.compile`` on the CPU (PyTorch 2.13's inductor
rejects a tensor made inside the mod): for a compiled kernel, make the table a tensor once,
outside, and close over it (the programmable-attention page shows the recipe; a test pins
the failure). The
``tanh`` of :func:`tanh_softcap` is the one function the two spell differently
(``np.tanh(x)`` against ``x.tanh()``): it picks by the score's type.

**Conventions.** A window of ``w`` positions includes the position itself: query ``i`` sees
keys ``i - w + 1 .. i`` (as :func:`sdpa.sliding_window_mask` with ``(w - 1, 0)``, Mistral's
``sliding_window``). attention-gym's ``generate_sliding_window(n)`` allows ``q_idx - kv_idx <=
n``, ``n + 1`` positions: it is ``sliding_window(n + 1)`` here.

Shape letters: ``B`` batch, ``H`` heads, ``T`` queries, ``S`` keys, ``P`` a prefix's length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ._checks import check_int, check_positive_int, check_real
from .alibi import alibi_slopes

__all__ = [
    "alibi",
    "causal",
    "chunked_local",
    "dilated_sliding_window",
    "document",
    "prefix_lm",
    "relative_bias",
    "sliding_window",
    "tanh_softcap",
    "tree",
]


def _named(mod: Callable, name: str) -> Callable:
    mod.__name__ = mod.__qualname__ = name
    return mod


class _Table:
    """A table a mod reads, on the side of its arguments (:meth:`on`)."""

    def __init__(self, values: np.ndarray):
        self.array = values
        # A list for PyTorch: its tracer (Dynamo) would turn a NumPy array into a tensor of
        # its own, which new_tensor copies with a warning.
        self.items = values.tolist()

    def on(self, like):
        """The NumPy array beside NumPy arguments, else a tensor made by ``like.new_tensor``
        (PyTorch's, which its tracing supports) in ``like``'s dtype: an index's for an
        integer table, the scores' for a float one."""
        if isinstance(like, (np.ndarray, np.generic, int, float)):
            return self.array
        return like.new_tensor(self.items)


def _int_table(values, name: str, *, minimum: int = 0) -> np.ndarray:
    """A 1-D array of integers ``>= minimum`` (a copy: later changes to ``values`` do not
    reach the mod), or ``TypeError``/``ValueError`` naming it."""
    array = np.array(values)
    if array.ndim != 1 or array.size == 0 or array.dtype.kind not in "iu":
        raise TypeError(
            f"{name} must be a non-empty 1-D sequence of integers; got {np.asarray(values)!r}"
        )
    if array.min() < minimum:
        raise ValueError(f"{name} must hold integers >= {minimum}; got {array.tolist()}")
    return array.astype(np.int64)


# ----------------------------------------------------------------------------------------
# mask_mods
# ----------------------------------------------------------------------------------------


def causal() -> Callable:
    """The causal mask: query ``i`` attends keys ``j <= i``.

    Returns
    -------
    callable
        ``mask_mod(b, h, q_idx, kv_idx) = q_idx >= kv_idx``, named ``causal``.

    Examples
    --------
    >>> from sdpa import create_mask
    >>> from sdpa.flex_mods import causal
    >>> create_mask(causal(), None, None, 3, 3)[0, 0].astype(int)
    array([[1, 0, 0],
           [1, 1, 0],
           [1, 1, 1]])
    """

    def mod(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return _named(mod, "causal")


def sliding_window(w: int) -> Callable:
    """The causal sliding window of ``w`` positions, the query's own included.

    Parameters
    ----------
    w : int
        Keys per window, at least 1: query ``i`` attends keys ``i - w + 1 .. i``.

    Returns
    -------
    callable
        ``mask_mod = (q_idx >= kv_idx) & (q_idx - kv_idx < w)``, named ``sliding_window(w)``.

    Raises
    ------
    TypeError, ValueError
        If ``w`` is not a positive integer.

    Notes
    -----
    The book's convention (and :func:`sdpa.sliding_window_mask`'s with ``(w - 1, 0)``).
    attention-gym's ``generate_sliding_window(n)`` keeps ``q_idx - kv_idx <= n``, so ``n + 1``
    positions: ``sliding_window(n + 1)`` here.

    Examples
    --------
    >>> from sdpa import create_mask
    >>> from sdpa.flex_mods import sliding_window
    >>> mod = sliding_window(2)
    >>> mod.__name__
    'sliding_window(2)'
    >>> create_mask(mod, None, None, 4, 4)[0, 0].astype(int)
    array([[1, 0, 0, 0],
           [1, 1, 0, 0],
           [0, 1, 1, 0],
           [0, 0, 1, 1]])
    """
    w = check_positive_int(w, "w")

    def mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < w)

    return _named(mod, f"sliding_window({w})")


def dilated_sliding_window(w: int, dilation: int, *, causal: bool = True) -> Callable:
    """A window of ``w`` keys spaced ``dilation`` apart, the query's own included.

    Parameters
    ----------
    w : int
        Keys on each side (the query's own counted once), at least 1.
    dilation : int
        The step between them, at least 1 (1 is :func:`sliding_window`).
    causal : bool, default True
        Keys before the query only; False: on both sides, ``|i - j| < w * dilation``.

    Returns
    -------
    callable
        A ``mask_mod``: ``d = q_idx - kv_idx`` (``abs`` of it when not causal) with
        ``0 <= d < w * dilation`` and ``d % dilation == 0``; named
        ``dilated_sliding_window(w, dilation)`` (with ``, causal=False``).

    Raises
    ------
    TypeError, ValueError
        If ``w`` or ``dilation`` is not a positive integer.

    Notes
    -----
    attention-gym's ``generate_dilated_sliding_window(n, d)`` is the two-sided one with
    ``|i - j| <= n``: ``dilated_sliding_window(n // d + 1, d, causal=False)`` here.

    Examples
    --------
    >>> from sdpa import create_mask
    >>> from sdpa.flex_mods import dilated_sliding_window
    >>> create_mask(dilated_sliding_window(2, 2), None, None, 5, 5)[0, 0].astype(int)
    array([[1, 0, 0, 0, 0],
           [0, 1, 0, 0, 0],
           [1, 0, 1, 0, 0],
           [0, 1, 0, 1, 0],
           [0, 0, 1, 0, 1]])
    """
    w = check_positive_int(w, "w")
    dilation = check_positive_int(dilation, "dilation")
    span = w * dilation

    def mod(b, h, q_idx, kv_idx):
        d = q_idx - kv_idx if causal else abs(q_idx - kv_idx)
        return (d >= 0) & (d < span) & (d % dilation == 0)

    suffix = "" if causal else ", causal=False"
    return _named(mod, f"dilated_sliding_window({w}, {dilation}{suffix})")


def chunked_local(chunk: int) -> Callable:
    """Chunked local attention (Llama 4's local layers): causal within chunks of ``chunk``.

    Parameters
    ----------
    chunk : int
        Positions per chunk, at least 1 (Llama 4 takes 8192).

    Returns
    -------
    callable
        ``mask_mod = (q_idx >= kv_idx) & (q_idx // chunk == kv_idx // chunk)``, named
        ``chunked_local(chunk)``.

    Raises
    ------
    TypeError, ValueError
        If ``chunk`` is not a positive integer.

    Notes
    -----
    Unlike a sliding window, a query at the start of a chunk sees one key (itself): the
    window's reach runs from 1 to ``chunk`` keys and then resets.

    Examples
    --------
    >>> from sdpa import create_mask
    >>> from sdpa.flex_mods import chunked_local
    >>> create_mask(chunked_local(2), None, None, 4, 4)[0, 0].astype(int)
    array([[1, 0, 0, 0],
           [1, 1, 0, 0],
           [0, 0, 1, 0],
           [0, 0, 1, 1]])
    """
    chunk = check_positive_int(chunk, "chunk")

    def mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx // chunk == kv_idx // chunk)

    return _named(mod, f"chunked_local({chunk})")


def prefix_lm(prefix) -> Callable:
    """Prefix-LM: every query attends the whole prefix, and the rest causally.

    Parameters
    ----------
    prefix : int or sequence of int
        The prefix's length ``P``, or one length per batch entry ``(B,)``.

    Returns
    -------
    callable
        ``mask_mod = (kv_idx < P) | (q_idx >= kv_idx)`` (``P[b]`` per batch entry), named
        ``prefix_lm(P)``.

    Raises
    ------
    TypeError, ValueError
        If ``prefix`` is not a non-negative integer or a 1-D sequence of them.

    Examples
    --------
    >>> from sdpa import create_mask
    >>> from sdpa.flex_mods import prefix_lm
    >>> create_mask(prefix_lm(2), None, None, 4, 4)[0, 0].astype(int)
    array([[1, 1, 0, 0],
           [1, 1, 0, 0],
           [1, 1, 1, 0],
           [1, 1, 1, 1]])
    >>> create_mask(prefix_lm([1, 3]), 2, None, 3, 3)[:, 0, 0].astype(int)  # query 0 of each
    array([[1, 0, 0],
           [1, 1, 1]])
    """
    if np.ndim(prefix) == 0:
        P = check_int(prefix, "prefix", minimum=0)

        def mod(b, h, q_idx, kv_idx):
            return (kv_idx < P) | (q_idx >= kv_idx)

        return _named(mod, f"prefix_lm({P})")
    lengths = _int_table(prefix, "prefix")
    table = _Table(lengths)

    def per_batch(b, h, q_idx, kv_idx):
        return (kv_idx < table.on(b)[b]) | (q_idx >= kv_idx)

    return _named(per_batch, f"prefix_lm({lengths.tolist()})")


def document(*, lengths=None, offsets=None, inner: Callable | None = None) -> Callable:
    """Document masking: packed sequences, each query attending its own document only.

    Parameters
    ----------
    lengths : sequence of int, optional
        The documents' lengths, in order (each at least 1).
    offsets : sequence of int, optional
        Instead of ``lengths``: where each document starts, and last where the final one ends
        (``offsets[0] = 0``, increasing; ``cu_seqlens`` in FlashAttention's varlen API).
    inner : callable, optional
        A ``mask_mod`` applied within each document, to positions counted from its start
        (:func:`prefix_lm` per document, say). Default: the whole document.

    Returns
    -------
    callable
        A ``mask_mod``: ``doc[q_idx] == doc[kv_idx]``, and ``inner`` on the positions
        ``q_idx - start[doc]``, ``kv_idx - start[doc]``; named ``document(lengths)``.

    Raises
    ------
    TypeError, ValueError
        Unless exactly one of ``lengths`` and ``offsets`` is given, as a 1-D sequence of
        positive lengths (increasing offsets from 0); if ``inner`` is not callable.

    Notes
    -----
    The documents must cover every position the mod is called on (their total at least
    ``T`` and ``S``); a later index raises ``IndexError``. A causal mask with documents is
    ``and_masks(document(...), causal())`` (or ``inner=causal()``: the same, causality not
    depending on where the positions are counted from).

    Examples
    --------
    >>> from sdpa import and_masks, create_mask
    >>> from sdpa.flex_mods import causal, document
    >>> create_mask(and_masks(document(lengths=[2, 3]), causal()), None, None, 5, 5)[0, 0].astype(int)
    array([[1, 0, 0, 0, 0],
           [1, 1, 0, 0, 0],
           [0, 0, 1, 0, 0],
           [0, 0, 1, 1, 0],
           [0, 0, 1, 1, 1]])
    >>> document(offsets=[0, 2, 5]).__name__
    'document([2, 3])'
    """
    if (lengths is None) == (offsets is None):
        raise TypeError(
            "document takes exactly one of lengths= and offsets=; got "
            f"lengths={lengths!r}, offsets={offsets!r}"
        )
    if offsets is not None:
        starts = _int_table(offsets, "offsets")
        if starts[0] != 0 or starts.size < 2 or (np.diff(starts) <= 0).any():
            raise ValueError(
                "offsets must start at 0 and increase, with at least one document; got "
                f"{starts.tolist()}"
            )
        sizes = np.diff(starts)
    else:
        sizes = _int_table(lengths, "lengths", minimum=1)
        starts = np.concatenate([[0], np.cumsum(sizes)])
    if inner is not None and not callable(inner):
        raise TypeError(f"inner must be a mask_mod or None; got {type(inner).__name__}")
    doc = np.repeat(np.arange(sizes.size), sizes)  # the document of each position
    doc_table, start = _Table(doc), _Table(starts[doc])  # and where that document starts

    def mod(b, h, q_idx, kv_idx):
        docs = doc_table.on(q_idx)
        same = docs[q_idx] == docs[kv_idx]
        if inner is None:
            return same
        first = start.on(q_idx)[q_idx]
        return same & inner(b, h, q_idx - first, kv_idx - first)

    name = f"document({sizes.tolist()})"
    if inner is not None:
        name = f"document({sizes.tolist()}, inner={getattr(inner, '__name__', 'inner')})"
    return _named(mod, name)


def tree(parents: Sequence[int], prefix: int = 0, *, query_offset: int = 0) -> Callable:
    """A draft tree's mask (speculative decoding): each tree token attends the prefix, itself
    and its ancestors.

    The key sequence is a prefix of ``P`` tokens followed by the ``n`` tree tokens, in an
    order where each parent comes before its children. Tree token ``i`` (position ``P + i``)
    may attend every prefix key, itself and its ancestors; a prefix query attends causally.

    Parameters
    ----------
    parents : sequence of int
        ``parents[i]``: the tree index of token ``i``'s parent, ``-1`` for a token that hangs
        from the prefix (a root), and less than ``i`` otherwise.
    prefix : int, default 0
        ``P``, the length of the prefix every tree token attends.
    query_offset : int, default 0
        The key position of query 0: ``P`` when the queries are the tree tokens alone (a
        verification pass over a cached prefix), 0 when they are the whole sequence.

    Returns
    -------
    callable
        A ``mask_mod`` named ``tree(n, P)``. Keys or queries beyond ``P + n`` are masked.

    Raises
    ------
    TypeError, ValueError
        If ``parents`` is not a 1-D sequence of integers with ``-1 <= parents[i] < i``, or
        ``prefix``/``query_offset`` is not a non-negative integer.

    Notes
    -----
    The ancestors are found once, as an ``(n, n)`` boolean table ``A[i, j]`` (``j`` is ``i``
    or an ancestor of ``i``), read by the mod at ``i * n + j``. Every path of the tree from
    a root to a leaf, verified alone with a causal mask, gives the same rows as the tree in
    one pass (``tests/sdpa/test_flex_mods.py`` asserts it).

    Examples
    --------
    Two candidates for the first token (0 and 1), then two continuations of candidate 0:

    >>> from sdpa import create_mask
    >>> from sdpa.flex_mods import tree
    >>> mod = tree([-1, -1, 0, 0], prefix=2, query_offset=2)
    >>> mod.__name__
    'tree(4, 2)'
    >>> create_mask(mod, None, None, 4, 6)[0, 0].astype(int)  # 4 tree queries, 6 keys
    array([[1, 1, 1, 0, 0, 0],
           [1, 1, 0, 1, 0, 0],
           [1, 1, 1, 0, 1, 0],
           [1, 1, 1, 0, 0, 1]])
    """
    P = check_int(prefix, "prefix", minimum=0)
    offset = check_int(query_offset, "query_offset", minimum=0)
    up = _int_table(parents, "parents", minimum=-1)
    n = up.size
    if (up >= np.arange(n)).any():
        raise ValueError(
            f"parents[i] must be -1 (a root) or a token before i (parents first); got {up.tolist()}"
        )
    ancestors = np.eye(n, dtype=bool)
    for i in range(n):  # a parent's row is complete before its children's
        if up[i] >= 0:
            ancestors[i] |= ancestors[up[i]]
    flat = _Table(
        ancestors.ravel().astype(np.int64)
    )  # integers: a torch table takes the index's dtype

    def mod(b, h, q_idx, kv_idx):
        q_pos = q_idx + offset  # the query's key position
        i, j = q_pos - P, kv_idx - P  # tree indices (negative in the prefix)
        in_tree = (i >= 0) & (i < n)
        seen = flat.on(q_idx)[i.clip(0, n - 1) * n + j.clip(0, n - 1)] > 0
        from_prefix = (i < 0) & (q_pos >= kv_idx)
        return from_prefix | (in_tree & ((j < 0) | (seen & (j < n))))

    return _named(mod, f"tree({n}, {P})")


# ----------------------------------------------------------------------------------------
# score_mods
# ----------------------------------------------------------------------------------------


def alibi(H: int) -> Callable:
    """ALiBi: each head's scores fall linearly with the distance, by its slope.

    Parameters
    ----------
    H : int
        The number of query heads; the slopes are :func:`sdpa.alibi_slopes` ``(H)``.

    Returns
    -------
    callable
        ``score_mod = score + slopes[h] * (kv_idx - q_idx)``, named ``alibi(H)``.

    Raises
    ------
    TypeError, ValueError
        If ``H`` is not a positive integer.

    Notes
    -----
    The bias is ``-slope * distance`` for keys before the query and positive after it:
    combine with a causal mask, as ALiBi's models do (:func:`sdpa.alibi_bias` is
    ``-slope * |distance|``: the same where the mask allows).

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa import alibi_bias
    >>> from sdpa.flex_mods import alibi
    >>> h, i, j = np.arange(4).reshape(4, 1, 1), np.arange(5).reshape(5, 1), np.arange(5)
    >>> bias = alibi(4)(np.zeros((4, 5, 5)), 0, h, i, j)
    >>> below = np.tri(5, dtype=bool)  # keys up to the query: sdpa.alibi_bias's values
    >>> bool(np.allclose(bias[:, below], alibi_bias(4, 5, 5)[:, below]))
    True
    """
    H = check_positive_int(H, "H")
    slopes = _Table(alibi_slopes(H))

    def mod(score, b, h, q_idx, kv_idx):
        return score + slopes.on(score)[h] * (kv_idx - q_idx)

    return _named(mod, f"alibi({H})")


def tanh_softcap(cap: float) -> Callable:
    """Soft-capping (Gemma 2, Grok-1): every score squeezed into ``(-cap, cap)`` by a tanh.

    Parameters
    ----------
    cap : float
        Positive and finite (Gemma 2 takes 50 for its attention scores).

    Returns
    -------
    callable
        ``score_mod = cap * tanh(score / cap)``, named ``tanh_softcap(cap)``.

    Raises
    ------
    TypeError, ValueError
        If ``cap`` is not a positive, finite real number.

    Notes
    -----
    NumPy spells the function ``np.tanh(x)`` and PyTorch ``x.tanh()``: the mod picks by the
    score's type (the one mod of the library that must).

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa.flex_mods import tanh_softcap
    >>> tanh_softcap(5)(np.array([-100.0, 0.0, 1.0, 100.0]), 0, 0, 0, 0).round(3)
    array([-5.   ,  0.   ,  0.987,  5.   ])
    """
    cap = check_real(cap, "cap", "a positive, finite real number", lambda c: 0 < c < np.inf)

    def mod(score, b, h, q_idx, kv_idx):
        x = score / cap
        return cap * (np.tanh(x) if isinstance(x, (np.ndarray, np.generic, float)) else x.tanh())

    return _named(mod, f"tanh_softcap({cap:g})")


def relative_bias(table) -> Callable:
    """A learned bias by relative position, clipped at a largest distance (T5-like, without
    T5's logarithmic buckets).

    Parameters
    ----------
    table : (2R + 1,) or (H, 2R + 1) array_like of float
        The bias of each distance ``kv_idx - q_idx`` from ``-R`` to ``R``, shared or per head;
        distances beyond ``R`` take the bias at ``+-R``.

    Returns
    -------
    callable
        ``score_mod = score + table[h, clip(kv_idx - q_idx, -R, R) + R]``, named
        ``relative_bias(R)`` (or ``relative_bias(H, R)``).

    Raises
    ------
    TypeError, ValueError
        If ``table`` is not a finite real array of 1 or 2 dimensions with an odd last length.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa.flex_mods import relative_bias
    >>> mod = relative_bias([-2.0, -1.0, 0.0, 0.5, 1.0])  # R = 2
    >>> mod(np.zeros((3, 4)), 0, 0, np.arange(3).reshape(3, 1), np.arange(4))
    array([[ 0. ,  0.5,  1. ,  1. ],
           [-1. ,  0. ,  0.5,  1. ],
           [-2. , -1. ,  0. ,  0.5]])
    """
    bias = np.array(table, dtype=np.float64) if np.asarray(table).dtype.kind in "fiu" else None
    if bias is None or bias.ndim not in (1, 2) or bias.shape[-1] % 2 == 0:
        raise TypeError(
            "table must be a real array (2R + 1,) or (H, 2R + 1), an odd count of distances; "
            f"got {np.asarray(table)!r}"
        )
    if not np.isfinite(bias).all():
        raise ValueError("table must be finite")
    R = bias.shape[-1] // 2
    width, per_head = 2 * R + 1, bias.ndim == 2
    flat = _Table(bias.ravel())

    def mod(score, b, h, q_idx, kv_idx):
        d = (kv_idx - q_idx).clip(-R, R) + R
        index = h * width + d if per_head else d
        return score + flat.on(score)[index]

    return _named(
        mod, f"relative_bias({bias.shape[0]}, {R})" if per_head else f"relative_bias({R})"
    )
