"""sdpa_book.pages.sparse: the topic sequence of the page *Sparse attention* and its work counts."""

from __future__ import annotations

import numpy as np
import pytest

from sdpa_book.pages.sparse import TopicSequence, sparse_entries, topic_sequence

# ---------------------------------------------------------------------------------------------
# sparse_entries against an explicit count


def _counted(n: int, block: int, n_top: int, rng: np.random.Generator) -> tuple[int, int]:
    """Build a token-level mask from a random choice of blocks and count it, query by query."""
    attention = gate = 0
    for i in range(n):
        own = i // block
        earlier = np.arange(own)
        chosen = rng.permutation(earlier)[:n_top]  # any choice: the count must not depend on it
        allowed = np.zeros(n, dtype=bool)
        for b in chosen:
            allowed[b * block : (b + 1) * block] = True
        allowed[own * block : i + 1] = True
        assert not allowed[i + 1 :].any()  # causal
        attention += int(allowed.sum())
        gate += own  # the gate scores every earlier block
    return attention, gate


@pytest.mark.parametrize(
    ("n", "block", "n_top"),
    [(1, 1, 0), (7, 3, 1), (11, 5, 2), (24, 4, 3), (37, 8, 0), (37, 8, 9), (50, 7, 5), (64, 64, 3)],
)
def test_sparse_entries_match_an_explicit_mask(n, block, n_top):
    rng = np.random.default_rng(n * 100 + block)
    assert sparse_entries(n, block, n_top) == _counted(n, block, n_top, rng)


def test_sparse_entries_reach_dense_causal_with_every_block():
    for n, block in [(1, 3), (10, 3), (100, 7), (4096, 128)]:
        attention, _ = sparse_entries(n, block, n_top=n)
        assert attention == n * (n + 1) // 2


def test_sparse_entries_of_an_array_match_the_scalars():
    lengths = np.array([1, 5, 130, 257, 4096, 131072])
    attention, gate = sparse_entries(lengths, 128, 3)
    assert attention.dtype == np.int64 and gate.dtype == np.int64
    expected = [sparse_entries(int(m), 128, 3) for m in lengths]
    assert attention.tolist() == [a for a, _ in expected]
    assert gate.tolist() == [g for _, g in expected]


def test_sparse_entries_by_hand():
    # n = 10, blocks of 4, one earlier block: queries 0-3 see 1..4 of block 0 (10); queries
    # 4-7 see 1..4 of block 1 plus 4 of block 0 (26); queries 8, 9 see 1, 2 of block 2 plus 4
    # (11). The gate scores 0 blocks for queries 0-3, 1 for 4-7, 2 for 8 and 9.
    assert sparse_entries(10, 4, 1) == (10 + 26 + 11, 4 + 4)


def test_sparse_entries_do_not_overflow_at_long_context():
    n = 1 << 20
    attention, gate = sparse_entries(n, 1, n)
    assert attention == n * (n + 1) // 2
    assert gate == n * (n - 1) // 2


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ((0, 4, 1), ValueError, "n must be positive; got 0"),
        (([3, 0], 4, 1), ValueError, r"n must be positive; got \[3, 0\]"),
        ((2.5, 4, 1), TypeError, "n must be an int or an array of ints; got 2.5"),
        ((True, 4, 1), TypeError, "n must be an int or an array of ints; got True"),
        ((8, 0, 1), ValueError, "block must be at least 1; got 0"),
        ((8, 2.0, 1), TypeError, "block must be an int; got 2.0"),
        ((8, 4, -1), ValueError, "n_top must be at least 0; got -1"),
        ((8, 4, None), TypeError, "n_top must be an int; got None"),
    ],
)
def test_sparse_entries_refuse_bad_input(args, error, message):
    with pytest.raises(error, match=message):
        sparse_entries(*args)


# ---------------------------------------------------------------------------------------------
# topic_sequence


def test_topic_sequence_shapes_and_kinds():
    data = topic_sequence(np.random.default_rng(1), 301, 12, 7, n_topics=5)
    assert isinstance(data, TopicSequence)
    assert data.query.shape == (301, 12) and data.key.shape == (301, 12)
    assert data.value.shape == (301, 7)
    for a in (data.key_topic, data.query_topic, data.segment):
        assert a.shape == (301,) and np.issubdtype(a.dtype, np.integer)
    assert data.key_topic.min() >= 0 and data.key_topic.max() < 5


def test_topic_sequence_segments_have_the_stated_lengths():
    data = topic_sequence(np.random.default_rng(2), 2000, 8, segment=(5, 9))
    lengths = np.bincount(data.segment)
    assert np.all(np.diff(data.segment) >= 0) and data.segment[0] == 0
    assert lengths[:-1].min() >= 5 and lengths[:-1].max() <= 9  # the last one is cut at n
    assert 1 <= lengths[-1] <= 9
    # one topic per segment, for keys and for queries
    for s in range(lengths.size):
        inside = data.segment == s
        assert np.unique(data.key_topic[inside]).size == 1
        assert np.unique(data.query_topic[inside]).size == 1


def test_each_segment_asks_about_an_earlier_segment():
    data = topic_sequence(np.random.default_rng(3), 1500, 8, n_topics=200)
    starts = np.flatnonzero(np.diff(data.segment, prepend=-1))
    first_end = starts[1]
    assert (data.query_topic[:first_end] == data.key_topic[:first_end]).all()
    for start in starts[1:]:
        earlier_topics = set(data.key_topic[:start].tolist())
        assert int(data.query_topic[start]) in earlier_topics
    # with 200 topics most segments ask about a topic other than their own
    assert (data.query_topic[starts] != data.key_topic[starts]).mean() > 0.8


def test_topic_sequence_construction_against_its_own_noise():
    # Rebuild keys and queries from the stated recipe with the same random numbers.
    n, Dk, n_topics, signal = 200, 6, 4, 2.5
    data = topic_sequence(np.random.default_rng(4), n, Dk, n_topics=n_topics, signal=signal)
    rng = np.random.default_rng(4)
    u = rng.standard_normal((n_topics, Dk))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    noise_k = data.key - signal * u[data.key_topic]
    noise_q = data.query - signal * u[data.query_topic]
    # the noise is standard normal: mean about 0 and variance about 1 (n * Dk = 1200 numbers)
    for noise in (noise_k, noise_q):
        assert abs(noise.mean()) < 0.15 and 0.8 < noise.var() < 1.2


def test_topic_sequence_concentrates_dense_attention():
    # What the page relies on: most of a query's weight falls on keys of its asked topic.
    data = topic_sequence(np.random.default_rng(5), 1024, 64)
    n, Dk = data.query.shape
    scores = data.query @ data.key.T / np.sqrt(Dk)
    scores[np.triu_indices(n, 1)] = -np.inf
    weights = np.exp(scores - scores.max(axis=1, keepdims=True))
    weights /= weights.sum(axis=1, keepdims=True)
    relevant = data.query_topic[:, None] == data.key_topic[None, :]
    assert (weights * relevant).sum(axis=1)[n // 2 :].mean() > 0.8
    assert relevant[n // 2 :].mean() < 0.1  # on few of the keys


def test_topic_sequence_default_signal_is_the_noise_length():
    a = topic_sequence(np.random.default_rng(6), 100, 16)
    b = topic_sequence(np.random.default_rng(6), 100, 16, signal=4.0)
    np.testing.assert_array_equal(a.key, b.key)


def test_topic_sequence_is_reproducible():
    a = topic_sequence(np.random.default_rng(7), 90, 4)
    b = topic_sequence(np.random.default_rng(7), 90, 4)
    np.testing.assert_array_equal(a.query, b.query)
    np.testing.assert_array_equal(a.segment, b.segment)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"rng": 0}, TypeError, "rng must be a np.random.Generator; got int"),
        ({"n": 0}, ValueError, "n must be at least 1; got 0"),
        ({"Dk": 3.0}, TypeError, "Dk must be an int; got 3.0"),
        ({"Dv": 0}, ValueError, "Dv must be at least 1; got 0"),
        ({"n_topics": 0}, ValueError, "n_topics must be at least 1; got 0"),
        ({"segment": 8}, TypeError, r"segment must be a pair \(shortest, longest\); got 8"),
        ({"segment": (9, 4)}, ValueError, "shortest <= longest; got \\(9, 4\\)"),
        ({"segment": (0, 4)}, ValueError, r"segment\[0\] must be at least 1; got 0"),
        ({"signal": "x"}, TypeError, "signal must be a real number; got 'x'"),
        ({"signal": -1.0}, ValueError, "signal must be finite and non-negative; got -1.0"),
        ({"signal": np.inf}, ValueError, "signal must be finite and non-negative; got inf"),
    ],
)
def test_topic_sequence_refuses_bad_input(kwargs, error, message):
    args = {"rng": np.random.default_rng(0), "n": 10, "Dk": 4, **kwargs}
    with pytest.raises(error, match=message):
        topic_sequence(**args)
