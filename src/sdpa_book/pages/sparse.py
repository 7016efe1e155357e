"""Helpers of the page *Sparse attention*: a sequence whose attention is concentrated, and
the work of top-k block selection counted exactly.

A block-selection method can only be judged on data whose attention *is* concentrated: with
random Gaussian queries and keys every key gets about the same weight and no small set of
blocks holds much of it. :func:`topic_sequence` builds queries and keys with a stated
structure (segments about topics, each query asking about the topic of an earlier segment), so
that dense attention puts most of a query's weight on a few places.

:func:`sparse_entries` counts what MoBA-style selection computes for a causal sequence of
``n`` tokens: the attention entries of each query's own block (up to the query) and of its
``n_top`` chosen earlier blocks, and the gate's entries (one per earlier block and query).

Shape letters: ``n`` tokens (``T = S = n``), ``Dk`` and ``Dv`` the head widths, ``Bk`` the
key block.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Real

import numpy as np

from sdpa_book.checks import check_count

__all__ = ["TopicSequence", "sparse_entries", "topic_sequence"]


@dataclass(frozen=True)
class TopicSequence:
    """Queries, keys and values of one head over a sequence of segments about topics.

    Made by :func:`topic_sequence`, which documents the construction.

    Attributes
    ----------
    query : (n, Dk) np.ndarray
        ``signal * u[query_topic] + noise``.
    key : (n, Dk) np.ndarray
        ``signal * u[key_topic] + noise``.
    value : (n, Dv) np.ndarray
        Standard normal, independent of the topics.
    key_topic : (n,) np.ndarray of int
        The topic of the segment each token belongs to.
    query_topic : (n,) np.ndarray of int
        The topic each token's query asks about: that of an earlier segment (the first
        segment asks about its own).
    segment : (n,) np.ndarray of int
        The segment of each token, numbered from 0.
    """

    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    key_topic: np.ndarray
    query_topic: np.ndarray
    segment: np.ndarray


def _segment_range(segment) -> tuple[int, int]:
    if not isinstance(segment, (tuple, list)) or len(segment) != 2:
        raise TypeError(f"segment must be a pair (shortest, longest); got {segment!r}")
    shortest = check_count(segment[0], "segment[0]")
    longest = check_count(segment[1], "segment[1]")
    if longest < shortest:
        raise ValueError(
            f"segment must be (shortest, longest) with shortest <= longest; got {segment}"
        )
    return shortest, longest


def topic_sequence(
    rng: np.random.Generator,
    n: int,
    Dk: int,
    Dv: int | None = None,
    *,
    n_topics: int = 64,
    segment: tuple[int, int] = (16, 64),
    signal: float | None = None,
) -> TopicSequence:
    r"""A sequence of segments about topics, whose queries ask about earlier segments.

    The construction:

    1. ``n_topics`` topics, each a random unit direction ``u[c]`` in ``Dk`` dimensions;
    2. the ``n`` tokens cut into segments of random lengths, uniform from ``segment[0]`` to
       ``segment[1]`` tokens (the last one cut at ``n``), each about a topic drawn uniformly;
    3. each segment after the first asks about the topic of one earlier segment, drawn
       uniformly; the first asks about its own;
    4. ``key[j] = signal * u[topic of j's segment] + e_j`` and
       ``query[i] = signal * u[topic i's segment asks about] + e'_i``, with standard normal
       noise ``e``, ``e'``; values standard normal.

    A query and a key about the same topic score about ``signal**2 / sqrt(Dk)`` (scaled), and
    unrelated ones about 0, so dense attention puts most of a query's weight on the keys of
    the earlier segments about its topic: a few places in the sequence.

    Parameters
    ----------
    rng : np.random.Generator
        The source of every random number.
    n : int
        Tokens, positive.
    Dk : int
        Width of queries and keys, positive.
    Dv : int, optional
        Width of the values; default ``Dk``.
    n_topics : int, default 64
        Topics to draw from.
    segment : (int, int), default (16, 64)
        Shortest and longest segment, in tokens.
    signal : float, optional
        Length of the topic part of each query and key; default ``sqrt(Dk)``, the average
        length of the noise.

    Returns
    -------
    TopicSequence
        The arrays, with each token's topics and segment.

    Raises
    ------
    TypeError
        If ``rng`` is not a ``np.random.Generator``, a size is not an int, ``segment`` is not a
        pair, or ``signal`` is not a real number.
    ValueError
        If a size is not positive, ``segment`` is not increasing, or ``signal`` is negative or
        not finite.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa_book.pages.sparse import topic_sequence
    >>> data = topic_sequence(np.random.default_rng(0), 256, 16)
    >>> data.query.shape, data.key.shape, data.value.shape
    ((256, 16), (256, 16), (256, 16))
    >>> bool(np.all(np.isin(data.query_topic, data.key_topic)))  # every asked topic occurred
    True
    """
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a np.random.Generator; got {type(rng).__name__}")
    n = check_count(n, "n")
    Dk = check_count(Dk, "Dk")
    Dv = Dk if Dv is None else check_count(Dv, "Dv")
    n_topics = check_count(n_topics, "n_topics")
    shortest, longest = _segment_range(segment)
    if signal is None:
        signal = float(np.sqrt(Dk))
    if isinstance(signal, (bool, np.bool_)) or not isinstance(signal, Real):
        raise TypeError(f"signal must be a real number; got {signal!r}")
    if not np.isfinite(signal) or signal < 0:
        raise ValueError(f"signal must be finite and non-negative; got {signal}")

    u = rng.standard_normal((n_topics, Dk))
    u /= np.linalg.norm(u, axis=1, keepdims=True)  # (n_topics, Dk) unit directions
    lengths = []
    while sum(lengths) < n:
        lengths.append(int(rng.integers(shortest, longest + 1)))
    topic = rng.integers(0, n_topics, len(lengths))  # (segments,)
    earlier = [int(rng.integers(0, s)) if s else 0 for s in range(len(lengths))]
    asks = topic[earlier]  # the topic of a uniformly drawn earlier segment (the first: its own)
    seg = np.repeat(np.arange(len(lengths)), lengths)[:n]  # (n,) segment of each token
    key_topic, query_topic = topic[seg], asks[seg]
    key = signal * u[key_topic] + rng.standard_normal((n, Dk))  # (n, Dk)
    query = signal * u[query_topic] + rng.standard_normal((n, Dk))  # (n, Dk)
    value = rng.standard_normal((n, Dv))  # (n, Dv)
    return TopicSequence(query, key, value, key_topic, query_topic, seg)


def _sum_min(F: np.ndarray, n_top: int) -> np.ndarray:
    """``sum(min(n_top, b) for b in range(F))``, elementwise for integer arrays ``F``."""
    m = np.minimum(F, n_top)
    return m * (m - 1) // 2 + n_top * np.maximum(F - n_top, 0)


def sparse_entries(n, block: int, n_top: int):
    r"""The entries causal top-k block selection computes over a sequence of ``n`` tokens.

    Keys are cut into blocks of ``block`` tokens; query ``i`` sits in block ``b = i // block``.
    It attends the keys of its own block up to itself (``i % block + 1`` entries) and all the
    keys of ``min(n_top, b)`` earlier blocks (those the gate chose; fewer when there are fewer
    earlier blocks), and its gate scores the ``b`` earlier blocks. Which blocks are chosen
    does not change the counts.

    Parameters
    ----------
    n : int or array_like of int
        Sequence lengths (``T = S = n``), each positive.
    block : int
        Keys per block, ``Bk``.
    n_top : int
        Earlier blocks each query attends besides its own, at least 0.

    Returns
    -------
    attention : int or np.ndarray of int64
        Query-key entries attended, summed over the ``n`` queries: ``n (n + 1) / 2`` for dense
        causal attention, which ``n_top >= n / block`` reproduces.
    gate : int or np.ndarray of int64
        Query-block entries the gate scores, summed over the queries.

    Raises
    ------
    TypeError
        If a size is not an integer.
    ValueError
        If ``n`` or ``block`` is not positive, or ``n_top`` is negative.

    Examples
    --------
    Four tokens in blocks of two, each query keeping one earlier block: queries 0 and 1 see
    1 and 2 keys of their own block; queries 2 and 3 see 1 and 2 of theirs plus the 2 of block
    0, and score that one block:

    >>> from sdpa_book.pages.sparse import sparse_entries
    >>> sparse_entries(4, block=2, n_top=1)
    (10, 2)
    >>> sparse_entries(4096, block=128, n_top=32)[0] == 4096 * 4097 // 2  # all blocks: dense
    True
    """
    block = check_count(block, "block")
    n_top = check_count(n_top, "n_top", minimum=0)
    scalar = np.ndim(n) == 0
    lengths = np.asarray(n)
    if lengths.dtype == bool or not np.issubdtype(lengths.dtype, np.integer):
        raise TypeError(f"n must be an int or an array of ints; got {n!r}")
    lengths = lengths.astype(np.int64)
    if (lengths < 1).any():
        raise ValueError(f"n must be positive; got {n!r}")
    full, rest = np.divmod(lengths, block)  # whole blocks, and the queries of the last one
    own = full * (block * (block + 1) // 2) + rest * (rest + 1) // 2
    chosen = block * (block * _sum_min(full, n_top) + rest * np.minimum(full, n_top))
    gate = block * (full * (full - 1) // 2) + rest * full
    attention = own + chosen
    if scalar:
        return int(attention), int(gate)
    return attention, gate
