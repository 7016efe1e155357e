"""Tests of sdpa.flex_attention at the ends of each dtype's range, and of what its tiled path
must leave as it found it.

* both paths (``implementation="reference"`` and the tiled path, in pieces of a few keys)
  against a float64 loop (``references.attention_loop``) on cases Hypothesis draws: float32
  and float64, values near ``finfo.max / 4`` (of one sign or mixed), near the smallest normal
  number, or ordinary, column by column; scores near ``+-finfo.max / 4``, all far below zero
  (about -18), or ordinary; with and without a ``score_mod`` (a stored bias) and a block mask
  (causal, sliding window, per-head), GQA. The values are scaled by a power of two per column
  for the loop and the results compared at that scale, so the float64 loop neither overflows
  nor meets subnormal numbers;
* the issue's cases one by one: ``1e37`` values, mixed signs that overflow a partial sum,
  ``2e-37`` values at a score of -18, eight heads through ``implementation="auto"``; no
  warning at scores near ``finfo.max``; zero-width query/key heads (``Dk = 0``) and values
  (``Dv = 0``);
* a ``score_mod`` returning a stored bias (or a basic slice of one) of the tile's shape: the
  bias is not written into, and the same call twice gives the same bits;
* a block mask pickles and deep-copies before and after a tiled call, its copies give the same
  bits, and the plans kept for it go when it goes;
* the same inputs from 2 to 4 pool threads give the bits of the single-threaded call.

Written for this project (no upstream file is ported).
"""

from __future__ import annotations

import copy
import gc
import pickle
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import references
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sdpa
from sdpa import create_block_mask, flex_attention
from sdpa.flex import flex_attention_tiled

DTYPES = [np.float32, np.float64]
# Errors measured against the largest |v| of each column (the values are scaled to about 1).
TOL = {np.float32: 5e-5, np.float64: 1e-11}


def _causal(b, h, i, j):
    return i >= j


def _window(b, h, i, j):
    return (i >= j) & (i - j <= 5)


def _per_head(b, h, i, j):  # head 0 causal, head 1 anti-causal, the others everything
    return np.where(h == 0, i >= j, np.where(h == 1, i <= j, j >= 0))


# mask_mod, and the same rule for one entry (written apart, for the loop)
MASKS = {
    "causal": (_causal, lambda b, h, i, j: i >= j),
    "window": (_window, lambda b, h, i, j: 0 <= i - j <= 5),
    "per head": (_per_head, lambda b, h, i, j: (i >= j) if h == 0 else (i <= j) if h == 1 else 1),
}


def draw_values(rng, shape, kinds, dtype):
    """``(..., S, Dv)`` values whose column ``d`` is of the kind ``kinds[d]``."""
    finfo = np.finfo(dtype)
    columns = []
    for kind in kinds:
        size = shape[:-1]
        sign = rng.choice([-1.0, 1.0], size=size)
        if kind == "huge":
            columns.append(float(finfo.max) / 4 * rng.uniform(0.25, 1, size) * sign)
        elif kind == "huge, positive":
            columns.append(float(finfo.max) / 4 * rng.uniform(0.25, 1, size))
        elif kind == "tiny":
            columns.append(float(finfo.smallest_normal) * 2 ** rng.uniform(0, 8, size) * sign)
        else:
            columns.append(rng.standard_normal(size))
    return np.stack(columns, axis=-1).astype(dtype)


def draw_queries_keys(rng, q_shape, k_shape, kind, dtype):
    """Queries and keys of width 2 whose scores ``q . k`` (scale 1) are of the kind given:
    ``q_i = (a_i, 1)``, ``k_j = (b_j, c_j)``, score ``a_i b_j + c_j``."""
    half = np.sqrt(float(np.finfo(dtype).max) / 4)
    if kind == "huge":  # |score| up to finfo.max / 4, of both signs
        a = half * rng.uniform(0.5, 1, q_shape) * rng.choice([-1.0, 1.0], q_shape)
        b = half * rng.uniform(0.5, 1, k_shape) * rng.choice([-1.0, 1.0], k_shape)
        c = np.zeros(k_shape)
    elif kind == "far below zero":  # about -18: the lazy shift 0 is kept, weights ~ e**-18
        a, b = rng.uniform(-1, 1, q_shape), rng.uniform(-1, 1, k_shape)
        c = -18 + rng.uniform(-1, 1, k_shape)
    else:
        a, b, c = (
            2 * rng.standard_normal(q_shape),
            rng.standard_normal(k_shape),
            rng.normal(size=k_shape),
        )
    q = np.stack([a, np.ones(q_shape)], axis=-1).astype(dtype)
    k = np.stack([b, c], axis=-1).astype(dtype)
    return q, k


def loop_at_scale(q, k, v, allowed, bias):
    """The float64 loop on values scaled by ``2 ** -e`` per column, and ``e``."""
    top = np.max(np.abs(v.astype(np.float64)), axis=(0, 1, 2))  # (Dv,)
    e = np.frexp(top)[1]
    mask = allowed
    if bias is not None:
        mask = bias if allowed is None else np.where(allowed, bias, -np.inf)
    scaled = np.ldexp(v.astype(np.float64), -e)
    out, _, lse = references.attention_loop(q, k, scaled, mask, scale=1.0, enable_gqa=True)
    return out, lse, e


def dense_allowed(rule, B, Hq, T, S):
    allowed = np.zeros((B, Hq, T, S), dtype=bool)
    for b, h, i, j in np.ndindex(B, Hq, T, S):
        allowed[b, h, i, j] = bool(rule(b, h, i, j))
    return allowed


@st.composite
def extreme_cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    B, Hkv, G = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    T, S, Dv = draw(st.integers(1, 24)), draw(st.integers(1, 40)), draw(st.integers(1, 3))
    value_kinds = draw(
        st.lists(
            st.sampled_from(["huge", "huge, positive", "tiny", "ordinary"]),
            min_size=Dv,
            max_size=Dv,
        )
    )
    score_kind = draw(st.sampled_from(["huge", "far below zero", "ordinary"]))
    mask_name = draw(st.sampled_from([None, *MASKS]))
    block = (draw(st.integers(1, 16)), draw(st.integers(1, 16)))
    with_mod = draw(st.booleans())
    block_k = draw(st.integers(1, 48))
    seed = draw(st.integers(0, 2**32 - 1))
    return (
        dtype,
        (B, Hkv, G, T, S, Dv),
        value_kinds,
        score_kind,
        mask_name,
        block,
        with_mod,
        block_k,
        seed,
    )


@settings(max_examples=100, suppress_health_check=[HealthCheck.too_slow])
@given(extreme_cases())
def test_both_paths_match_a_float64_loop_at_the_ends_of_the_range(case):
    (
        dtype,
        (B, Hkv, G, T, S, Dv),
        value_kinds,
        score_kind,
        mask_name,
        block,
        with_mod,
        block_k,
        seed,
    ) = case
    rng = np.random.default_rng(seed)
    Hq = Hkv * G
    q, k = draw_queries_keys(rng, (B, Hq, T), (B, Hkv, S), score_kind, dtype)
    v = draw_values(rng, (B, Hkv, S, Dv), value_kinds, dtype)
    bias = score_mod = None
    if with_mod:
        bias = 3 * rng.standard_normal((B, Hq, T, S))  # float64, stored: the mod returns a sum

        def score_mod(s, b, h, i, j):
            return s + bias[b, h, i, j]

    block_mask = allowed = None
    if mask_name is not None:
        mask_mod, rule = MASKS[mask_name]
        H = Hq if mask_name == "per head" else None
        block_mask = create_block_mask(mask_mod, None, H, T, S, BLOCK_SIZE=block)
        allowed = dense_allowed(rule, B, Hq, T, S)
    want_out, want_lse, e = loop_at_scale(q, k, v, allowed, bias)
    args = (q, k, v, score_mod, block_mask, 1.0, True, True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no RuntimeWarning from either path
        results = {
            "reference": flex_attention(*args, implementation="reference"),
            "tiled": flex_attention_tiled(*args, block_k=block_k),
        }
    tol = TOL[dtype]
    for name, (out, lse) in results.items():
        assert out.dtype == dtype
        got = np.ldexp(out.astype(np.float64), -e)
        np.testing.assert_allclose(got, want_out, rtol=tol, atol=tol, err_msg=name)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse), err_msg=name)
        np.testing.assert_allclose(lse, want_lse, rtol=tol, atol=tol, err_msg=name)


# ---------------------------------------------------------------------------------------------
# The cases, one by one
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", ["reference", "tiled"])
def test_values_of_1e37_give_1e37(implementation):
    # Every score 0: uniform weights over 100 equal values, so out is exactly that value.
    q, k = np.zeros((1, 1, 4, 8), np.float32), np.zeros((1, 1, 100, 8), np.float32)
    v = np.full((1, 1, 100, 1), 1e37, np.float32)
    out = flex_attention(q, k, v, implementation=implementation)
    np.testing.assert_allclose(out, 1e37, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("implementation", ["reference", "tiled"])
def test_mixed_signs_near_the_largest_number_cancel_without_nan(implementation, dtype):
    # Equal scores; the first 60 values are +x, the last 40 are -x, x = finfo.max / 8: the mean
    # is x / 5, while a sum of the first 60 overflows. Column 1 holds minus them, reversed.
    x = float(np.finfo(dtype).max) / 8
    column = np.where(np.arange(100) < 60, x, -x)
    v = np.stack([column, -column[::-1]], axis=-1)[None, None].astype(dtype)
    q, k = np.zeros((1, 1, 3, 4), dtype), np.zeros((1, 1, 100, 4), dtype)
    out = flex_attention(q, k, v, implementation=implementation)
    want = np.broadcast_to([x / 5, -x / 5], out.shape)
    np.testing.assert_allclose(out, want, rtol=1e-5 if dtype == np.float32 else 1e-12)


@pytest.mark.parametrize("implementation", ["reference", "tiled"])
def test_values_near_the_smallest_normal_at_a_score_of_minus_18_keep_their_digits(
    implementation,
):
    # Every score q . k = sqrt(18) * -sqrt(18) = -18 (to rounding, the same for all keys), so
    # out is the one value, 2e-37 (a few times float32's smallest normal, 1.18e-38).
    q = np.full((1, 1, 4, 1), np.sqrt(18.0), np.float32)
    k = np.full((1, 1, 100, 1), -np.sqrt(18.0), np.float32)
    v = np.full((1, 1, 100, 1), 2e-37, np.float32)
    out = flex_attention(q, k, v, scale=1.0, implementation=implementation)
    np.testing.assert_allclose(out, 2e-37, rtol=1e-5)


def test_auto_on_eight_heads_with_values_of_1e36_matches_the_reference_path():
    # 8 heads of 256 x 256 scores (2 ** 19: "auto" takes the tiled path) of width 64.
    rng = np.random.default_rng(7)
    q, k = (rng.standard_normal((1, 8, 256, 64)).astype(np.float32) for _ in range(2))
    v = (1e36 * rng.uniform(0.5, 1, (1, 8, 256, 4))).astype(np.float32)
    want = flex_attention(q, k, v, implementation="reference")
    got = flex_attention(q, k, v, implementation="auto")
    np.testing.assert_array_equal(got, flex_attention(q, k, v, implementation="tiled"))
    np.testing.assert_allclose(got, want, rtol=2e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scores_near_the_largest_number_give_no_warning(dtype):
    # |q . k| up to finfo.max / 2, of both signs, in pieces of 3 keys with a causal mask and
    # with a score_mod (the path in natural units): the one-hot softmax of the loop, no warning.
    rng = np.random.default_rng(3)
    half = np.sqrt(float(np.finfo(dtype).max) / 2)
    q = (half * rng.uniform(0.5, 1, (1, 2, 9, 1)) * rng.choice([-1, 1], (1, 2, 9, 1))).astype(dtype)
    k = (half * rng.uniform(0.5, 1, (1, 2, 11, 1)) * rng.choice([-1, 1], (1, 2, 11, 1))).astype(
        dtype
    )
    v = rng.standard_normal((1, 2, 11, 3)).astype(dtype)
    mask = create_block_mask(_causal, None, None, 9, 11, BLOCK_SIZE=2)
    allowed = dense_allowed(MASKS["causal"][1], 1, 2, 9, 11)
    for score_mod in (None, lambda s, b, h, i, j: s * 1):
        for block_mask, want_allowed in ((None, None), (mask, allowed)):
            want, _, _ = references.attention_loop(q, k, v, want_allowed, scale=1.0)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                got = flex_attention_tiled(q, k, v, score_mod, block_mask, scale=1.0, block_k=3)
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("Dk", "Dv"), [(0, 3), (4, 0), (0, 0)])
def test_zero_width_heads_work_on_the_tiled_path(Dk, Dv):
    # Dk = 0: every score is 0, uniform weights: out is the mean of the values, lse log(S).
    rng = np.random.default_rng(5)
    q, k = rng.standard_normal((2, 4, 6, Dk)), rng.standard_normal((2, 2, 7, Dk))
    v = rng.standard_normal((2, 2, 7, Dv))
    mask = create_block_mask(_causal, None, None, 6, 7, BLOCK_SIZE=4)
    for block_mask in (None, mask):
        want = flex_attention(
            q, k, v, None, block_mask, enable_gqa=True, return_lse=True, implementation="reference"
        )
        got = flex_attention_tiled(q, k, v, None, block_mask, enable_gqa=True, return_lse=True)
        for a, b in zip(got, want):
            assert a.shape == b.shape
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    if Dk == 0:
        out, lse = flex_attention_tiled(q, k, v, enable_gqa=True, return_lse=True)
        want_out = np.repeat(v.mean(axis=2, keepdims=True), 2, axis=1)
        np.testing.assert_allclose(
            out, np.broadcast_to(want_out, out.shape), rtol=1e-12, atol=1e-12
        )
        np.testing.assert_allclose(lse, np.log(7), rtol=1e-12)


# ---------------------------------------------------------------------------------------------
# What the tiled path leaves as it found it
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stored", ["the array", "a basic slice"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_score_mod_returning_a_stored_bias_leaves_it_unchanged(stored, dtype):
    # One unit per head without a mask: the tile is (1, 1, T, S), the bias's very shape and dtype.
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((1, 1, 16, 4)).astype(dtype) for _ in range(3))
    big = rng.standard_normal((1, 1, 20, 24)).astype(dtype)
    bias = big if stored == "the array" else big[:, :, 2:18, 5:21]
    bias = bias[:, :, :16, :16] if stored == "the array" else bias
    before = big.copy()

    def score_mod(s, b, h, i, j):
        return bias

    first = flex_attention(q, k, v, score_mod, implementation="tiled")
    np.testing.assert_array_equal(big, before)
    second = flex_attention(q, k, v, score_mod, implementation="tiled")
    np.testing.assert_array_equal(second, first)
    want, _, _ = references.attention_loop(0 * q, k, v, bias.astype(np.float64))  # scores: the bias
    tol = TOL[dtype] if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(first, want, rtol=tol, atol=tol)


def _pickled_window(b, h, i, j):  # module level: it pickles
    return (i >= j) & (i - j < 20)


def test_a_block_mask_pickles_and_deep_copies_before_and_after_a_tiled_call():
    rng = np.random.default_rng(13)
    q, k, v = (rng.standard_normal((1, 2, 50, 4)) for _ in range(3))
    mask = create_block_mask(_pickled_window, None, None, 50, 50, BLOCK_SIZE=8)
    copies = [pickle.loads(pickle.dumps(mask)), copy.deepcopy(mask)]
    want = flex_attention(q, k, v, block_mask=mask, implementation="tiled")
    copies += [pickle.loads(pickle.dumps(mask)), copy.deepcopy(mask)]
    for other in copies:
        assert repr(other) == repr(mask)
        np.testing.assert_array_equal(other.kinds, mask.kinds)
        got = flex_attention(q, k, v, block_mask=other, implementation="tiled")
        np.testing.assert_array_equal(got, want)
        pickle.dumps(other)  # and again after the copy's own tiled call


def test_the_plans_kept_for_a_block_mask_go_with_it():
    from sdpa.tiles.blocks import plans_beside

    q = np.random.default_rng(17).standard_normal((1, 1, 40, 4))
    mask = create_block_mask(_pickled_window, None, None, 40, 40, BLOCK_SIZE=8)
    flex_attention(q, q, q, block_mask=mask, implementation="tiled")
    plans = plans_beside(mask, sdpa.tuning.PLAN_CACHE_BYTES)
    assert plans.plans  # the plans the call made: kept for the mask
    kept = weakref.ref(plans)
    del plans, mask
    gc.collect()
    assert kept() is None


# ---------------------------------------------------------------------------------------------
# Threads
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_pool_threads_give_the_bits_of_one_thread_at_the_ends_of_the_range(dtype):
    # Huge values in one column, tiny in another (both computed again, scaled), scores far
    # below zero, a score_mod and a new block mask per run (its plans made by racing threads).
    rng = np.random.default_rng(19)
    q, k = draw_queries_keys(rng, (2, 4, 37), (2, 2, 45), "far below zero", dtype)
    v = draw_values(rng, (2, 2, 45, 3), ["huge", "tiny", "ordinary"], dtype)

    def score_mod(s, b, h, i, j):
        return s - 0.01 * (i - j)

    def run(num_threads):
        mask = create_block_mask(_window, None, None, 37, 45, BLOCK_SIZE=(8, 4))
        return flex_attention_tiled(
            q,
            k,
            v,
            score_mod,
            mask,
            enable_gqa=True,
            return_lse=True,
            num_threads=num_threads,
            block_k=8,
        )

    one = run(1)
    for n_workers in (2, 3, 4):
        with ThreadPoolExecutor(max_workers=n_workers) as pool:
            for got in pool.map(run, [1, 2] * n_workers):
                for a, b in zip(got, one):
                    np.testing.assert_array_equal(a, b)
