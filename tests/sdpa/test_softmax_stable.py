"""Tests of sdpa.softmax: hand-computed values, stability, edge slices, dtypes, axes, errors,
and properties checked with Hypothesis against a float64 reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from sdpa import log_softmax, logsumexp, softmax

# Floating-point events that would mean overflow or NaN; underflow to zero is expected.
RAISE_ON_TROUBLE = dict(over="raise", invalid="raise", divide="raise")


# --- hand-computed cases -------------------------------------------------------------------


def test_seed_example_matches_hand_computation():
    # The formula walk-through: softmax([2.0, 1.0, 0.1]) is about [0.659, 0.242, 0.099].
    e = [math.exp(2.0), math.exp(1.0), math.exp(0.1)]
    expected = [x / sum(e) for x in e]
    p = softmax([2.0, 1.0, 0.1])
    np.testing.assert_allclose(p, expected, rtol=1e-15)
    np.testing.assert_allclose(p, [0.659, 0.242, 0.099], atol=5e-4)


def test_two_logits_give_one_and_e_over_one_plus_e():
    e = math.e
    np.testing.assert_allclose(softmax([0.0, 1.0]), [1 / (1 + e), e / (1 + e)], rtol=1e-15)
    np.testing.assert_allclose(logsumexp([0.0, 1.0]), math.log(1 + e), rtol=1e-15)
    np.testing.assert_allclose(
        log_softmax([0.0, 1.0]), [-math.log(1 + e), 1 - math.log(1 + e)], rtol=1e-15
    )


def test_logsumexp_and_log_softmax_by_hand():
    np.testing.assert_allclose(logsumexp([0.0, math.log(3.0)]), math.log(4.0), rtol=1e-15)
    lse = math.log(math.exp(2.0) + math.exp(1.0) + math.exp(0.1))
    np.testing.assert_allclose(
        log_softmax([2.0, 1.0, 0.1]), [2.0 - lse, 1.0 - lse, 0.1 - lse], rtol=1e-14
    )


def test_uniform_scores_give_uniform_weights():
    np.testing.assert_allclose(softmax(np.full(7, 3.5)), np.full(7, 1 / 7), rtol=1e-15)
    np.testing.assert_allclose(logsumexp(np.zeros(7)), math.log(7), rtol=1e-15)


# --- stability --------------------------------------------------------------------------


def test_float32_extremes_neither_overflow_nor_warn():
    x = np.array([[1e4, -1e4, 0.0], [-1e4, -1e4, -1e4]], dtype=np.float32)
    with np.errstate(**RAISE_ON_TROUBLE):
        p = softmax(x)
        lse = logsumexp(x)
        log_p = log_softmax(x)
    assert p.dtype == lse.dtype == log_p.dtype == np.float32
    np.testing.assert_allclose(p, [[1, 0, 0], [1 / 3, 1 / 3, 1 / 3]], rtol=1e-6)
    np.testing.assert_allclose(lse, [1e4, -1e4 + math.log(3)], rtol=1e-6)
    np.testing.assert_allclose(log_p, [[0, -2e4, -1e4], [-math.log(3)] * 3], rtol=1e-6)


def test_logsumexp_of_equal_large_values_is_value_plus_log_n():
    x = np.full(4, 1e4, dtype=np.float32)
    with np.errstate(**RAISE_ON_TROUBLE):
        lse = logsumexp(x)
    np.testing.assert_allclose(lse, 1e4 + math.log(4), rtol=1e-6)


def test_float64_extremes():
    x = np.array([1e300, -1e300, 0.0])
    with np.errstate(**RAISE_ON_TROUBLE):
        np.testing.assert_array_equal(softmax(x), [1.0, 0.0, 0.0])
        np.testing.assert_array_equal(logsumexp(x), 1e300)


# --- special slices ------------------------------------------------------------------------


def test_fully_negative_infinite_slice_gives_zero_and_minus_inf():
    x = np.array([[-np.inf, -np.inf, -np.inf], [0.0, 1.0, 2.0]])
    with np.errstate(**RAISE_ON_TROUBLE):
        p, lse, log_p = softmax(x), logsumexp(x), log_softmax(x)
    np.testing.assert_array_equal(p[0], [0.0, 0.0, 0.0])
    np.testing.assert_allclose(p[1].sum(), 1.0, rtol=1e-15)
    assert lse[0] == -np.inf and np.isfinite(lse[1])
    np.testing.assert_array_equal(log_p[0], [-np.inf] * 3)
    assert not np.isnan(p).any() and not np.isnan(lse).any() and not np.isnan(log_p).any()


def test_fully_negative_infinite_slice_along_axis_zero():
    x = np.array([[-np.inf, 0.0], [-np.inf, 0.0]])
    with np.errstate(**RAISE_ON_TROUBLE):
        p = softmax(x, axis=0)
        lse = logsumexp(x, axis=0)
    np.testing.assert_array_equal(p, [[0.0, 0.5], [0.0, 0.5]])
    np.testing.assert_allclose(lse, [-np.inf, math.log(2)], rtol=1e-15)


def test_partly_masked_slice_ignores_minus_inf_entries():
    x = np.array([-np.inf, 0.0, 1.0, -np.inf])
    e = math.e
    np.testing.assert_allclose(softmax(x), [0, 1 / (1 + e), e / (1 + e), 0], rtol=1e-15)
    log_p = log_softmax(x)
    assert log_p[0] == log_p[3] == -np.inf
    np.testing.assert_allclose(log_p[1:3], [-math.log(1 + e), 1 - math.log(1 + e)], rtol=1e-15)


def test_empty_slice():
    x = np.zeros((3, 0))
    assert softmax(x).shape == (3, 0)
    assert log_softmax(x).shape == (3, 0)
    np.testing.assert_array_equal(logsumexp(x), [-np.inf] * 3)


def test_positive_infinity_takes_all_the_mass():
    x = np.array([[np.inf, 1.0, np.inf], [np.inf, -np.inf, 0.0], [1.0, 2.0, 3.0]])
    with np.errstate(**RAISE_ON_TROUBLE):
        p, lse, log_p = softmax(x), logsumexp(x), log_softmax(x)
    np.testing.assert_array_equal(p[:2], [[0.5, 0.0, 0.5], [1.0, 0.0, 0.0]])
    np.testing.assert_allclose(p[2].sum(), 1.0, rtol=1e-15)
    np.testing.assert_array_equal(lse[:2], [np.inf, np.inf])
    np.testing.assert_array_equal(log_p[0], [math.log(0.5), -np.inf, math.log(0.5)])
    np.testing.assert_array_equal(log_p[1], [0.0, -np.inf, -np.inf])


def test_nan_makes_its_whole_slice_nan_without_warning():
    x = np.array([[np.nan, 1000.0, 1.0], [0.0, 1.0, 2.0]])
    with np.errstate(**RAISE_ON_TROUBLE):
        p, lse, log_p = softmax(x), logsumexp(x), log_softmax(x)
    assert np.isnan(p[0]).all() and np.isnan(lse[0]) and np.isnan(log_p[0]).all()
    assert np.isfinite(p[1]).all() and np.isfinite(lse[1])


# --- dtypes and axes ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_floating_dtype_is_preserved(dtype):
    x = np.array([[0.5, -1.0, 2.0], [3.0, 0.0, 0.0]], dtype=dtype)
    for f in (softmax, log_softmax, logsumexp):
        assert f(x).dtype == dtype


def test_float16_is_computed_in_float32():
    x16 = np.array([4.0, -3.0, 0.25, 7.5], dtype=np.float16)
    expected = softmax(x16.astype(np.float32)).astype(np.float16)
    np.testing.assert_array_equal(softmax(x16), expected)
    # float16 exp(7.5) alone is fine, but the sum of exp(x) without a shift overflows float16.
    big = np.array([10.0, 11.0], dtype=np.float16)
    np.testing.assert_allclose(softmax(big), [1 / (1 + math.e), math.e / (1 + math.e)], rtol=1e-3)


@pytest.mark.parametrize("values", [[1, 2, 3], [True, False, True], np.arange(3, dtype=np.uint8)])
def test_integer_and_bool_inputs_compute_in_float64(values):
    x = np.asarray(values)
    p = softmax(x)
    assert p.dtype == np.float64
    np.testing.assert_allclose(p, softmax(x.astype(np.float64)), rtol=0)
    assert logsumexp(x).dtype == log_softmax(x).dtype == np.float64


def test_lists_are_accepted():
    np.testing.assert_allclose(softmax([[0.0, 1.0]]), softmax(np.array([[0.0, 1.0]])), rtol=0)


@pytest.mark.parametrize("axis", [0, 1, 2, -1, -2, -3])
def test_axis_matches_moving_that_axis_last(axis, rng):
    x = rng.standard_normal((3, 5, 7))
    moved = np.moveaxis(x, axis, -1)
    np.testing.assert_allclose(
        softmax(x, axis=axis), np.moveaxis(softmax(moved), -1, axis), rtol=1e-15
    )
    np.testing.assert_allclose(logsumexp(x, axis=axis), logsumexp(moved), rtol=1e-15)
    np.testing.assert_allclose(
        log_softmax(x, axis=axis), np.moveaxis(log_softmax(moved), -1, axis), rtol=1e-15
    )
    assert logsumexp(x, axis=axis).shape == tuple(np.delete(x.shape, axis))
    np.testing.assert_allclose(softmax(x, axis=axis).sum(axis=axis), 1.0, rtol=1e-14)


def test_input_is_not_modified_and_read_only_input_works(rng):
    x = rng.standard_normal((5, 7))
    x[0] = -np.inf
    x.flags.writeable = False
    before = x.copy()
    for f in (softmax, log_softmax, logsumexp):
        f(x)
        f(x[:, ::2])  # a non-contiguous view
    np.testing.assert_array_equal(x, before)


# --- errors: one test per raise ------------------------------------------------------------


def test_zero_dimensional_input_raises():
    with pytest.raises(ValueError, match=r"x must have at least one dimension; got a 0-d array"):
        softmax(1.0)


def test_axis_out_of_range_raises():
    with pytest.raises(ValueError, match=r"axis=2 is out of range for an array of shape \(3, 5\)"):
        logsumexp(np.zeros((3, 5)), axis=2)


@pytest.mark.parametrize("axis", [1.0, None, (0, 1), True])
def test_non_integer_axis_raises(axis):
    with pytest.raises(TypeError, match=r"axis must be an integer; got"):
        log_softmax(np.zeros((3, 5)), axis=axis)


@pytest.mark.parametrize(
    "x, dtype",
    [([1j, 2.0], "complex128"), (np.array([1, None], dtype=object), "object"), (["a"], "<U1")],
)
def test_non_real_input_raises(x, dtype):
    with pytest.raises(
        TypeError,
        match=rf"x must be a real floating, integer or bool array; got dtype {dtype}",
    ):
        softmax(x)


# --- properties (Hypothesis) -------------------------------------------------------------

finite64 = hnp.arrays(
    np.float64,
    hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=6),
    elements=st.floats(-50, 50),
)


def reference_softmax(x: np.ndarray) -> np.ndarray:
    """Naive float64 softmax along the last axis; safe for |x| <= 50 (exp(50) ~ 5e21)."""
    e = np.exp(x.astype(np.float64))
    return e / e.sum(axis=-1, keepdims=True)


@settings(max_examples=40, deadline=None)
@given(x=finite64)
def test_property_agrees_with_float64_reference(x):
    ref = reference_softmax(x)
    np.testing.assert_allclose(softmax(x), ref, rtol=1e-12, atol=1e-300)
    np.testing.assert_allclose(logsumexp(x), np.log(np.exp(x).sum(axis=-1)), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.exp(log_softmax(x)), ref, rtol=1e-12, atol=1e-300)


@settings(max_examples=40, deadline=None)
@given(x=finite64)
def test_property_float32_agrees_with_float64_reference(x):
    x32 = x.astype(np.float32)
    p = softmax(x32)
    assert p.dtype == np.float32
    np.testing.assert_allclose(p, reference_softmax(x32), rtol=1e-5, atol=1e-7)


@settings(max_examples=40, deadline=None)
@given(
    x=hnp.arrays(
        np.float32,
        hnp.array_shapes(min_dims=1, max_dims=2, min_side=1, max_side=8),
        elements=st.floats(-1e4, 1e4, width=32),
    )
)
def test_property_large_float32_is_stable_and_accurate(x):
    with np.errstate(**RAISE_ON_TROUBLE):
        p = softmax(x)
        lse = logsumexp(x)
        log_p = log_softmax(x)
    # float64 reference for log_softmax: shift by the maximum, exactly representable here
    x64 = x.astype(np.float64)
    z = x64 - x64.max(axis=-1, keepdims=True)
    np.testing.assert_allclose(
        log_p, z - np.log(np.exp(z).sum(axis=-1, keepdims=True)), rtol=1e-5, atol=1e-5
    )
    assert np.all(p >= 0) and np.isfinite(lse).all()
    np.testing.assert_allclose(p.sum(axis=-1), 1.0, rtol=1e-5)
    # lse lies between the maximum and the maximum plus log(N)
    m = x.max(axis=-1)
    assert np.all(lse >= m) and np.all(lse <= m + np.float32(math.log(x.shape[-1]) + 1e-3))


@settings(max_examples=40, deadline=None)
@given(x=finite64, c=st.floats(-1e3, 1e3))
def test_property_shift_invariance(x, c):
    np.testing.assert_allclose(softmax(x + c), softmax(x), rtol=1e-9, atol=1e-300)
    np.testing.assert_allclose(logsumexp(x + c), logsumexp(x) + c, rtol=1e-12, atol=1e-9)


# --- finite inputs spread beyond the range, masked arrays ------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_finite_inputs_wider_than_the_range_do_not_warn(dtype):
    # x - max(x) = -2 * finfo.max overflows to -inf: the far entry's probability is 0 (its
    # true value, exp(-3.6e38), underflows anyway) and no warning is emitted (warnings are
    # errors in this suite).
    big = np.finfo(dtype).max
    x = np.array([[big, -big, 0.0], [-big, -big, -big]], dtype=dtype)
    with np.errstate(**RAISE_ON_TROUBLE):
        p, log_p, lse = softmax(x), log_softmax(x), logsumexp(x)
    np.testing.assert_array_equal(p[0], [1.0, 0.0, 0.0])
    np.testing.assert_allclose(p[1], [1 / 3] * 3, rtol=1e-6)  # three equal entries
    np.testing.assert_array_equal(log_p[0], [0.0, -np.inf, -big])
    np.testing.assert_allclose(lse, [big, -big], rtol=1e-6)


@pytest.mark.parametrize("f", [softmax, log_softmax, logsumexp])
def test_masked_arrays_raise(f):
    # np.asarray would drop the mask and use the masked entries.
    x = np.ma.masked_array([1.0, 2.0, 3.0], mask=[False, True, False])
    with pytest.raises(
        TypeError,
        match=r"x must not be a numpy.ma.MaskedArray: its mask would "
        r"be silently ignored; pass the plain array with the "
        r"masked entries set to -inf",
    ):
        f(x)


def test_ragged_input_names_x():
    with pytest.raises(ValueError, match=r"^x must be an array or a rectangular nested sequence"):
        softmax([[1.0, 2.0], [3.0]])
