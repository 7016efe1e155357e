"""Tests of sdpa.merge: attention over parts of the keys, merged, is attention over all of them.

The parts come from random splits of the keys (empty parts and parts whose every key is masked
included); the merged result is compared with one call over all the keys and with the float64
loop of tests/references.py. Hand-computed cases fix the weights of the parts; one test per
error message.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from references import attention_loop

from sdpa import merge_attention_states, scaled_dot_product_attention

B, H, T, S, DK, DV = 2, 3, 5, 29, 4, 6
MERGE_TOL = {
    np.float64: dict(rtol=1e-13, atol=1e-13),
    np.float32: dict(rtol=2e-6, atol=2e-6),
    np.float16: dict(rtol=3e-3, atol=3e-3),
}


def randn(rng, *shape, dtype=np.float64):
    return rng.standard_normal(shape).astype(dtype)


def random_cuts(rng, S_, P):
    """``P`` parts of ``range(S_)`` at random cuts; repeated cuts make empty parts."""
    inner = np.sort(rng.integers(0, S_ + 1, size=P - 1))
    return list(zip([0, *inner], [*inner, S_]))


def parts_of(q, k, v, cuts, mask=None, **kwargs):
    """Each part's ``(out, lse)``: attention of ``q`` over the keys ``a:b`` of each cut."""
    outs, lses = [], []
    for a, b in cuts:
        m = None if mask is None else mask[..., a:b]
        out, lse = scaled_dot_product_attention(
            q, k[..., a:b, :], v[..., a:b, :], m, return_lse=True, **kwargs
        )
        outs.append(out)
        lses.append(lse)
    return outs, lses


# ---------------------------------------------------------------------------------------------
# Against one call over all keys, and the float64 loop
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("P", [2, 3, 5, 8])
def test_random_splits_equal_one_call(rng, dtype, P):
    q, k, v = (randn(rng, B, H, n, d, dtype=dtype) for n, d in ((T, DK), (S, DK), (S, DV)))
    cuts = random_cuts(rng, S, P)
    mask = rng.random((T, S)) < 0.8
    a, b = max(cuts, key=lambda c: c[1] - c[0])
    mask[:, a : (a + b) // 2] = False  # half of the largest part masked for every query
    if P >= 3:
        cuts.insert(1, (cuts[0][1], cuts[0][1]))  # and an empty part, wherever it falls
    out, lse = merge_attention_states(*parts_of(q, k, v, cuts, mask))
    whole, whole_lse = scaled_dot_product_attention(q, k, v, mask, return_lse=True)
    assert out.dtype == dtype and lse.dtype == whole_lse.dtype
    np.testing.assert_allclose(out, whole, **MERGE_TOL[dtype])
    np.testing.assert_allclose(lse, whole_lse, **MERGE_TOL[dtype])
    want, _, want_lse = attention_loop(q, k, v, mask)
    np.testing.assert_allclose(out.astype(np.float64), want, **MERGE_TOL[dtype])
    np.testing.assert_allclose(lse, want_lse, **MERGE_TOL[dtype])


def test_parts_fully_masked_contribute_nothing(rng):
    q, k, v = randn(rng, H, T, DK), randn(rng, H, S, DK), randn(rng, H, S, DV)
    mask = np.ones((T, S), bool)
    mask[:, 10:20] = False  # the middle part: no key for any query
    mask[3, :] = False  # query 3: no key in any part
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = merge_attention_states(*parts_of(q, k, v, [(0, 10), (10, 20), (20, S)], mask))
    want, _, want_lse = attention_loop(q, k, v, mask)
    np.testing.assert_allclose(out, want, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-13)
    np.testing.assert_array_equal(out[:, 3], 0.0)
    np.testing.assert_array_equal(lse[:, 3], -np.inf)


@pytest.mark.parametrize("implementation", ["reference", "tiled"])
def test_causal_split_kv_decoding_equals_one_call(rng, implementation):
    # Decoding: the newest 2 queries against 29 cached keys, bottom-right causal, GQA.
    q, k, v = randn(rng, 6, 2, DK), randn(rng, 2, S, DK), randn(rng, 2, S, DV)
    kw = dict(enable_gqa=True, implementation=implementation)
    outs, lses = [], []
    for a, b in random_cuts(rng, S, 4):
        band = np.arange(a, b)[None, :] <= (S - 2 + np.arange(2))[:, None]  # causal, (T, b - a)
        o, l_ = scaled_dot_product_attention(q, k[:, a:b], v[:, a:b], band, return_lse=True, **kw)
        outs.append(o)
        lses.append(l_)
    out, lse = merge_attention_states(outs, lses)
    whole = scaled_dot_product_attention(
        q, k, v, is_causal=True, causal_alignment="bottom_right", return_lse=True, **kw
    )
    np.testing.assert_allclose(out, whole[0], rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(lse, whole[1], rtol=1e-13)


def test_a_sink_counted_in_one_part_equals_one_call_with_the_sink(rng):
    q, k, v = randn(rng, H, T, DK), randn(rng, H, S, DK), randn(rng, H, S, DV)
    sinks = randn(rng, H, 1)
    first = scaled_dot_product_attention(q, k[:, :12], v[:, :12], sinks=sinks, return_lse=True)
    second = scaled_dot_product_attention(q, k[:, 12:], v[:, 12:], return_lse=True)
    out, lse = merge_attention_states([first[0], second[0]], [first[1], second[1]])
    whole = scaled_dot_product_attention(q, k, v, sinks=sinks, return_lse=True)
    np.testing.assert_allclose(out, whole[0], rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(lse, whole[1], rtol=1e-13)


def test_the_order_of_the_parts_and_a_tree_of_merges_change_nothing(rng):
    q, k, v = randn(rng, H, T, DK), randn(rng, H, S, DK), randn(rng, H, S, DV)
    outs, lses = parts_of(q, k, v, random_cuts(rng, S, 6))
    flat = merge_attention_states(outs, lses)
    order = rng.permutation(6)
    shuffled = merge_attention_states([outs[i] for i in order], [lses[i] for i in order])
    left = merge_attention_states(outs[:3], lses[:3])
    right = merge_attention_states(outs[3:], lses[3:])
    tree = merge_attention_states([left[0], right[0]], [left[1], right[1]])
    for other in (shuffled, tree):
        np.testing.assert_allclose(other[0], flat[0], rtol=1e-13, atol=1e-14)
        np.testing.assert_allclose(other[1], flat[1], rtol=1e-14)


def test_float16_parts_are_merged_in_float32(rng):
    outs = [randn(rng, 40, DV, dtype=np.float16) for _ in range(4)]
    lses = [randn(rng, 40, dtype=np.float32) * 3 for _ in range(4)]
    out, lse = merge_attention_states(outs, lses)
    want, want_lse = merge_attention_states(
        [o.astype(np.float64) for o in outs], [x.astype(np.float64) for x in lses]
    )
    assert out.dtype == np.float16 and lse.dtype == np.float32
    # at most one float16 step from the float64 merge of the same parts (its rounding)
    step = np.spacing(np.abs(want).astype(np.float16)).astype(np.float64)
    assert np.all(np.abs(out.astype(np.float64) - want) <= step)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# Hand-computed cases
# ---------------------------------------------------------------------------------------------


def test_two_parts_with_equal_lse_give_the_mean_and_lse_plus_log_two():
    out, lse = merge_attention_states(
        [np.array([[1.0, -2.0]]), np.array([[3.0, 6.0]])], [np.array([0.7]), np.array([0.7])]
    )
    np.testing.assert_allclose(out, [[2.0, 2.0]], rtol=1e-15)
    np.testing.assert_allclose(lse, [0.7 + math.log(2.0)], rtol=1e-15)


def test_a_part_with_lse_log_three_weighs_three_quarters():
    # exp(log 3) / (exp(0) + exp(log 3)) = 3/4
    out, lse = merge_attention_states(
        [np.array([[4.0]]), np.array([[8.0]])], [np.array([0.0]), np.array([math.log(3.0)])]
    )
    np.testing.assert_allclose(out, [[0.25 * 4.0 + 0.75 * 8.0]], rtol=1e-15)
    np.testing.assert_allclose(lse, [math.log(4.0)], rtol=1e-15)


def test_parts_with_large_lse_do_not_overflow():
    # exp(1000) overflows float64: the merge subtracts the largest lse first.
    out, lse = merge_attention_states(
        [np.array([[1.0]]), np.array([[3.0]])], [np.array([1000.0]), np.array([1000.0])]
    )
    np.testing.assert_allclose(out, [[2.0]], rtol=1e-15)
    np.testing.assert_allclose(lse, [1000.0 + math.log(2.0)], rtol=1e-15)


def test_an_empty_part_contributes_nothing_even_if_its_output_holds_nan():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = merge_attention_states(
            [np.array([[1.0, 2.0], [5.0, 5.0]]), np.array([[np.nan, np.inf], [7.0, 9.0]])],
            [np.array([0.3, 0.0]), np.array([-np.inf, 0.0])],
        )
    np.testing.assert_array_equal(out[0], [1.0, 2.0])
    assert lse[0] == 0.3
    np.testing.assert_allclose(out[1], [6.0, 7.0], rtol=1e-15)


def test_every_part_empty_gives_zeros_and_minus_inf_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = merge_attention_states(
            [np.zeros((2, 3)), np.zeros((2, 3))], [np.full(2, -np.inf), np.full(2, -np.inf)]
        )
    np.testing.assert_array_equal(out, 0.0)
    np.testing.assert_array_equal(lse, -np.inf)


def test_an_lse_of_plus_inf_marks_an_empty_part_not_a_nan():
    """+inf, a kernel's sentinel for a part with no keys, weighs like -inf: row 0 is the other
    part alone, row 1 (both parts +inf) and row 2 (+inf and -inf) have no keys at all."""
    lses = [np.array([0.3, np.inf, np.inf]), np.array([np.inf, np.inf, -np.inf])]
    outs = [np.array([[1.0, 2.0], [4.0, 4.0], [5.0, 6.0]]), np.full((3, 2), 9.0)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = merge_attention_states(outs, lses)
    np.testing.assert_array_equal(out, [[1.0, 2.0], [0.0, 0.0], [0.0, 0.0]])
    np.testing.assert_array_equal(lse, [0.3, -np.inf, -np.inf])
    assert np.isposinf(lses[0][1:]).all() and np.isposinf(lses[1][:2]).all()  # not modified


def test_one_part_with_an_lse_of_plus_inf_gets_minus_inf():
    out, lse = merge_attention_states([np.array([[1.0], [2.0]])], [np.array([np.inf, 0.5])])
    np.testing.assert_array_equal(out, [[1.0], [2.0]])  # P = 1: the part as it is
    np.testing.assert_array_equal(lse, [-np.inf, 0.5])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_lses_further_apart_than_the_largest_float_merge_without_warnings(dtype):
    """3e38 - (-3e38) overflows float32 (1.5e308 twice, float64): the lower part's weight
    exp(-inf) = 0 is right, so no RuntimeWarning; the merge is the upper part."""
    big = dtype(0.85 * np.finfo(dtype).max)
    outs = [np.array([[1.0, 2.0]], dtype), np.array([[7.0, 8.0]], dtype)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = merge_attention_states(outs, [np.array([big]), np.array([-big])])
        swapped, lse_swapped = merge_attention_states(outs, [np.array([-big]), np.array([big])])
    np.testing.assert_array_equal(out, [[1.0, 2.0]])
    np.testing.assert_array_equal(lse, [big])
    np.testing.assert_array_equal(swapped, [[7.0, 8.0]])
    np.testing.assert_array_equal(lse_swapped, [big])


def test_nan_in_an_lse_makes_only_its_row_nan():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = merge_attention_states(
            [np.ones((3, 2)), np.ones((3, 2))], [np.array([0.0, np.nan, 1.0]), np.zeros(3)]
        )
    assert np.isnan(out[1]).all() and np.isnan(lse[1])
    assert not np.isnan(out[[0, 2]]).any() and not np.isnan(lse[[0, 2]]).any()


def test_nan_in_a_contributing_output_makes_its_row_nan():
    out, _ = merge_attention_states(
        [np.array([[np.nan, 1.0], [1.0, 1.0]]), np.ones((2, 2))], [np.zeros(2), np.zeros(2)]
    )
    assert np.isnan(out[0, 0]) and not np.isnan(out[[0, 1], [1, 0]]).any()


def test_one_part_is_returned_unchanged_as_a_copy(rng):
    out, lse = randn(rng, H, T, DV, dtype=np.float16), randn(rng, H, T, dtype=np.float32)
    got_out, got_lse = merge_attention_states([out], (lse,))
    np.testing.assert_array_equal(got_out, out)
    np.testing.assert_array_equal(got_lse, lse)
    assert got_out.dtype == np.float16 and got_lse.dtype == np.float32
    got_out[...] = 0
    assert out.any()  # a copy: the caller's part is untouched


def test_inputs_are_not_modified(rng):
    outs = [randn(rng, T, DV) for _ in range(3)]
    lses = [randn(rng, T) for _ in range(3)]
    lses[1][2] = -np.inf
    before = [a.copy() for a in (*outs, *lses)]
    merge_attention_states(outs, lses)
    for a, b in zip((*outs, *lses), before):
        np.testing.assert_array_equal(a, b)


def test_lists_of_numbers_are_accepted():
    out, lse = merge_attention_states([[[1.0]], [[3]]], ([0.0], [0.0]))
    np.testing.assert_allclose(out, [[2.0]])
    assert out.dtype == np.float64


# ---------------------------------------------------------------------------------------------
# Bad parts: one test per message
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("outputs", [np.zeros((2, 5, 3)), 3.0, None, (o for o in [])])
def test_outputs_that_are_not_a_list_or_tuple_raise(outputs):
    with pytest.raises(
        TypeError, match="outputs must be a list or tuple of arrays, one per part of the keys"
    ):
        merge_attention_states(outputs, [np.zeros(5), np.zeros(5)])


def test_a_single_array_is_refused_with_a_hint():
    with pytest.raises(TypeError, match=r"got ndarray \(a single part goes in a list: \[part\]\)"):
        merge_attention_states([np.zeros((5, 3))], np.zeros(5))


def test_lses_that_are_not_a_list_or_tuple_raise():
    with pytest.raises(
        TypeError, match="lses must be a list or tuple of arrays, one per part of the keys; got str"
    ):
        merge_attention_states([np.zeros((5, 3))], "lse")


@pytest.mark.parametrize("bad, message", [
    (np.zeros((5, 3), dtype=complex), r"outputs\[1\] must be a real floating, integer or bool array; got dtype complex128"),
    (None, r"outputs\[1\] must be an array; got None"),
    ([[1.0, 2.0], [3.0]], r"outputs\[1\] must be an array or a rectangular nested sequence"),
])  # fmt: skip
def test_a_part_that_is_not_a_real_array_raises(bad, message):
    error = ValueError if isinstance(bad, list) else TypeError
    with pytest.raises(error, match=message):
        merge_attention_states([np.zeros((5, 3)), bad], [np.zeros(5), np.zeros(5)])


def test_no_parts_raise():
    with pytest.raises(ValueError, match="outputs and lses must hold at least one part; got 0"):
        merge_attention_states([], [])


def test_unequal_numbers_of_outputs_and_lses_raise():
    with pytest.raises(
        ValueError, match="outputs and lses must hold one entry per part; got 2 outputs and 1 lses"
    ):
        merge_attention_states([np.zeros((5, 3))] * 2, [np.zeros(5)])


def test_a_zero_dimensional_output_raises():
    with pytest.raises(ValueError, match=r"outputs\[0\] must have the shape \(\.\.\., T, Dv\)"):
        merge_attention_states([np.float64(1.0)] * 2, [np.zeros(())] * 2)


def test_outputs_of_different_shapes_raise():
    with pytest.raises(
        ValueError,
        match=r"every part's output must have the shape of outputs\[0\], \(5, 3\); "
        r"got outputs\[1\].shape=\(4, 3\)",
    ):
        merge_attention_states([np.zeros((5, 3)), np.zeros((4, 3))], [np.zeros(5), np.zeros(4)])


def test_an_lse_that_does_not_fit_its_output_raises():
    with pytest.raises(
        ValueError,
        match=r"every part's lse must have the shape of its output without the last axis, "
        r"\(5,\); got lses\[1\].shape=\(5, 3\)",
    ):
        merge_attention_states([np.zeros((5, 3))] * 2, [np.zeros(5), np.zeros((5, 3))])
