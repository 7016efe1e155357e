"""The readable blocked attention (sdpa.blocked) against three independent references.

1. a float64 loop over single queries and keys, written here with ``math.exp`` and no NumPy
   reductions, for the forward pass and for the backward pass (whose softmax correction it
   takes as ``rowsum(P * dP)``, not the ``rowsum(dO * O)`` that the code under test uses);
2. the reference path of the package (``implementation="reference"``), forward and backward;
3. PyTorch 2.13 (``torch.nn.functional.scaled_dot_product_attention`` and autograd), where
   installed.

Sizes differ in every dimension (T=7, S=11, Dk=5, Dv=3) and the block sizes cover 1, odd
sizes that divide nothing, and sizes larger than T or S.

The causal loop (``is_causal=True``, top-left: query ``i`` attends the keys ``j <= i``) is
checked against the same references with the mask written out (the float64 loop stops at key
``i``), and its skipping two ways: the tiles its trace reports against the tiles above the
diagonal, worked out from their corners, and, without the trace, NaN placed in values that only
skipped tiles would read (a computed tile, even fully masked, would carry the NaN into the
output, since its weights are 0 and 0 * NaN is NaN). With top-left alignment every query sees
key 0, so no row is ever fully masked: rows beyond the keys (T > S) see them all.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import sdpa
from sdpa import blocked_attention, blocked_attention_backward

T, S, DK, DV = 7, 11, 5, 3
BLOCKS = [(1, 1), (2, 3), (3, 4), (5, 2), (7, 11), (16, 32), (1, 32), (64, 1)]
TOL = {np.float64: dict(rtol=1e-12, atol=1e-13), np.float32: dict(rtol=2e-5, atol=2e-6)}


def qkv(rng, dtype=np.float64, t=T, s=S, dk=DK, dv=DV):
    return (
        rng.standard_normal((t, dk)).astype(dtype),
        rng.standard_normal((s, dk)).astype(dtype),
        rng.standard_normal((s, dv)).astype(dtype),
    )


# ---------------------------------------------------------------------------------------------
# The float64 loop: every number from its definition
# ---------------------------------------------------------------------------------------------


def loop_forward(q, k, v, scale, causal=False):
    """``(out, lse, weights)`` one query at a time, in Python floats; causal: query ``i`` sees
    the keys ``0 .. i`` only (all of them when ``i >= S``)."""
    t, s, dv = len(q), len(k), v.shape[1]
    out, lse, weights = np.zeros((t, dv)), np.zeros(t), np.zeros((t, s))
    for i in range(t):
        seen = min(s, i + 1) if causal else s
        scores = [scale * sum(float(a) * float(b) for a, b in zip(q[i], k[j])) for j in range(seen)]
        top = max(scores)
        total = sum(math.exp(x - top) for x in scores)
        lse[i] = top + math.log(total)
        for j in range(seen):
            weights[i, j] = math.exp(scores[j] - top) / total
            for c in range(dv):
                out[i, c] += weights[i, j] * float(v[j, c])
    return out, lse, weights


def loop_backward(q, k, v, d_out, scale, causal=False):
    """``(d_q, d_k, d_v)`` from the chain rule, entry by entry (a masked weight is 0)."""
    _, _, p = loop_forward(q, k, v, scale, causal)
    t, s = p.shape
    d_p = np.array([[float(np.dot(d_out[i], v[j])) for j in range(s)] for i in range(t)])
    d_scores = np.zeros((t, s))
    for i in range(t):
        correction = sum(p[i, j] * d_p[i, j] for j in range(s))  # rowsum(P * dP)
        for j in range(s):
            d_scores[i, j] = p[i, j] * (d_p[i, j] - correction)
    d_q = np.zeros(q.shape)
    d_k = np.zeros(k.shape)
    d_v = np.zeros(v.shape)
    for i in range(t):
        for j in range(s):
            d_q[i] += scale * d_scores[i, j] * k[j]
            d_k[j] += scale * d_scores[i, j] * q[i]
            d_v[j] += p[i, j] * d_out[i]
    return d_q, d_k, d_v


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_q, block_k", BLOCKS)
def test_forward_equals_float64_loop(block_q, block_k, rng):
    q, k, v = qkv(rng)
    out, lse = blocked_attention(q, k, v, block_q=block_q, block_k=block_k)
    want_out, want_lse, _ = loop_forward(q, k, v, 1 / math.sqrt(DK))
    np.testing.assert_allclose(out, want_out, **TOL[np.float64])
    np.testing.assert_allclose(lse, want_lse, **TOL[np.float64])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("block_q, block_k", BLOCKS)
def test_forward_equals_reference_path(block_q, block_k, dtype, rng):
    q, k, v = qkv(rng, dtype)
    out, lse = blocked_attention(q, k, v, block_q=block_q, block_k=block_k)
    want_out, want_lse = sdpa.scaled_dot_product_attention(
        q, k, v, implementation="reference", return_lse=True
    )
    assert out.dtype == lse.dtype == np.dtype(dtype)
    np.testing.assert_allclose(out, want_out, **TOL[dtype])
    np.testing.assert_allclose(lse, want_lse, **TOL[dtype])


def test_hand_computed_case():
    """Two keys with scores 0 and log 3 give the weights 1/4 and 3/4 (scale 1)."""
    q = np.array([[1.0]])
    k = np.array([[0.0], [math.log(3.0)]])
    v = np.array([[4.0, 0.0], [0.0, 4.0]])
    out, lse = blocked_attention(q, k, v, block_q=1, block_k=1, scale=1.0)
    np.testing.assert_allclose(out, [[1.0, 3.0]], rtol=1e-15)
    np.testing.assert_allclose(lse, [math.log(4.0)], rtol=1e-15)


def test_scale_and_large_scores(rng):
    """A scale that makes scores of several hundred: exp would overflow without the shift."""
    q, k, v = qkv(rng)
    out, lse = blocked_attention(q, k, v, block_q=3, block_k=4, scale=200.0)
    want_out, want_lse, _ = loop_forward(q, k, v, 200.0)
    assert np.all(np.abs(lse) > 50)
    np.testing.assert_allclose(out, want_out, **TOL[np.float64])
    np.testing.assert_allclose(lse, want_lse, **TOL[np.float64])


def test_float16_is_computed_in_float32(rng):
    q, k, v = qkv(rng, np.float16)
    out, lse = blocked_attention(q, k, v, block_q=2, block_k=5)
    want = loop_forward(*(x.astype(np.float64) for x in (q, k, v)), 1 / math.sqrt(DK))
    assert out.dtype == np.float16
    assert lse.dtype == np.float32  # as scaled_dot_product_attention(..., return_lse=True)
    np.testing.assert_allclose(out, want[0], rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(lse, want[1], rtol=2e-3, atol=2e-3)


def test_integer_inputs_give_float64():
    q = np.array([[1, 0], [0, 2]])
    k = np.array([[1, 1], [0, 1], [2, 0]])
    v = np.array([[1, 0], [0, 1], [1, 1]])
    out, lse = blocked_attention(q, k, v, block_q=1, block_k=2)
    want = loop_forward(q, k, v, 1 / math.sqrt(2))
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, want[0], rtol=1e-14)


def test_no_queries_and_zero_widths(rng):
    q, k, v = qkv(rng, t=0)
    out, lse = blocked_attention(q, k, v, block_q=2, block_k=3)
    assert out.shape == (0, DV) and lse.shape == (0,)
    # Dk = 0: every score is 0, so the weights are uniform and out is the mean of the values.
    q, k, v = qkv(rng, dk=0)
    out, lse = blocked_attention(q, k, v, block_q=2, block_k=3)
    np.testing.assert_allclose(out, np.broadcast_to(v.mean(axis=0), (T, DV)), rtol=1e-14)
    np.testing.assert_allclose(lse, np.full(T, math.log(S)), rtol=1e-14)


def test_inputs_are_not_modified(rng):
    q, k, v = qkv(rng)
    copies = [x.copy() for x in (q, k, v)]
    out, lse = blocked_attention(q, k, v, block_q=2, block_k=3)
    blocked_attention_backward(q, k, v, out, lse, np.ones_like(out), block_q=2, block_k=3)
    for x, c in zip((q, k, v), copies):
        np.testing.assert_array_equal(x, c)


# ---------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_q, block_k", BLOCKS)
def test_backward_equals_float64_loop(block_q, block_k, rng):
    q, k, v = qkv(rng)
    d_out = rng.standard_normal((T, DV))
    out, lse = blocked_attention(q, k, v, block_q=3, block_k=5)
    grads = blocked_attention_backward(q, k, v, out, lse, d_out, block_q=block_q, block_k=block_k)
    for got, want in zip(grads, loop_backward(q, k, v, d_out, 1 / math.sqrt(DK))):
        np.testing.assert_allclose(got, want, **TOL[np.float64])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("block_q, block_k", BLOCKS)
def test_backward_equals_reference_path(block_q, block_k, dtype, rng):
    q, k, v = qkv(rng, dtype)
    d_out = rng.standard_normal((T, DV)).astype(dtype)
    out, lse = blocked_attention(q, k, v, block_q=block_q, block_k=block_k)
    grads = blocked_attention_backward(q, k, v, out, lse, d_out, block_q=block_q, block_k=block_k)
    want = sdpa.scaled_dot_product_attention_backward(d_out, q, k, v, implementation="reference")
    for got, ref in zip(grads, want):
        assert got.dtype == np.dtype(dtype)
        np.testing.assert_allclose(got, ref, **TOL[dtype])


def test_backward_with_explicit_scale_against_finite_differences(rng):
    q, k, v = qkv(rng)
    weights = rng.standard_normal((T, DV))  # L = sum(weights * out)
    loss = lambda q_: float(
        np.sum(
            weights
            * blocked_attention(  # noqa: E731
                q_, k, v, block_q=2, block_k=3, scale=0.7
            )[0]
        )
    )
    out, lse = blocked_attention(q, k, v, block_q=2, block_k=3, scale=0.7)
    d_q, _, _ = blocked_attention_backward(
        q, k, v, out, lse, weights, block_q=4, block_k=2, scale=0.7
    )
    h = 1e-6
    for i, c in [(0, 0), (3, 2), (6, 4)]:
        e = np.zeros_like(q)
        e[i, c] = h
        np.testing.assert_allclose(d_q[i, c], (loss(q + e) - loss(q - e)) / (2 * h), rtol=1e-6)


def test_backward_gradient_dtypes_follow_each_input(rng):
    q, k, v = qkv(rng)
    q32 = q.astype(np.float32)
    k_int = np.round(k * 2).astype(np.int64)
    out, lse = blocked_attention(q32, k_int, v, block_q=2, block_k=3)
    d_q, d_k, d_v = blocked_attention_backward(
        q32, k_int, v, out, lse, np.ones_like(out), block_q=2, block_k=3
    )
    assert (d_q.dtype, d_k.dtype, d_v.dtype) == (np.float32, np.float64, np.float64)


def float16_large_scores(rng, case):
    """float16 inputs whose scores, about 8e4, overflow float16 (max 65504) but are exact in
    float32: ``q = k = 200`` everywhere (Dk = 4, scale 1/2), or 200 in four columns and
    multiples of 1/8 in a fifth (scale 1/2 given), so that the scores differ between keys."""
    t, s = 3, 4
    if case == "constant":
        q, k, scale = np.full((t, 4), 200.0), np.full((s, 4), 200.0), None
    else:
        q, k, scale = np.full((t, 5), 200.0), np.full((s, 5), 200.0), 0.5
        q[:, 4] = rng.integers(-8, 9, t) / 8
        k[:, 4] = rng.integers(-8, 9, s) / 8
    v = rng.standard_normal((s, 2))
    d_out = rng.standard_normal((t, 2))
    return [x.astype(np.float16) for x in (q, k, v, d_out)], scale


@pytest.mark.parametrize("case", ["constant", "varied"])
def test_float16_scores_beyond_65504_give_a_float32_lse_and_exact_gradients(case, rng):
    """A float16 lse would be inf, and the backward pass would return zeros. The lse is
    float32, as FlashAttention's; the backward pass corrects its rounding (up to 4e-3 at 8e4,
    which would move every weight by 0.4%), so the gradients match the float64 loop on the
    same float16 numbers to float16 precision."""
    (q, k, v, d_out), scale = float16_large_scores(rng, case)
    scale64 = 0.5 if scale is None else scale
    as64 = [x.astype(np.float64) for x in (q, k, v, d_out)]
    want_out, want_lse, _ = loop_forward(*as64[:3], scale64)
    out, lse = blocked_attention(q, k, v, block_q=2, block_k=3, scale=scale)
    assert out.dtype == np.float16 and lse.dtype == np.float32
    assert np.all(want_lse > 79_000)
    np.testing.assert_allclose(lse, want_lse, rtol=6e-8, atol=0)  # half a float32 ulp
    np.testing.assert_allclose(out, want_out, rtol=1e-3, atol=1e-3)
    grads = blocked_attention_backward(q, k, v, out, lse, d_out, block_q=2, block_k=3, scale=scale)
    want_dq, want_dk, want_dv = loop_backward(*as64, scale64)
    for got, want in zip(grads[1:], (want_dk, want_dv)):
        assert got.dtype == np.float16 and np.abs(want).max() > 0.1  # not zeros against zeros
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3 * np.abs(want).max())
    # d_q adds terms of size scale * |k| * |dscores| = 100 |dscores| that cancel, since each
    # row of dscores sums to rowsum(dO * O) - delta = 0; delta is taken from out, rounded to
    # float16 (unit roundoff 2**-11), and that rounding, times scale * |k|, bounds d_q's error.
    delta_size = np.abs(as64[3] * out.astype(np.float64)).sum(axis=1).max()
    atol_dq = 2 * 2.0**-11 * scale64 * 200.0 * delta_size
    assert grads[0].dtype == np.float16
    np.testing.assert_allclose(grads[0], want_dq, rtol=2e-3, atol=atol_dq)


# ---------------------------------------------------------------------------------------------
# Causal
# ---------------------------------------------------------------------------------------------

# (T, S, block_q, block_k): square and not, T < S and T > S (rows beyond the keys see them
# all), blocks of one, blocks that divide nothing, blocks larger than a side.
CAUSAL_SHAPES = [
    (7, 7, 2, 3),
    (7, 7, 3, 2),
    (7, 11, 2, 3),
    (11, 7, 3, 2),
    (11, 7, 4, 4),
    (12, 12, 4, 4),
    (12, 12, 5, 7),
    (9, 4, 2, 5),
    (4, 9, 5, 2),
    (1, 6, 1, 4),
    (6, 1, 4, 1),
    (8, 13, 1, 1),
    (13, 8, 16, 32),
    (10, 10, 10, 3),
]


def computed_tiles(T, S, block_q, block_k):
    """The tiles a causal loop must compute, ``{(first query, first key)}``: every tile whose
    first key is not after its last query (the others lie entirely above the diagonal)."""
    return {
        (i, j)
        for i in range(0, T, block_q)
        for j in range(0, S, block_k)
        if j <= min(T, i + block_q) - 1
    }


@pytest.mark.parametrize("T_, S_, block_q, block_k", CAUSAL_SHAPES)
def test_causal_forward_equals_float64_loop(T_, S_, block_q, block_k, rng):
    q, k, v = qkv(rng, t=T_, s=S_)
    out, lse = blocked_attention(q, k, v, block_q=block_q, block_k=block_k, is_causal=True)
    want_out, want_lse, _ = loop_forward(q, k, v, 1 / math.sqrt(DK), causal=True)
    np.testing.assert_allclose(out, want_out, **TOL[np.float64])
    np.testing.assert_allclose(lse, want_lse, **TOL[np.float64])
    assert np.all(np.isfinite(lse))  # no row is fully masked with top-left alignment


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("T_, S_, block_q, block_k", CAUSAL_SHAPES)
def test_causal_forward_equals_reference_path(T_, S_, block_q, block_k, dtype, rng):
    q, k, v = qkv(rng, dtype, t=T_, s=S_)
    out, lse = blocked_attention(q, k, v, block_q=block_q, block_k=block_k, is_causal=True)
    want_out, want_lse = sdpa.scaled_dot_product_attention(
        q, k, v, is_causal=True, implementation="reference", return_lse=True
    )
    assert out.dtype == lse.dtype == np.dtype(dtype)
    np.testing.assert_allclose(out, want_out, **TOL[dtype])
    np.testing.assert_allclose(lse, want_lse, **TOL[dtype])


def test_causal_hand_computed_rows(rng):
    """Query 0 sees key 0 alone: its output is v[0] and its lse its one score; a query past the
    last key (T > S) sees every key, as without the mask."""
    q, k, v = qkv(rng, t=9, s=4)
    out, lse = blocked_attention(q, k, v, block_q=2, block_k=3, is_causal=True)
    np.testing.assert_allclose(out[0], v[0], rtol=1e-15)
    np.testing.assert_allclose(lse[0], q[0] @ k[0] / math.sqrt(DK), rtol=1e-14)
    full, full_lse = blocked_attention(q, k, v, block_q=2, block_k=3)
    np.testing.assert_allclose(out[3:], full[3:], rtol=1e-14)
    np.testing.assert_allclose(lse[3:], full_lse[3:], rtol=1e-14)


def test_causal_future_keys_do_not_change_the_past(rng):
    """Changing key and value 5 changes no output before query 5."""
    q, k, v = qkv(rng, t=8, s=8)
    out, _ = blocked_attention(q, k, v, block_q=3, block_k=2, is_causal=True)
    k2, v2 = k.copy(), v.copy()
    k2[5], v2[5] = 100.0, -100.0
    out2, _ = blocked_attention(q, k2, v2, block_q=3, block_k=2, is_causal=True)
    np.testing.assert_array_equal(out2[:5], out[:5])
    assert np.abs(out2[5:] - out[5:]).min() > 1e-3


@pytest.mark.parametrize("T_, S_, block_q, block_k", CAUSAL_SHAPES)
def test_causal_backward_equals_float64_loop(T_, S_, block_q, block_k, rng):
    q, k, v = qkv(rng, t=T_, s=S_)
    d_out = rng.standard_normal((T_, DV))
    out, lse = blocked_attention(q, k, v, block_q=3, block_k=5, is_causal=True)
    grads = blocked_attention_backward(
        q, k, v, out, lse, d_out, block_q=block_q, block_k=block_k, is_causal=True
    )
    for got, want in zip(grads, loop_backward(q, k, v, d_out, 1 / math.sqrt(DK), causal=True)):
        np.testing.assert_allclose(got, want, **TOL[np.float64])


@pytest.mark.parametrize("T_, S_, block_q, block_k", [(7, 11, 2, 3), (11, 7, 3, 2), (6, 6, 4, 4)])
def test_causal_backward_against_finite_differences(T_, S_, block_q, block_k, rng):
    q, k, v = qkv(rng, t=T_, s=S_)
    options = dict(block_q=block_q, block_k=block_k, scale=0.7, is_causal=True)

    def f(q, k, v):
        return blocked_attention(q, k, v, **options)[0]

    def vjp(d_out, q, k, v):
        out, lse = blocked_attention(q, k, v, **options)
        return blocked_attention_backward(q, k, v, out, lse, d_out, **options)

    assert sdpa.gradcheck(f, vjp, (q, k, v), atol=1e-8, rtol=1e-6, rng=rng)


def test_causal_keys_after_the_last_query_get_zero_gradients(rng):
    q, k, v = qkv(rng, t=5, s=9)
    out, lse = blocked_attention(q, k, v, block_q=2, block_k=3, is_causal=True)
    d_q, d_k, d_v = blocked_attention_backward(
        q, k, v, out, lse, rng.standard_normal((5, DV)), block_q=2, block_k=3, is_causal=True
    )
    assert np.all(d_k[5:] == 0) and np.all(d_v[5:] == 0)
    assert np.abs(d_v[:5]).min() > 0 and np.all(np.isfinite(d_q))


@pytest.mark.parametrize("T_, S_, block_q, block_k", CAUSAL_SHAPES)
def test_causal_loops_compute_exactly_the_tiles_not_above_the_diagonal(
    T_, S_, block_q, block_k, rng
):
    q, k, v = qkv(rng, t=T_, s=S_)
    forward, backward = [], []
    out, lse = blocked_attention(
        q,
        k,
        v,
        block_q=block_q,
        block_k=block_k,
        is_causal=True,
        on_tile=lambda i, j: forward.append((i, j)),
    )
    blocked_attention_backward(
        q,
        k,
        v,
        out,
        lse,
        np.ones_like(out),
        block_q=block_q,
        block_k=block_k,
        is_causal=True,
        on_tile=lambda i, j: backward.append((i, j)),
    )
    want = computed_tiles(T_, S_, block_q, block_k)
    # each tile once, in the loops' orders: query blocks outside forwards, key blocks backwards
    assert forward == sorted(want)
    assert backward == sorted(want, key=lambda t: (t[1], t[0]))
    # the same tiles as the fast path's map marks computed (kinds 1 and 2)
    kinds = sdpa.tile_map(T_, S_, block_q=block_q, block_k=block_k, is_causal=True)
    assert {(a * block_q, b * block_k) for a, b in zip(*np.nonzero(kinds))} == want


@pytest.mark.parametrize("is_causal, count", [(True, 36), (False, 64)])
def test_causal_skips_half_of_the_tiles_when_blocks_divide_a_square(is_causal, count, rng):
    """T = S = 24 in 3 x 3 tiles: 8 * 9 / 2 = 36 of the 64 tiles; without the mask, all 64."""
    q, k, v = qkv(rng, t=24, s=24)
    tiles = []
    blocked_attention(
        q, k, v, block_q=3, block_k=3, is_causal=is_causal, on_tile=lambda *t: tiles.append(t)
    )
    assert len(tiles) == len(set(tiles)) == count


@pytest.mark.parametrize("T_, S_, block_q, block_k", CAUSAL_SHAPES)
def test_causal_forward_never_reads_the_values_of_skipped_tiles(T_, S_, block_q, block_k, rng):
    """NaN in the values after the key block that holds a query block's last query: that
    block's outputs stay finite (no tile of it read those values). Without skipping, a fully
    masked tile would still multiply its zero weights by the NaN."""
    q, k, v = qkv(rng, t=T_, s=S_)
    want = loop_forward(q, k, v, 1 / math.sqrt(DK), causal=True)[0]
    for i in range(0, T_, block_q):
        rows = slice(i, min(T_, i + block_q))
        first_unread = (min(T_, i + block_q) - 1) // block_k * block_k + block_k
        if first_unread >= S_:
            continue  # this block reads every key block
        v_nan = v.copy()
        v_nan[first_unread:] = np.nan
        out, _ = blocked_attention(q, k, v_nan, block_q=block_q, block_k=block_k, is_causal=True)
        np.testing.assert_allclose(out[rows], want[rows], **TOL[np.float64])


def test_causal_nan_in_a_computed_tile_does_reach_the_output(rng):
    """The control of the test above: a NaN value in a tile the loop computes, masked for the
    rows before it, still turns them to NaN (0 * NaN); so a finite row there means skipped."""
    q, k, v = qkv(rng, t=6, s=6)
    v[5] = np.nan  # key 5 is in the tile of queries 3..5 and keys 3..5, computed
    out, _ = blocked_attention(q, k, v, block_q=3, block_k=3, is_causal=True)
    assert np.all(np.isnan(out[3:])) and np.all(np.isfinite(out[:3]))


@pytest.mark.parametrize("T_, S_, block_q, block_k", CAUSAL_SHAPES)
def test_causal_backward_never_reads_the_queries_of_skipped_tiles(T_, S_, block_q, block_k, rng):
    """NaN in the upstream gradient of the query blocks that end before a key block: that key
    block's gradients stay finite (the backward loop never visits those tiles)."""
    q, k, v = qkv(rng, t=T_, s=S_)
    d_out = rng.standard_normal((T_, DV))
    out, lse = blocked_attention(q, k, v, block_q=block_q, block_k=block_k, is_causal=True)
    want = loop_backward(q, k, v, d_out, 1 / math.sqrt(DK), causal=True)
    for j in range(block_k, min(S_, T_), block_k):
        first = j // block_q * block_q  # the query block holding query j
        if first == 0:
            continue
        d_nan = d_out.copy()
        d_nan[:first] = np.nan
        _, d_k, d_v = blocked_attention_backward(
            q, k, v, out, lse, d_nan, block_q=block_q, block_k=block_k, is_causal=True
        )
        keys = slice(j, j + block_k)
        np.testing.assert_allclose(d_k[keys], want[1][keys], **TOL[np.float64])
        np.testing.assert_allclose(d_v[keys], want[2][keys], **TOL[np.float64])


def test_causal_large_scores_in_float16(rng):
    """The lse correction of the backward pass (rows beyond |lse| = 64) with the causal mask:
    float16 inputs whose scores overflow float16, against the float64 loop."""
    (q, k, v, d_out), scale = float16_large_scores(rng, "varied")
    t = len(q)
    as64 = [x.astype(np.float64) for x in (q, k, v, d_out)]
    out, lse = blocked_attention(q, k, v, block_q=2, block_k=3, scale=scale, is_causal=True)
    want_out, want_lse, _ = loop_forward(*as64[:3], scale, causal=True)
    assert np.all(want_lse > 79_000) and t == 3
    np.testing.assert_allclose(lse, want_lse, rtol=6e-8, atol=0)
    np.testing.assert_allclose(out, want_out, rtol=1e-3, atol=1e-3)
    grads = blocked_attention_backward(
        q, k, v, out, lse, d_out, block_q=2, block_k=1, scale=scale, is_causal=True
    )
    want = loop_backward(*as64, scale, causal=True)
    for got, ref in zip(grads[1:], want[1:]):
        np.testing.assert_allclose(got, ref, rtol=2e-3, atol=2e-3 * np.abs(ref).max())


# ---------------------------------------------------------------------------------------------
# PyTorch
# ---------------------------------------------------------------------------------------------


@pytest.mark.torch
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("block_q, block_k", [(1, 1), (3, 4), (16, 32)])
@pytest.mark.parametrize("is_causal, t", [(False, T), (True, T), (True, S + 2)])
def test_forward_and_backward_equal_torch(torch, is_causal, t, block_q, block_k, dtype, rng):
    """PyTorch's is_causal is top-left aligned too (tril(ones(T, S))), for T < S and T > S."""
    q, k, v = qkv(rng, dtype, t=t)
    d_out = rng.standard_normal((t, DV)).astype(dtype)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    t_out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=is_causal)
    t_out.backward(torch.tensor(d_out))
    options = dict(block_q=block_q, block_k=block_k, is_causal=is_causal)
    out, lse = blocked_attention(q, k, v, **options)
    grads = blocked_attention_backward(q, k, v, out, lse, d_out, **options)
    np.testing.assert_allclose(out, t_out.detach().numpy(), **TOL[dtype])
    for got, t in zip(grads, (tq, tk, tv)):
        np.testing.assert_allclose(got, t.grad.numpy(), **TOL[dtype])


# ---------------------------------------------------------------------------------------------
# Errors: one test per raise
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["block_q", "block_k"])
@pytest.mark.parametrize("bad", [2.0, True, None])
def test_block_size_of_the_wrong_kind(name, bad, rng):
    q, k, v = qkv(rng)
    sizes = {"block_q": 2, "block_k": 2, name: bad}
    with pytest.raises(TypeError, match=f"{name} must be a positive integer; got {bad!r}"):
        blocked_attention(q, k, v, **sizes)


@pytest.mark.parametrize("name", ["block_q", "block_k"])
def test_block_size_not_positive(name, rng):
    q, k, v = qkv(rng)
    sizes = {"block_q": 2, "block_k": 2, name: 0}
    with pytest.raises(ValueError, match=f"{name} must be a positive integer; got 0"):
        blocked_attention(q, k, v, **sizes)


def test_input_of_the_wrong_kind(rng):
    q, k, v = qkv(rng)
    with pytest.raises(TypeError, match="v must be a real floating, integer or bool array"):
        blocked_attention(q, k, v.astype(complex), block_q=2, block_k=2)


@pytest.mark.parametrize(
    "which, shape, letters",
    [
        (0, (2, T, DK), r"q must be a 2-D array \(T, Dk\)"),
        (1, (S,), r"k must be a 2-D array \(S, Dk\)"),
        (2, (1, S, DV), r"v must be a 2-D array \(S, Dv\)"),
    ],
)
def test_inputs_must_be_2d(which, shape, letters, rng):
    args = list(qkv(rng))
    args[which] = rng.standard_normal(shape)
    with pytest.raises(ValueError, match=letters + rf" \(one head, no batch\); got .*{shape}"):
        blocked_attention(*args, block_q=2, block_k=2)


def test_widths_must_match(rng):
    q, k, v = qkv(rng)
    with pytest.raises(
        ValueError,
        match=r"q and k must share the last dimension Dk; "
        r"got q.shape=\(7, 5\), k.shape=\(11, 4\)",
    ):
        blocked_attention(q, k[:, :4], v, block_q=2, block_k=2)


def test_lengths_must_match(rng):
    q, k, v = qkv(rng)
    with pytest.raises(
        ValueError,
        match=r"k and v must have the same number of rows S; "
        r"got k.shape=\(11, 5\), v.shape=\(10, 3\)",
    ):
        blocked_attention(q, k, v[:10], block_q=2, block_k=2)


def test_no_keys(rng):
    q, k, v = qkv(rng, s=0)
    with pytest.raises(ValueError, match=r"k and v must have at least one row \(S >= 1\)"):
        blocked_attention(q, k, v, block_q=2, block_k=2)


def test_scale_not_finite(rng):
    q, k, v = qkv(rng)
    with pytest.raises(ValueError, match="scale must be a finite real number or None; got inf"):
        blocked_attention(q, k, v, block_q=2, block_k=2, scale=float("inf"))


@pytest.mark.parametrize(
    "name, index, shape",
    [("out", 0, (T, DV + 1)), ("lse", 1, (T, 1)), ("d_out", 2, (T - 1, DV))],
)
def test_backward_results_must_have_the_forward_shapes(name, index, shape, rng):
    q, k, v = qkv(rng)
    out, lse = blocked_attention(q, k, v, block_q=2, block_k=2)
    given = [out, lse, np.ones_like(out)]
    given[index] = np.zeros(shape)
    with pytest.raises(
        ValueError,
        match=rf"{name} must have the shape of the forward .* "
        rf"got {name}.shape=\({shape[0]}, {shape[1]}\)",
    ):
        blocked_attention_backward(q, k, v, *given, block_q=2, block_k=2)


def test_backward_rejects_the_forward_errors(rng):
    q, k, v = qkv(rng)
    out, lse = blocked_attention(q, k, v, block_q=2, block_k=2)
    with pytest.raises(ValueError, match="block_k must be a positive integer; got -1"):
        blocked_attention_backward(q, k, v, out, lse, out, block_q=2, block_k=-1)


@pytest.mark.parametrize("bad", [np.inf, -np.inf])
def test_backward_rejects_an_infinite_lse(bad, rng):
    """blocked_attention never returns an infinite lse; one cast to float16 overflows to inf
    beyond 65504 and would silently give zero gradients."""
    q, k, v = qkv(rng)
    out, lse = blocked_attention(q, k, v, block_q=2, block_k=2)
    lse[3] = bad
    with pytest.raises(
        ValueError, match=rf"lse must be finite or NaN; got lse\[3\]={bad!r}.*float32 lse"
    ):
        blocked_attention_backward(q, k, v, out, lse, np.ones_like(out), block_q=2, block_k=2)


@pytest.mark.parametrize("function", ["forward", "backward"])
@pytest.mark.parametrize("bad", [1, None, "yes"])
def test_is_causal_must_be_a_bool(function, bad, rng):
    q, k, v = qkv(rng)
    out, lse = blocked_attention(q, k, v, block_q=2, block_k=2)
    with pytest.raises(TypeError, match=f"is_causal must be a bool; got {bad!r}"):
        if function == "forward":
            blocked_attention(q, k, v, block_q=2, block_k=2, is_causal=bad)
        else:
            blocked_attention_backward(q, k, v, out, lse, out, block_q=2, block_k=2, is_causal=bad)


@pytest.mark.parametrize("function", ["forward", "backward"])
def test_on_tile_must_be_callable(function, rng):
    q, k, v = qkv(rng)
    out, lse = blocked_attention(q, k, v, block_q=2, block_k=2)
    with pytest.raises(
        TypeError, match=r"on_tile must be callable, as on_tile\(i, j\), or None; got list"
    ):
        if function == "forward":
            blocked_attention(q, k, v, block_q=2, block_k=2, on_tile=[])
        else:
            blocked_attention_backward(q, k, v, out, lse, out, block_q=2, block_k=2, on_tile=[])
