r"""Block masks: which tiles of the score matrix a ``mask_mod`` leaves empty, full or partial.

A *mask_mod* says, for each query ``i`` and key ``j`` of each batch entry ``b`` and head ``h``,
whether ``i`` may attend ``j``: ``mask_mod(b, h, q_idx, kv_idx) -> bool array``, written as one
vectorised NumPy expression of four integer index arrays that broadcast against each other
(``q_idx >= kv_idx`` is a causal mask). :func:`sdpa.create_block_mask` cuts the
``(Q_LEN, KV_LEN)`` matrix into blocks of ``BLOCK_SIZE = (q, kv)`` entries and records, once,
what each block holds:

* **empty**: no entry allowed. Attention never computes it (the saving: about half the blocks
  of a causal mask, most of a sliding window's);
* **full**: every entry allowed. Attention computes it without calling ``mask_mod``;
* **partial**: some entries allowed. Attention computes it and applies ``mask_mod`` to it.

:class:`sdpa.BlockMask` stores the answer as PyTorch's FlexAttention does: for each query
block, the number and indices of its partial key blocks (``kv_num_blocks``, ``kv_indices``)
and of its full ones (``full_kv_num_blocks``, ``full_kv_indices``), and, for reading, the
kind of every block (``kinds``). :func:`sdpa.flex_attention` uses it.

``mask_mod`` is evaluated one band of query blocks at a time, so creating the mask of a long
sequence never holds the whole ``(Q_LEN, KV_LEN)`` boolean matrix: at most about ``2**22``
entries (4 MiB) at once, or one row of blocks where that holds more. With ``B`` or ``H`` None
the mask is the same for every batch entry or head, and ``mask_mod`` is called with ``b = 0``
or ``h = 0``.

Shape letters: ``B`` batch, ``H`` heads, ``Q_LEN`` and ``KV_LEN`` the lengths (``T`` and ``S``
of the attention call), ``q`` and ``kv`` the block sizes.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable
from functools import reduce
from numbers import Integral

import numpy as np

from ._checks import as_array, broadcasts_to, check_positive_int

__all__ = ["BlockMask", "and_masks", "create_block_mask", "create_mask", "noop_mask", "or_masks"]

EMPTY, PARTIAL, FULL = 0, 1, 2  # what a block holds

# Entries of mask_mod's result evaluated at once by create_block_mask (bools: 4 MiB).
CHUNK_ENTRIES = 1 << 22


def check_mod(mod, name: str, signature: str) -> Callable:
    """``mod`` if it is callable, else ``TypeError`` naming the expected signature."""
    if not callable(mod):
        raise TypeError(f"{name} must be a callable {signature}; got {type(mod).__name__}")
    return mod


def index_arrays(b, h, q_idx, kv_idx) -> tuple[np.ndarray, ...]:
    """Four integer arrays ``(n_b, 1, 1, 1)``, ``(1, n_h, 1, 1)``, ``(1, 1, n_q, 1)``,
    ``(1, 1, 1, n_kv)`` from four 1-D index sequences: what the mods receive."""
    return tuple(
        np.asarray(x, dtype=np.intp).reshape([-1 if axis == a else 1 for a in range(4)])
        for axis, x in enumerate((b, h, q_idx, kv_idx))
    )


def evaluate_mask_mod(mask_mod: Callable, b, h, q_idx, kv_idx) -> np.ndarray:
    """``mask_mod`` on the index arrays of :func:`index_arrays`, checked: a bool array that
    broadcasts to ``(n_b, n_h, n_q, n_kv)``, returned with its batch and head axes kept as the
    mod returned them (1 when it does not vary along them) and the others broadcast."""
    b, h, q_idx, kv_idx = index_arrays(b, h, q_idx, kv_idx)
    shape = (b.size, h.size, q_idx.size, kv_idx.size)
    allowed = as_array(mask_mod(b, h, q_idx, kv_idx), "mask_mod's result")
    if allowed.dtype != np.bool_:
        raise TypeError(
            f"mask_mod must return a bool array (True = may attend); got dtype {allowed.dtype}"
        )
    if not broadcasts_to(allowed.shape, shape):
        raise ValueError(
            f"mask_mod must return an array that broadcasts to the shape of its index arrays "
            f"(b, h, q_idx, kv_idx) = {shape}; got shape {allowed.shape}"
        )
    allowed = allowed.reshape((1,) * (4 - allowed.ndim) + allowed.shape)
    return np.broadcast_to(allowed, (*allowed.shape[:2], q_idx.size, kv_idx.size))


def _check_block_size(BLOCK_SIZE) -> tuple[int, int]:
    message = "BLOCK_SIZE must be a positive integer or a pair (q, kv) of positive integers"
    if isinstance(BLOCK_SIZE, (tuple, list)):
        if len(BLOCK_SIZE) != 2:
            raise ValueError(f"{message}; got {BLOCK_SIZE!r}")
        sizes = BLOCK_SIZE
    else:
        sizes = (BLOCK_SIZE, BLOCK_SIZE)
    for size in sizes:
        if isinstance(size, (bool, np.bool_)) or not isinstance(size, Integral):
            raise TypeError(f"{message}; got {BLOCK_SIZE!r}")
        if size < 1:
            raise ValueError(f"{message}; got {BLOCK_SIZE!r}")
    return int(sizes[0]), int(sizes[1])


def _check_count(value, name: str) -> int | None:
    """``B`` or ``H``: None (the same mask for all) or a positive integer."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be a positive integer or None; got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive integer or None; got {value!r}")
    return int(value)


class BlockMask:
    """Which blocks of the ``(Q_LEN, KV_LEN)`` score matrix a mask leaves empty, partial or full.

    Built by :func:`sdpa.create_block_mask`, not by hand. Immutable: its arrays are read-only.
    The tiled path of :func:`sdpa.flex_attention` keeps, beside the mask, what ``mask_mod``
    gave on its partial blocks (``sdpa.tuning.PLAN_CACHE_BYTES`` at most), so that a mask used by
    many calls evaluates each partial block once: like the block structure, a snapshot of
    ``mask_mod`` (a mask whose ``mask_mod`` reads data that changed must be created again).
    Those plans go with the mask, and are not part of it: a mask pickles and deep-copies at
    any time (the copy makes its own plans; its ``mask_mod`` must pickle, as with PyTorch).

    Parameters
    ----------
    mask_mod : callable
        ``mask_mod(b, h, q_idx, kv_idx) -> bool array``, True = may attend.
    shape : tuple of int
        ``(B, H, Q_LEN, KV_LEN)``, with 1 for a ``B`` or ``H`` that was None.
    BLOCK_SIZE : tuple of int
        ``(q, kv)``: query rows and key columns per block.
    kinds : (B, H, n_q, n_kv) np.ndarray of int
        What each block holds: 0 empty, 1 partial, 2 full; ``n_q = ceil(Q_LEN / q)`` and
        ``n_kv = ceil(KV_LEN / kv)``.

    Attributes
    ----------
    shape : tuple of int
        ``(B, H, Q_LEN, KV_LEN)``, with 1 for a ``B`` or ``H`` that was None.
    BLOCK_SIZE : tuple of int
        ``(q, kv)``.
    mask_mod : callable
        The function the mask was created from.
    kv_num_blocks : (B, H, n_q) np.ndarray of int32
        Partial key blocks of each query block.
    kv_indices : (B, H, n_q, n_kv) np.ndarray of int32
        Per query block, its partial key blocks first, in increasing order, then the other key
        blocks in increasing order (only the first ``kv_num_blocks`` entries are meaningful).
    full_kv_num_blocks : (B, H, n_q) np.ndarray of int32
        Full key blocks of each query block.
    full_kv_indices : (B, H, n_q, n_kv) np.ndarray of int32
        As ``kv_indices``, for the full blocks.

    See Also
    --------
    create_block_mask : Make one from a ``mask_mod``.

    Examples
    --------
    A causal mask over 8 x 8 scores in blocks of 4 x 4: block (0, 1) is empty, the diagonal
    blocks are partial, block (1, 0) is full:

    >>> from sdpa import create_block_mask
    >>> mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 8, 8,
    ...                          BLOCK_SIZE=4)
    >>> mask
    BlockMask(shape=(1, 1, 8, 8), BLOCK_SIZE=(4, 4), sparsity=25.00%)
    >>> mask.kv_num_blocks[0, 0], mask.full_kv_num_blocks[0, 0]  # per query block
    (array([1, 1], dtype=int32), array([0, 1], dtype=int32))
    >>> mask.kv_indices[0, 0, :, :1]  # the partial one of each query block
    array([[0],
           [1]], dtype=int32)
    """

    def __init__(self, mask_mod: Callable, shape: tuple, BLOCK_SIZE: tuple, kinds: np.ndarray):
        self.mask_mod = mask_mod
        self.shape = tuple(int(n) for n in shape)
        self.BLOCK_SIZE = tuple(int(n) for n in BLOCK_SIZE)
        n_q = -(-self.shape[2] // self.BLOCK_SIZE[0])
        n_kv = -(-self.shape[3] // self.BLOCK_SIZE[1])
        expected = (*self.shape[:2], n_q, n_kv)
        if kinds.shape != expected:
            raise ValueError(
                f"kinds must have the shape (B, H, n_q, n_kv) = {expected} of the blocks; "
                f"got kinds.shape={kinds.shape}"
            )
        self._kinds = np.array(kinds, dtype=np.int8)
        self._kinds.flags.writeable = False
        self.kv_num_blocks, self.kv_indices = _torch_layout(self._kinds == PARTIAL)
        self.full_kv_num_blocks, self.full_kv_indices = _torch_layout(self._kinds == FULL)

    @property
    def kinds(self) -> np.ndarray:
        """What each block holds: 0 empty, 1 partial (``mask_mod`` applied), 2 full.

        Returns
        -------
        (B, H, n_q, n_kv) np.ndarray of int8
            Read-only; ``n_q = ceil(Q_LEN / q)``, ``n_kv = ceil(KV_LEN / kv)``.

        Examples
        --------
        >>> from sdpa import create_block_mask
        >>> window = create_block_mask(lambda b, h, i, j: abs(i - j) <= 1, None, None, 9, 9,
        ...                            BLOCK_SIZE=3)
        >>> window.kinds[0, 0]  # a band of width 3: partial blocks along the diagonal
        array([[1, 1, 0],
               [1, 1, 1],
               [0, 1, 1]], dtype=int8)
        """
        return self._kinds

    def to_dense(self) -> np.ndarray:
        """The blocks that hold at least one allowed entry.

        Returns
        -------
        (B, H, n_q, n_kv) np.ndarray of bool
            True where the block is partial or full; ``B`` and ``H`` are 1 where the mask was
            created with None.

        Examples
        --------
        >>> from sdpa import create_block_mask
        >>> mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, 6, 6, BLOCK_SIZE=2)
        >>> mask.to_dense()[0, 0].astype(int)
        array([[1, 0, 0],
               [1, 1, 0],
               [1, 1, 1]])
        """
        return self._kinds != EMPTY

    def sparsity(self) -> float:
        """The percentage of blocks with no allowed entry: the share attention skips.

        Returns
        -------
        float
            ``100 * (empty blocks) / (all blocks)``, from 0 to 100, over every batch entry and
            head the mask holds.

        Examples
        --------
        Causal, 4 x 4 blocks: the 6 above the diagonal are empty, 6 of 16:

        >>> from sdpa import create_block_mask
        >>> mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, 64, 64, BLOCK_SIZE=16)
        >>> mask.sparsity()
        37.5
        """
        return 100.0 * float(np.count_nonzero(self._kinds == EMPTY)) / self._kinds.size

    def __repr__(self) -> str:
        return (
            f"BlockMask(shape={self.shape}, BLOCK_SIZE={self.BLOCK_SIZE}, "
            f"sparsity={self.sparsity():.2f}%)"
        )


def _torch_layout(chosen: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(num_blocks, indices)`` of the chosen key blocks of each query block, as FlexAttention
    stores them: the chosen ones first, each group in increasing order (a stable sort)."""
    num = chosen.sum(axis=-1, dtype=np.int32)  # (B, H, n_q)
    indices = np.argsort(~chosen, axis=-1, kind="stable").astype(np.int32)  # (B, H, n_q, n_kv)
    num.flags.writeable = False
    indices.flags.writeable = False
    return num, indices


def _block_kinds(allowed: np.ndarray, q_starts: np.ndarray, kv_starts: np.ndarray) -> np.ndarray:
    """``(..., len(q_starts), len(kv_starts))`` kinds of the blocks of ``allowed`` (..., rows,
    cols) that start at those rows and columns (the last block of each axis may be shorter)."""
    # The count of allowed entries per block, against the block's size.
    counts = np.add.reduceat(allowed, kv_starts, axis=-1, dtype=np.int32)
    counts = np.add.reduceat(counts, q_starts, axis=-2)
    rows = np.diff(np.append(q_starts, allowed.shape[-2]))
    cols = np.diff(np.append(kv_starts, allowed.shape[-1]))
    sizes = rows[:, None] * cols[None, :]
    kinds = np.where(counts == 0, EMPTY, np.where(counts == sizes, FULL, PARTIAL))
    return kinds.astype(np.int8)


def create_block_mask(
    mask_mod: Callable,
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    BLOCK_SIZE: int | tuple[int, int] = 128,
) -> BlockMask:
    r"""Evaluate ``mask_mod`` block by block, recording which blocks are empty, partial or full.

    Parameters
    ----------
    mask_mod : callable
        ``mask_mod(b, h, q_idx, kv_idx) -> bool array``, True = may attend. It receives four
        integer arrays that broadcast against each other, of shapes ``(n_b, 1, 1, 1)``,
        ``(1, n_h, 1, 1)``, ``(1, 1, n_q, 1)`` and ``(1, 1, 1, n_kv)`` (batch entries, heads,
        query positions, key positions), and returns a bool array that broadcasts to their
        shape: ``q_idx >= kv_idx`` is causal. Indices are always inside the matrix.
    B : int or None
        Batch size; None when the mask is the same for every batch entry (then ``b = 0``).
    H : int or None
        Number of query heads; None when the mask is the same for every head (then ``h = 0``).
    Q_LEN : int
        Number of queries ``T``, positive.
    KV_LEN : int
        Number of keys ``S``, positive.
    BLOCK_SIZE : int or (int, int), default 128
        Block size, the same for queries and keys, or a pair ``(q, kv)``. Attention skips whole
        blocks, so smaller blocks follow a mask's edge more closely and larger ones cost less
        per entry.

    Returns
    -------
    BlockMask
        Of shape ``(B or 1, H or 1, Q_LEN, KV_LEN)``.

    Raises
    ------
    TypeError
        If ``mask_mod`` is not callable or returns something other than a bool array, or a
        size is not an integer.
    ValueError
        If a size is not positive, ``BLOCK_SIZE`` is not an integer or a pair, or the result
        of ``mask_mod`` does not broadcast to the shape of its index arrays.

    Notes
    -----
    Block ``(m, n)`` covers queries ``m q : (m + 1) q`` and keys ``n kv : (n + 1) kv``, cut at
    ``Q_LEN`` and ``KV_LEN``: a last, shorter block is full when all of its entries are
    allowed (PyTorch counts the padding beyond the lengths as masked, so its last block is
    never full). ``mask_mod`` is called on bands of whole query blocks, each of at most about
    ``2**22`` entries (one query block at least), so memory stays small however long the
    sequences; a mod that does not depend on ``b`` or ``h`` is evaluated once for all of them.

    Examples
    --------
    The masks of the book, each one line:

    >>> import numpy as np
    >>> from sdpa import create_block_mask
    >>> def causal(b, h, q_idx, kv_idx):
    ...     return q_idx >= kv_idx
    >>> def sliding_window(b, h, q_idx, kv_idx):
    ...     return (q_idx >= kv_idx) & (q_idx - kv_idx < 256)
    >>> document = np.repeat([0, 1, 2], [300, 500, 224])  # the document of each position
    >>> def same_document(b, h, q_idx, kv_idx):
    ...     return document[q_idx] == document[kv_idx]
    >>> for mask_mod in (causal, sliding_window, same_document):
    ...     mask = create_block_mask(mask_mod, None, None, 1024, 1024)
    ...     print(f"{mask_mod.__name__}: {mask.sparsity():.1f} % of the 8 x 8 blocks empty")
    causal: 43.8 % of the 8 x 8 blocks empty
    sliding_window: 67.2 % of the 8 x 8 blocks empty
    same_document: 43.8 % of the 8 x 8 blocks empty

    A mask per batch entry: a padding mask that keeps the first ``lengths[b]`` keys.

    >>> lengths = np.array([5, 8])
    >>> padding = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx < lengths[b],
    ...                             2, None, 4, 8, BLOCK_SIZE=(4, 2))
    >>> padding.to_dense()[:, 0].astype(int)  # (B, n_q, n_kv)
    array([[[1, 1, 1, 0]],
    <BLANKLINE>
           [[1, 1, 1, 1]]])
    """
    check_mod(mask_mod, "mask_mod", "mask_mod(b, h, q_idx, kv_idx) -> bool array")
    n_batch = _check_count(B, "B")
    n_heads = _check_count(H, "H")
    T = check_positive_int(Q_LEN, "Q_LEN")
    S = check_positive_int(KV_LEN, "KV_LEN")
    block_q, block_kv = _check_block_size(BLOCK_SIZE)
    shape = (n_batch or 1, n_heads or 1, T, S)
    n_q, n_kv = -(-T // block_q), -(-S // block_kv)
    kinds = np.empty((*shape[:2], n_q, n_kv), dtype=np.int8)
    kv_starts = np.arange(0, S, block_kv)
    # Whole query blocks per band, about CHUNK_ENTRIES entries for each batch entry and head.
    band = max(1, CHUNK_ENTRIES // (shape[0] * shape[1] * block_q * S)) * block_q
    for t0 in range(0, T, band):
        t1 = min(T, t0 + band)
        allowed = evaluate_mask_mod(
            mask_mod, range(shape[0]), range(shape[1]), range(t0, t1), range(S)
        )  # (1 or B, 1 or H, t1 - t0, S)
        band_kinds = _block_kinds(allowed, np.arange(0, t1 - t0, block_q), kv_starts)
        kinds[:, :, t0 // block_q : -(-t1 // block_q)] = band_kinds
    return BlockMask(mask_mod, shape, (block_q, block_kv), kinds)


# ----------------------------------------------------------------------------------------
# PyTorch's helpers: the mask that allows everything, combinations of masks, a dense mask
# ----------------------------------------------------------------------------------------


def noop_mask(b, h, q_idx, kv_idx) -> np.ndarray:
    """The ``mask_mod`` that allows every entry: True everywhere.

    Parameters
    ----------
    b, h, q_idx, kv_idx : array_like of int
        Index arrays that broadcast against each other, as a ``mask_mod`` receives them.

    Returns
    -------
    np.ndarray of bool
        True, of the indices' broadcast shape.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa import create_mask, noop_mask
    >>> create_mask(noop_mask, None, None, 2, 3).all()
    np.True_
    """
    shape = np.broadcast_shapes(*(np.shape(x) for x in (b, h, q_idx, kv_idx)))
    return np.ones(shape, dtype=bool)


def _combined(mask_mods: tuple, name: str, op: Callable, empty: bool) -> Callable:
    for i, mod in enumerate(mask_mods):
        if not callable(mod):
            raise TypeError(
                f"{name} takes mask_mods, callables mask_mod(b, h, q_idx, kv_idx) -> bool "
                f"array; argument {i} is a {type(mod).__name__}"
            )

    def combined(b, h, q_idx, kv_idx):
        if not mask_mods:
            return noop_mask(b, h, q_idx, kv_idx) == empty
        # Operators only, so that the combination also runs on torch tensors.
        return reduce(op, (mod(b, h, q_idx, kv_idx) for mod in mask_mods))

    names = ", ".join(getattr(mod, "__name__", type(mod).__name__) for mod in mask_mods)
    combined.__name__ = combined.__qualname__ = f"{name}({names})"
    return combined


def and_masks(*mask_mods: Callable) -> Callable:
    """The ``mask_mod`` that allows an entry where every one of ``mask_mods`` allows it.

    Parameters
    ----------
    *mask_mods : callable
        ``mask_mod(b, h, q_idx, kv_idx) -> bool array`` each.

    Returns
    -------
    callable
        A ``mask_mod``: the entrywise AND of their results (True everywhere with none).

    Raises
    ------
    TypeError
        If an argument is not callable.

    Notes
    -----
    The results are combined with ``&``, so the combination runs on whatever the mods run on
    (NumPy arrays here, torch tensors in PyTorch's FlexAttention).

    Examples
    --------
    A causal sliding window of 3 positions (the position itself and the two before it):

    >>> from sdpa import and_masks, create_mask
    >>> causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
    >>> near = lambda b, h, q_idx, kv_idx: q_idx - kv_idx < 3
    >>> create_mask(and_masks(causal, near), None, None, 5, 5)[0, 0].astype(int)
    array([[1, 0, 0, 0, 0],
           [1, 1, 0, 0, 0],
           [1, 1, 1, 0, 0],
           [0, 1, 1, 1, 0],
           [0, 0, 1, 1, 1]])
    """
    return _combined(mask_mods, "and_masks", operator.and_, True)


def or_masks(*mask_mods: Callable) -> Callable:
    """The ``mask_mod`` that allows an entry where any one of ``mask_mods`` allows it.

    Parameters
    ----------
    *mask_mods : callable
        ``mask_mod(b, h, q_idx, kv_idx) -> bool array`` each.

    Returns
    -------
    callable
        A ``mask_mod``: the entrywise OR of their results (False everywhere with none).

    Raises
    ------
    TypeError
        If an argument is not callable.

    Notes
    -----
    The results are combined with ``|``, so the combination runs on whatever the mods run on.

    Examples
    --------
    Prefix-LM: the first 2 positions are seen by all, the rest causally:

    >>> from sdpa import create_mask, or_masks
    >>> causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
    >>> prefix = lambda b, h, q_idx, kv_idx: kv_idx < 2
    >>> create_mask(or_masks(causal, prefix), None, None, 4, 4)[0, 0].astype(int)
    array([[1, 1, 0, 0],
           [1, 1, 0, 0],
           [1, 1, 1, 0],
           [1, 1, 1, 1]])
    """
    return _combined(mask_mods, "or_masks", operator.or_, False)


def _positional_count(mod_fn: Callable) -> int:
    """The number of positional parameters without a default, as PyTorch counts them."""
    try:
        parameters = inspect.signature(mod_fn).parameters.values()
    except (TypeError, ValueError):  # no signature (some builtins): treat as unknown
        return -1
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in kinds and p.default is inspect.Parameter.empty for p in parameters)


def create_mask(mod_fn: Callable, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int):
    """The dense boolean mask of a ``mask_mod``, or of a ``score_mod``'s ``-inf`` entries.

    Parameters
    ----------
    mod_fn : callable
        A ``mask_mod(b, h, q_idx, kv_idx)`` (four positional parameters), or a
        ``score_mod(score, b, h, q_idx, kv_idx)`` (five), told apart by their count as
        PyTorch does.
    B, H : int or None
        Batch size and number of heads; None for 1 (the mask is the same for all).
    Q_LEN, KV_LEN : int
        Number of queries and keys, positive.

    Returns
    -------
    (B or 1, H or 1, Q_LEN, KV_LEN) np.ndarray of bool
        A mask_mod's result everywhere; for a score_mod, True where it does not return
        ``-inf`` when called on zero scores (float32, as PyTorch).

    Raises
    ------
    TypeError
        If ``mod_fn`` is not callable, has neither 4 nor 5 positional parameters, or (a
        mask_mod) returns no bool array; if a size is not an integer.
    ValueError
        If a size is not positive, or the mod's result does not broadcast to the indices.

    Notes
    -----
    The whole matrix is evaluated at once: for long sequences, :func:`sdpa.create_block_mask`
    holds a band at a time.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa import create_mask
    >>> create_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 3, 3)[0, 0]
    array([[ True, False, False],
           [ True,  True, False],
           [ True,  True,  True]])
    >>> def window_bias(score, b, h, q_idx, kv_idx):
    ...     return np.where(q_idx - kv_idx > 1, -np.inf, score)
    >>> create_mask(window_bias, None, None, 3, 3)[0, 0].astype(int)
    array([[1, 1, 1],
           [1, 1, 1],
           [0, 1, 1]])
    """
    check_mod(mod_fn, "mod_fn", "mask_mod(b, h, q_idx, kv_idx) or score_mod(score, b, ...)")
    count = _positional_count(mod_fn)
    if count not in (4, 5):
        raise TypeError(
            "mod_fn must be a mask_mod(b, h, q_idx, kv_idx) or a score_mod(score, b, h, q_idx, "
            f"kv_idx): 4 or 5 positional parameters without defaults; got {count}"
        )
    shape = (_check_count(B, "B") or 1, _check_count(H, "H") or 1)
    shape += (check_positive_int(Q_LEN, "Q_LEN"), check_positive_int(KV_LEN, "KV_LEN"))
    ranges = [range(n) for n in shape]
    if count == 4:
        return np.broadcast_to(evaluate_mask_mod(mod_fn, *ranges), shape).copy()
    result = as_array(mod_fn(np.zeros(shape, np.float32), *index_arrays(*ranges)), "the result")
    if result.dtype.kind not in "fiu" or not broadcasts_to(result.shape, shape):
        raise ValueError(
            f"mod_fn, a score_mod, must return real scores that broadcast to {shape}; got "
            f"dtype {result.dtype}, shape {result.shape}"
        )
    return np.broadcast_to(~np.isneginf(result), shape).copy()
