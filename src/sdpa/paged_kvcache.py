r"""A paged key/value cache: PagedAttention's memory model, in NumPy.

A server decoding for many requests at once cannot give each one a contiguous buffer of the
longest length it might reach: most of that memory would sit unused. A paged cache instead
keeps one *pool* of fixed-size blocks (pages) of ``block_size`` token slots, and gives each
sequence a *block table*, the list of the blocks that hold its tokens in order. A block is
taken from the pool only when a token needs it, so a sequence of ``L`` tokens holds
``ceil(L / block_size)`` blocks and wastes at most ``block_size - 1`` slots, in its last block.

Blocks can be shared. :meth:`sdpa.PagedKVCache.fork` starts a sequence that shares all of
another's blocks (a system prompt that many requests begin with, or several continuations of
one prompt), and a reference count per block says how many sequences hold it. Full blocks are
never written again, so they stay shared; a shared, partly filled last block is copied when a
sequence first writes into it (copy-on-write), so no sequence ever sees another's tokens.

Attention reads a sequence's keys and values through its block table
(:meth:`sdpa.PagedKVCache.keys_values`): on a GPU the kernel follows the table itself; here the
blocks are gathered into contiguous arrays and handed to
:func:`sdpa.scaled_dot_product_attention`.

The module's one class, :class:`sdpa.PagedKVCache`, is exported by the package and documented
with its names.

Shape letters: ``Hkv`` key/value heads, ``Hq`` query heads, ``L`` a sequence's length, ``T``
new queries, ``Dk`` and ``Dv`` the key and value widths.
"""

from __future__ import annotations

import heapq

import numpy as np
from numpy.typing import ArrayLike

from ._checks import (
    ATTENTION_MASK_HINT,
    as_float_array,
    check_float_dtype,
    check_int,
    check_memory,
    check_nonneg_int,
    check_positive_int,
    check_range,
)
from .attention import scaled_dot_product_attention

__all__ = ["PagedKVCache"]


class PagedKVCache:
    r"""One pool of key/value blocks shared by many sequences through their block tables.

    Parameters
    ----------
    num_blocks : int
        Blocks in the pool.
    block_size : int
        Token slots per block (per key/value head).
    n_kv_heads : int
        ``Hkv``.
    head_dim : int
        ``Dk``, the width of each key head.
    value_dim : int, optional
        ``Dv``; defaults to ``head_dim``.
    dtype : floating dtype, default float32
        Storage dtype of the pool (float16, float32 or float64). Appended keys and values are
        converted to it; a finite value beyond its range is a ``ValueError``.

    Attributes
    ----------
    num_blocks, block_size, n_kv_heads, head_dim, value_dim : int
        The sizes given (``value_dim`` filled in).
    dtype : np.dtype
        The pool's dtype.

    Raises
    ------
    TypeError
        If a size is not an integer or ``dtype`` is not a floating dtype.
    ValueError
        If ``num_blocks``, ``block_size`` or ``n_kv_heads`` is not positive, or ``head_dim``
        or ``value_dim`` is negative.
    MemoryError
        If the pool would not fit in the available memory.

    See Also
    --------
    sdpa.KVCache : One contiguous, growing buffer per layer.
    sdpa.merge_attention_states : Attention over parts of the keys, merged.

    Notes
    -----
    **Memory.** The pool holds the keys ``(num_blocks, Hkv, block_size, Dk)`` and the values
    ``(num_blocks, Hkv, block_size, Dv)``, allocated once. A sequence of ``L`` tokens holds
    ``ceil(L / block_size)`` blocks, so at most ``block_size - 1`` slots per sequence are
    unused (internal fragmentation), against ``max_length - L`` for a contiguous buffer of
    the longest length allowed. Forked sequences share their common blocks.

    **Copy-on-write.** A block records how many sequences hold it. An append that would
    write into a last block that other sequences hold too (possible only when it is partly
    filled: a full block is never written again) first copies it to a free block, which the
    writer then owns; the others keep the original. So the first of two sequences to write
    copies the block and the second writes in place.

    **Failures change nothing.** Every check, including the count of free blocks an append
    needs (new blocks, plus one for a copy-on-write), comes before the first change: an
    append that raises (``MemoryError`` when the pool runs out) leaves the pool, the block
    tables, the lengths and the free count as they were.

    **Sequence ids** are integers handed out by :meth:`new_sequence` and :meth:`fork`, never
    reused: an id that was freed, or never handed out, raises ``KeyError``.

    **Empty widths.** ``head_dim = 0`` or ``value_dim = 0`` is allowed, as in
    :func:`sdpa.scaled_dot_product_attention`: keys of width 0 give scores of 0 (each query
    spreads its weight evenly), values of width 0 give outputs of width 0.

    Examples
    --------
    A pool of 8 blocks of 4 slots. A prompt of 6 tokens takes 2 blocks (the second half
    full); a fork shares both; each continuation then writes into its own copy of the partly
    filled block, while the full first block stays shared:

    >>> import numpy as np
    >>> from sdpa import PagedKVCache
    >>> rng = np.random.default_rng(0)
    >>> cache = PagedKVCache(num_blocks=8, block_size=4, n_kv_heads=2, head_dim=3)
    >>> def tokens(n):  # keys (Hkv, n, Dk) and values (Hkv, n, Dv) of n new tokens
    ...     return rng.standard_normal((2, n, 3)), rng.standard_normal((2, n, 3))
    >>> prompt = cache.new_sequence()
    >>> cache.append(prompt, *tokens(6))
    >>> cache.block_table(prompt), cache.num_free_blocks
    ([0, 1], 6)
    >>> first = cache.fork(prompt)       # shares blocks 0 and 1, takes none
    >>> second = cache.fork(prompt)
    >>> cache.append(first, *tokens(1))  # block 1 is shared and partly filled: copied
    >>> cache.append(second, *tokens(3))
    >>> cache.block_table(first), cache.block_table(second), cache.block_table(prompt)
    ([0, 2], [0, 3, 4], [0, 1])
    >>> cache.length(first), cache.length(second), cache.num_free_blocks
    (7, 9, 3)

    Attention through the block table is attention over the gathered keys and values (two
    new query positions of 4 query heads, grouped over the 2 key/value heads):

    >>> from sdpa import scaled_dot_product_attention
    >>> query = rng.standard_normal((4, 2, 3))  # (Hq, T, Dk)
    >>> opts = dict(is_causal=True, causal_alignment="bottom_right", enable_gqa=True)
    >>> out = cache.attend(second, query, **opts)
    >>> K, V = cache.keys_values(second)
    >>> K.shape, out.shape
    ((2, 9, 3), (4, 2, 3))
    >>> bool(np.array_equal(out, scaled_dot_product_attention(query, K, V, **opts)))
    True

    Freeing the prompt returns nothing to the pool while its forks still hold its blocks;
    block 1 is returned, as only the prompt held it:

    >>> cache.free(prompt)
    >>> cache.num_free_blocks
    4
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        n_kv_heads: int,
        head_dim: int,
        value_dim: int | None = None,
        dtype=np.float32,
    ):
        self.num_blocks = check_positive_int(num_blocks, "num_blocks")
        self.block_size = check_positive_int(block_size, "block_size")
        self.n_kv_heads = check_positive_int(n_kv_heads, "n_kv_heads")
        self.head_dim = check_nonneg_int(head_dim, "head_dim")
        self.value_dim = (
            self.head_dim if value_dim is None else check_nonneg_int(value_dim, "value_dim")
        )
        self.dtype = check_float_dtype(dtype)
        slots = self.num_blocks * self.n_kv_heads * self.block_size
        check_memory(
            slots * (self.head_dim + self.value_dim) * self.dtype.itemsize,
            f"the pool of {self.num_blocks} blocks of {self.block_size} slots "
            f"(Hkv={self.n_kv_heads}, Dk={self.head_dim}, Dv={self.value_dim}, {self.dtype})",
            "use fewer or smaller blocks",
        )
        # The pool: block b holds token slots b * block_size ... of every sequence whose block
        # table lists it. (num_blocks, Hkv, block_size, Dk) and (..., Dv).
        shape = (self.num_blocks, self.n_kv_heads, self.block_size)
        self._keys = np.zeros((*shape, self.head_dim), dtype=self.dtype)
        self._values = np.zeros((*shape, self.value_dim), dtype=self.dtype)
        self._refs = [0] * self.num_blocks  # how many sequences hold each block
        self._free = list(range(self.num_blocks))  # a heap: the lowest free id is taken first
        self._tables: dict[int, list[int]] = {}  # sequence id -> its blocks, in order
        self._lengths: dict[int, int] = {}  # sequence id -> its tokens
        self._next_id = 0

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, "
            f"value_dim={self.value_dim}, dtype={self.dtype}, sequences={len(self._tables)}, "
            f"free_blocks={self.num_free_blocks})"
        )

    # -- sequences ---------------------------------------------------------------------------

    def _seq(self, seq) -> int:
        """A live sequence id, or ``TypeError`` (not an integer) / ``KeyError`` (not live)."""
        seq = check_int(seq, "seq")
        if seq not in self._tables:
            state = "was freed" if 0 <= seq < self._next_id else "was never handed out"
            raise KeyError(
                f"seq must be a live sequence id of this cache (from new_sequence or fork); "
                f"got seq={seq}, which {state}"
            )
        return seq

    def new_sequence(self) -> int:
        """Start an empty sequence; it takes no block until its first token.

        Returns
        -------
        seq : int
            The new sequence's id.

        Examples
        --------
        >>> from sdpa import PagedKVCache
        >>> cache = PagedKVCache(num_blocks=4, block_size=2, n_kv_heads=1, head_dim=2)
        >>> seq = cache.new_sequence()
        >>> seq, cache.length(seq), cache.block_table(seq), cache.num_free_blocks
        (0, 0, [], 4)
        """
        seq = self._next_id
        self._next_id += 1
        self._tables[seq] = []
        self._lengths[seq] = 0
        return seq

    def fork(self, seq: int) -> int:
        """Start a sequence that shares all of ``seq``'s tokens and blocks (prefix sharing).

        No block is taken: the new sequence's block table lists ``seq``'s blocks, whose
        reference counts go up by one. Whichever sequence first writes into a shared, partly
        filled last block copies it first (see Notes of :class:`PagedKVCache`).

        Parameters
        ----------
        seq : int
            A live sequence.

        Returns
        -------
        child : int
            The new sequence's id; its tokens are ``seq``'s.

        Raises
        ------
        TypeError
            If ``seq`` is not an integer.
        KeyError
            If ``seq`` is not a live sequence of this cache.

        Examples
        --------
        >>> import numpy as np
        >>> from sdpa import PagedKVCache
        >>> cache = PagedKVCache(num_blocks=4, block_size=2, n_kv_heads=1, head_dim=2)
        >>> parent = cache.new_sequence()
        >>> cache.append(parent, np.ones((1, 3, 2)), np.ones((1, 3, 2)))
        >>> child = cache.fork(parent)
        >>> cache.block_table(child), cache.length(child), cache.num_free_blocks
        ([0, 1], 3, 2)
        """
        table = self._tables[self._seq(seq)]
        child = self.new_sequence()
        self._tables[child] = list(table)
        self._lengths[child] = self._lengths[seq]
        for block in table:
            self._refs[block] += 1
        return child

    def share(self, blocks: list[int]) -> int:
        """Start a sequence whose tokens are those of the given full blocks, in order.

        Prefix caching: a server keeps the full blocks of prompts it has seen, and a new
        request whose prompt begins with the same tokens starts from them instead of
        computing them again. No block is taken; each given block's reference count goes up
        by one. The blocks must be held (by a sequence, or by another :meth:`share`) and
        full: the new sequence's length is ``len(blocks) * block_size``, and it writes its
        next token into a block of its own.

        Parameters
        ----------
        blocks : list of int
            Distinct ids of blocks that some live sequence holds, whose slots are all filled.

        Returns
        -------
        seq : int
            The new sequence's id.

        Raises
        ------
        TypeError
            If an id is not an integer.
        ValueError
            If an id is out of range, repeated, or of a block that no sequence holds.

        Examples
        --------
        >>> import numpy as np
        >>> from sdpa import PagedKVCache
        >>> cache = PagedKVCache(num_blocks=4, block_size=2, n_kv_heads=1, head_dim=1)
        >>> seq = cache.new_sequence()
        >>> cache.append(seq, np.arange(5.0).reshape(1, 5, 1), np.zeros((1, 5, 1)))
        >>> kept = cache.share(cache.block_table(seq)[:2])  # its first 4 tokens
        >>> cache.free(seq)  # the shared blocks stay; the third returns to the pool
        >>> cache.block_table(kept), cache.length(kept), cache.num_free_blocks
        ([0, 1], 4, 2)
        >>> cache.keys_values(kept)[0][0, :, 0]
        array([0., 1., 2., 3.], dtype=float32)
        """
        ids = [check_int(b, "blocks[]") for b in blocks]
        for b in ids:
            if not 0 <= b < self.num_blocks or self._refs[b] == 0:
                raise ValueError(
                    f"blocks must list blocks in [0, num_blocks={self.num_blocks}) that a "
                    f"sequence holds; got block {b}"
                )
        if len(set(ids)) != len(ids):
            raise ValueError(f"blocks must not repeat a block; got {ids}")
        seq = self.new_sequence()
        self._tables[seq] = ids
        self._lengths[seq] = len(ids) * self.block_size
        for b in ids:
            self._refs[b] += 1
        return seq

    def free(self, seq: int) -> None:
        """End ``seq``: its blocks return to the pool once no other sequence holds them.

        Parameters
        ----------
        seq : int
            A live sequence; its id is not valid afterwards.

        Raises
        ------
        TypeError
            If ``seq`` is not an integer.
        KeyError
            If ``seq`` is not a live sequence of this cache (never handed out, or freed).

        Examples
        --------
        >>> import numpy as np
        >>> from sdpa import PagedKVCache
        >>> cache = PagedKVCache(num_blocks=4, block_size=2, n_kv_heads=1, head_dim=2)
        >>> seq = cache.new_sequence()
        >>> cache.append(seq, np.ones((1, 3, 2)), np.ones((1, 3, 2)))
        >>> cache.num_free_blocks
        2
        >>> cache.free(seq)
        >>> cache.num_free_blocks
        4
        """
        seq = self._seq(seq)
        for block in self._tables.pop(seq):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                heapq.heappush(self._free, block)
        del self._lengths[seq]

    def length(self, seq: int) -> int:
        """The number of tokens ``seq`` holds.

        Parameters
        ----------
        seq : int
            A live sequence.

        Returns
        -------
        L : int
            Its length.

        Raises
        ------
        TypeError
            If ``seq`` is not an integer.
        KeyError
            If ``seq`` is not a live sequence of this cache.

        Examples
        --------
        >>> from sdpa import PagedKVCache
        >>> cache = PagedKVCache(num_blocks=4, block_size=2, n_kv_heads=1, head_dim=2)
        >>> cache.length(cache.new_sequence())
        0
        """
        return self._lengths[self._seq(seq)]

    def block_table(self, seq: int) -> list[int]:
        """The ids of the blocks that hold ``seq``'s tokens, in order (a copy).

        Parameters
        ----------
        seq : int
            A live sequence.

        Returns
        -------
        table : list of int
            Token ``t`` of the sequence is in block ``table[t // block_size]``, slot
            ``t % block_size``; ``len(table) == ceil(length(seq) / block_size)``.

        Raises
        ------
        TypeError
            If ``seq`` is not an integer.
        KeyError
            If ``seq`` is not a live sequence of this cache.

        Examples
        --------
        >>> import numpy as np
        >>> from sdpa import PagedKVCache
        >>> cache = PagedKVCache(num_blocks=4, block_size=2, n_kv_heads=1, head_dim=2)
        >>> a, b = cache.new_sequence(), cache.new_sequence()
        >>> for seq in (a, b, a):  # the blocks of two sequences interleave in the pool
        ...     cache.append(seq, np.ones((1, 2, 2)), np.ones((1, 2, 2)))
        >>> cache.block_table(a), cache.block_table(b)
        ([0, 2], [1])
        """
        return list(self._tables[self._seq(seq)])

    @property
    def num_free_blocks(self) -> int:
        """Blocks in the pool that no sequence holds."""
        return len(self._free)

    # -- writing -----------------------------------------------------------------------------

    def _check_tokens(self, x: np.ndarray, name: str, width: int) -> None:
        if x.ndim != 3 or x.shape[0] != self.n_kv_heads or x.shape[2] != width:
            raise ValueError(
                f"{name} must have shape (Hkv, n, D) = ({self.n_kv_heads}, n, {width}) for "
                f"this cache; got {name}.shape={x.shape}"
            )

    def _blocks_needed(self, seq: int, n: int) -> tuple[int, bool]:
        """``(new, copy)``: the blocks an append of ``n`` tokens to ``seq`` takes from the pool
        for new slots, and whether it first copies a shared, partly filled last block."""
        table, L = self._tables[seq], self._lengths[seq]
        new = -(-(L + n) // self.block_size) - len(table)
        copy = L % self.block_size != 0 and self._refs[table[-1]] > 1
        return new, copy

    def _take_block(self) -> int:
        block = heapq.heappop(self._free)
        self._refs[block] = 1
        return block

    def append(self, seq: int, key: ArrayLike, value: ArrayLike) -> None:
        """Append ``n >= 1`` tokens' keys and values to ``seq``, in order.

        Blocks are taken from the pool only as the new tokens need them (and one more to copy
        a shared, partly filled last block before writing into it).

        Parameters
        ----------
        seq : int
            A live sequence.
        key : (Hkv, n, Dk) array_like
            The new tokens' keys.
        value : (Hkv, n, Dv) array_like
            Their values. Both are converted to the cache's dtype; the inputs are not kept.

        Raises
        ------
        TypeError
            If ``seq`` is not an integer, or ``key``/``value`` are complex, object or masked
            arrays.
        KeyError
            If ``seq`` is not a live sequence of this cache.
        ValueError
            If the shapes do not fit the cache or each other, ``n = 0``, or a finite entry does
            not fit in the cache's dtype.
        MemoryError
            If the pool has fewer free blocks than the append needs; the message says how
            many it needs and how many are free, and the cache is unchanged.

        Examples
        --------
        >>> import numpy as np
        >>> from sdpa import PagedKVCache
        >>> cache = PagedKVCache(num_blocks=2, block_size=2, n_kv_heads=1, head_dim=1)
        >>> seq = cache.new_sequence()
        >>> cache.append(seq, np.ones((1, 3, 1)), np.ones((1, 3, 1)))  # 3 tokens: 2 blocks
        >>> try:
        ...     cache.append(seq, np.ones((1, 2, 1)), np.ones((1, 2, 1)))
        ... except MemoryError as error:
        ...     print(str(error)[:73])
        appending 2 tokens to sequence 0 (length 3) needs 1 free block, but 0 of
        >>> cache.length(seq)  # unchanged
        3
        """
        seq = self._seq(seq)
        k = as_float_array(key, "key", masked_hint=ATTENTION_MASK_HINT)
        v = as_float_array(value, "value", masked_hint=ATTENTION_MASK_HINT)
        self._check_tokens(k, "key", self.head_dim)
        self._check_tokens(v, "value", self.value_dim)
        if k.shape[1] != v.shape[1] or k.shape[1] == 0:
            raise ValueError(
                "key and value must hold the same number n >= 1 of new tokens (axis 1); "
                f"got key.shape={k.shape}, value.shape={v.shape}"
            )
        check_range(k, self.dtype, "key", ", the cache's dtype")
        check_range(v, self.dtype, "value", ", the cache's dtype")
        n, L = k.shape[1], self._lengths[seq]
        new, copy = self._blocks_needed(seq, n)
        if new + copy > self.num_free_blocks:
            why = " (one to copy a shared, partly filled last block)" if copy else ""
            s = "" if new + copy == 1 else "s"
            raise MemoryError(
                f"appending {n} tokens to sequence {seq} (length {L}) needs {new + copy} free "
                f"block{s}{why}, but {self.num_free_blocks} of {self.num_blocks} are free; "
                "nothing was appended: free finished sequences or use a larger pool"
            )
        # Every check is done: from here on nothing fails, so a failed call changed nothing.
        table = self._tables[seq]
        if copy:  # copy-on-write: the writer moves to its own copy; the others keep the block
            shared = table[-1]
            own = self._take_block()
            self._keys[own] = self._keys[shared]
            self._values[own] = self._values[shared]
            self._refs[shared] -= 1
            table[-1] = own
        table.extend(self._take_block() for _ in range(new))
        done = 0
        while done < n:  # token L + done goes to slot (L + done) % block_size of its block
            block, slot = divmod(L + done, self.block_size)
            take = min(self.block_size - slot, n - done)
            self._keys[table[block], :, slot : slot + take] = k[:, done : done + take]
            self._values[table[block], :, slot : slot + take] = v[:, done : done + take]
            done += take
        self._lengths[seq] = L + n

    # -- reading -----------------------------------------------------------------------------

    def keys_values(self, seq: int) -> tuple[np.ndarray, np.ndarray]:
        """``seq``'s keys and values, gathered through its block table into arrays of its own.

        Parameters
        ----------
        seq : int
            A live sequence.

        Returns
        -------
        keys : (Hkv, L, Dk) np.ndarray
            Its keys in order, in the cache's dtype (a copy).
        values : (Hkv, L, Dv) np.ndarray
            Its values.

        Raises
        ------
        TypeError
            If ``seq`` is not an integer.
        KeyError
            If ``seq`` is not a live sequence of this cache.

        Examples
        --------
        >>> import numpy as np
        >>> from sdpa import PagedKVCache
        >>> cache = PagedKVCache(num_blocks=4, block_size=2, n_kv_heads=1, head_dim=1)
        >>> a, b = cache.new_sequence(), cache.new_sequence()
        >>> cache.append(a, np.full((1, 1, 1), 1.0), np.zeros((1, 1, 1)))
        >>> cache.append(b, np.full((1, 3, 1), 9.0), np.zeros((1, 3, 1)))
        >>> cache.append(a, np.full((1, 2, 1), 2.0), np.zeros((1, 2, 1)))
        >>> cache.block_table(a)  # blocks 0 and 3, with b's 1 and 2 between them
        [0, 3]
        >>> cache.keys_values(a)[0][0, :, 0]
        array([1., 2., 2.], dtype=float32)
        """
        seq = self._seq(seq)
        table = np.asarray(self._tables[seq], dtype=np.intp)
        L = self._lengths[seq]
        result = []
        for pool in (self._keys, self._values):
            blocks = pool[table]  # (n_blocks, Hkv, block_size, D): a copy
            D = pool.shape[-1]
            # (n_blocks, Hkv, block_size, D) -> (Hkv, n_blocks * block_size, D) -> (Hkv, L, D);
            # the slots counted, not -1: with D = 0 there is nothing to infer them from
            slots = len(table) * self.block_size
            tokens = blocks.transpose(1, 0, 2, 3).reshape(self.n_kv_heads, slots, D)
            result.append(np.ascontiguousarray(tokens[:, :L]))
        return result[0], result[1]

    def attend(self, seq: int, query: ArrayLike, **kwargs):
        """Attention of ``query`` to ``seq``'s keys and values, through its block table.

        Parameters
        ----------
        seq : int
            A live sequence.
        query : (Hq, T, Dk) array_like
            The queries, typically the newest ``T`` tokens' (append their keys and values
            first).
        **kwargs
            Passed on to :func:`sdpa.scaled_dot_product_attention`: for decoding
            ``is_causal=True`` with ``causal_alignment="bottom_right"``, ``enable_gqa=True``
            when ``Hq != Hkv``, ``return_lse=True``, ``sinks``, ...

        Returns
        -------
        out : (Hq, T, Dv) np.ndarray or tuple
            What ``scaled_dot_product_attention(query, *keys_values(seq), **kwargs)`` returns.

        Raises
        ------
        TypeError
            If ``seq`` is not an integer, or as :func:`sdpa.scaled_dot_product_attention`.
        KeyError
            If ``seq`` is not a live sequence of this cache.
        ValueError
            If ``query`` is not ``(Hq, T, Dk)`` with this cache's ``Dk``, or as
            :func:`sdpa.scaled_dot_product_attention`.

        Examples
        --------
        >>> import numpy as np
        >>> from sdpa import PagedKVCache
        >>> cache = PagedKVCache(num_blocks=4, block_size=2, n_kv_heads=1, head_dim=2)
        >>> seq = cache.new_sequence()
        >>> cache.append(seq, np.zeros((1, 3, 2)), np.arange(6.0).reshape(1, 3, 2))
        >>> cache.attend(seq, np.zeros((2, 1, 2)))  # equal scores: the mean of the 3 values
        array([[[2., 3.]],
        <BLANKLINE>
               [[2., 3.]]])
        """
        seq = self._seq(seq)
        q = as_float_array(query, "query", masked_hint=ATTENTION_MASK_HINT)
        if q.ndim != 3 or q.shape[-1] != self.head_dim:
            raise ValueError(
                f"query must have shape (Hq, T, Dk) = (Hq, T, {self.head_dim}) for this cache; "
                f"got query.shape={q.shape}"
            )
        keys, values = self.keys_values(seq)
        return scaled_dot_product_attention(q, keys, values, **kwargs)
