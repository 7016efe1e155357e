r"""The serving engine's KV memory: a paged pool holding every layer, with a prefix cache.

:class:`BlockPool` keeps one :class:`sdpa.PagedKVCache` whose heads are every layer's key/value
heads side by side (``L * Hkv``), so that one block table per request serves all layers, and
one append stores a token's keys and values of every layer.

**Prefix caching** (vLLM's automatic prefix caching): a block filled entirely by prompt tokens
is keyed by a hash chain, ``key_j = sha256(key_{j-1} || tokens of block j)``, so that its key
names its tokens *and everything before them*: two prompts share block ``j`` only if they
agree on all of their first ``(j + 1) * block_size`` tokens. The cache holds each such block
through a one-block sequence of its own (:meth:`sdpa.PagedKVCache.share`), so the block
outlives the request that filled it. A cached block is *in use* while a request holds it;
unused ones wait in least-recently-used order and are evicted (their holder freed) only when
a block is needed and none is free.

**Reservations.** The scheduler decides a whole step before the pass writes anything; it
reserves the blocks each scheduled request may take, so that the writes after the pass never
find the pool short.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ..paged_kvcache import PagedKVCache

__all__: list[str] = []  # the engine's machinery: no public names


def block_keys(tokens: list[int], block_size: int, n_blocks: int) -> list[bytes]:
    """The hash-chain keys of the first ``n_blocks`` full blocks of ``tokens``."""
    keys, previous = [], b""
    for j in range(n_blocks):
        chunk = np.asarray(tokens[j * block_size : (j + 1) * block_size], dtype="<i8")
        previous = hashlib.sha256(previous + chunk.tobytes()).digest()
        keys.append(previous)
    return keys


@dataclass
class _Entry:
    """A cached block: its id, the one-block sequence that holds it, the requests using it."""

    block: int
    holder: int
    users: int = 0


class BlockPool:
    """Every layer's keys and values in one paged pool, and the prefix cache over it."""

    def __init__(self, model, num_blocks: int, block_size: int):
        self.layers, self.heads, self.block_size = model.n_layers, model.n_kv_heads, block_size
        self.num_blocks = num_blocks
        self.cache = PagedKVCache(
            num_blocks, block_size, model.n_layers * model.n_kv_heads, model.head_dim,
            dtype=model.dtype,
        )  # fmt: skip
        self.entries: dict[bytes, _Entry] = {}
        self.unused: OrderedDict[bytes, None] = OrderedDict()  # oldest first
        self.reserved = 0  # blocks promised to this step's scheduled requests

    # -- counting ----------------------------------------------------------------------------

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def in_use(self) -> int:
        """Blocks that some request holds (free and unused cached blocks are not)."""
        return self.num_blocks - self.cache.num_free_blocks - len(self.unused)

    def obtainable(self, pinned: list[bytes] = ()) -> int:
        """Blocks a new reservation could get: free ones not reserved, and unused cached ones
        (except ``pinned``, about to be used)."""
        evictable = len(self.unused) - sum(key in self.unused for key in pinned)
        return self.cache.num_free_blocks - self.reserved + evictable

    def reserve(self, n: int) -> bool:
        """Reserve ``n`` blocks, evicting unused cached blocks (oldest first) as needed;
        False, and nothing evicted, if there are not enough."""
        if n > self.obtainable():
            return False
        while self.cache.num_free_blocks - self.reserved < n:
            key, _ = self.unused.popitem(last=False)  # the least recently used
            self.cache.free(self.entries.pop(key).holder)
        self.reserved += n
        return True

    # -- prefix cache ------------------------------------------------------------------------

    def match(self, keys: list[bytes]) -> list[bytes]:
        """The longest run of ``keys`` from the first that the cache holds."""
        n = 0
        while n < len(keys) and keys[n] in self.entries:
            n += 1
        return keys[:n]

    def start(self, matched: list[bytes]) -> int:
        """A new sequence beginning with the cached blocks of ``matched`` (now in use)."""
        for key in matched:
            self._use(key)
        if not matched:
            return self.cache.new_sequence()
        return self.cache.share([self.entries[key].block for key in matched])

    def register(self, key: bytes, seq: int, index: int) -> bool:
        """Cache block ``index`` of ``seq`` (full, of prompt tokens) under ``key``; False if
        the key is cached already (the request keeps its own copy, unshared)."""
        if key in self.entries:
            return False
        block = self.cache.block_table(seq)[index]
        self.entries[key] = _Entry(block, self.cache.share([block]))
        self._use(key)
        return True

    def _use(self, key: bytes) -> None:
        entry = self.entries[key]
        entry.users += 1
        self.unused.pop(key, None)

    def release(self, seq: int, keys: list[bytes]) -> None:
        """Free ``seq``; the cached blocks of ``keys`` it used become unused when no request
        holds them (the most recently used, at the end of the order)."""
        self.cache.free(seq)
        for key in keys:
            entry = self.entries[key]
            entry.users -= 1
            if entry.users == 0:
                self.unused[key] = None

    # -- keys and values ---------------------------------------------------------------------

    def read(self, seq: int) -> tuple[np.ndarray, np.ndarray]:
        """``seq``'s keys and values ``(L, Hkv, S, Dk)``, gathered through its block table."""
        keys, values = self.cache.keys_values(seq)  # (L Hkv, S, Dk)
        shape = (self.layers, self.heads, keys.shape[1], keys.shape[2])
        return keys.reshape(shape), values.reshape(shape)

    def write(self, seq: int, keys: np.ndarray, values: np.ndarray) -> None:
        """Append tokens' keys and values ``(L, Hkv, n, Dk)``, taking reserved blocks."""
        before = self.cache.num_free_blocks
        n, d = keys.shape[2], keys.shape[3]
        self.cache.append(
            seq,
            keys.reshape(self.layers * self.heads, n, d),
            values.reshape(self.layers * self.heads, n, d),
        )
        self.reserved -= before - self.cache.num_free_blocks
