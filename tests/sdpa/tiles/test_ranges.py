"""Values near the ends of the dtype's range (sdpa.tiles.ranges): which columns are scaled, by
which power of two, how the result shows that a call must be computed again, and that undoing
the scaling is exact.

The thresholds are the documented ones, written here from the dtype's ``finfo``: a column is
scaled when its largest ``|v|`` is above ``finfo.max / (4 S e**LAZY_MARGIN)`` or below
``2**VALUE_FLOOR_BITS`` times the smallest normal number.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from sdpa.tiles.ranges import (
    restore_scale,
    value_exponents,
    values_may_be_out_of_range,
    widen_column_top,
)
from sdpa.tuning import LAZY_MARGIN, VALUE_FLOOR_BITS

DTYPES = [np.float64, np.float32]


def high(dtype, S):
    return float(np.finfo(dtype).max) / (4 * math.exp(LAZY_MARGIN) * S)


def low(dtype):
    return float(np.finfo(dtype).smallest_normal) * 2.0**VALUE_FLOOR_BITS


@pytest.mark.parametrize("dtype", DTYPES)
def test_ordinary_values_need_no_exponents(dtype, rng):
    value = rng.standard_normal((2, 7, 3)).astype(dtype)
    value[..., 1] = 0  # a column of zeros is left alone too
    assert value_exponents(value, S=7) is None
    value[0, 2, 2] = np.inf  # as is a column holding inf (the result is inf there anyway)
    assert value_exponents(value, S=7) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_exponents_bring_the_largest_magnitude_into_half_to_one(dtype, rng):
    S = 5
    value = rng.uniform(-1, 1, size=(3, S, 4)).astype(dtype)
    value[..., 1] *= dtype(high(dtype, S) * 4)  # near the largest number
    value[1, 2, 1] = -dtype(high(dtype, S) * 8)  # its largest magnitude is negative
    value[..., 2] *= dtype(low(dtype) / 16)  # near the smallest normal number
    value[..., 3] = 0
    before = value.copy()
    e = value_exponents(value, S)
    np.testing.assert_array_equal(value, before)  # the input is not touched
    assert e is not None and e.shape == (4,) and np.issubdtype(e.dtype, np.integer)
    assert e[0] == 0 and e[3] == 0  # ordinary and zero columns left alone
    scaled = np.ldexp(value, -e.astype(np.int32))
    top = np.max(np.abs(scaled), axis=(0, 1))
    assert np.all((top[1:3] >= 0.5) & (top[1:3] < 1)), top
    np.testing.assert_array_equal(scaled[..., [0, 3]], value[..., [0, 3]])  # bit for bit
    np.testing.assert_array_equal(np.ldexp(scaled, e.astype(np.int32)), value)  # exact


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("S", [1, 9])
def test_the_thresholds(dtype, S):
    def exponents(top):
        value = np.array([[[1.0, top]]], dtype=dtype).repeat(S, axis=1)  # (1, S, 2)
        return value_exponents(value, S)

    assert exponents(high(dtype, S) * 0.99) is None
    assert exponents(high(dtype, S) * 1.01)[1] == math.frexp(dtype(high(dtype, S) * 1.01))[1]
    assert exponents(low(dtype) * 1.01) is None
    assert exponents(low(dtype) * 0.99)[1] == math.frexp(dtype(low(dtype) * 0.99))[1]


@pytest.mark.parametrize("dtype", DTYPES)
def test_values_may_be_out_of_range(dtype):
    def check(*top):
        return values_may_be_out_of_range(np.array(top, dtype=dtype))

    assert not check(0.25, 3.0, low(dtype) * 2)
    assert check(0.25, np.inf)  # overflow shows as inf ...
    assert check(0.25, np.nan)  # ... or NaN
    assert check(0.25, low(dtype) / 2)  # a column of results near the smallest normal
    assert check(0.25, 0.0)  # (all zero: the values may have been so small)


def test_widen_column_top_raises_in_place_and_keeps_nan():
    top = np.array([0.5, 2.0, np.nan])
    widen_column_top(top, np.array([[[0.25, -1.0, 1.0]], [[-3.0, 1.5, 0.0]]]))
    np.testing.assert_array_equal(top, [3.0, 2.0, np.nan])
    widen_column_top(top, np.zeros((0, 3)))  # nothing to see
    np.testing.assert_array_equal(top, [3.0, 2.0, np.nan])
    widen_column_top(top, np.array([[np.nan, 0.0, 7.0]]))
    np.testing.assert_array_equal(top, [np.nan, 2.0, np.nan])


@pytest.mark.parametrize("rows", [1, 7, 48, 1024, 1040])
@pytest.mark.parametrize("Dv", [3, 64, 96])
def test_widen_column_top_of_a_view_of_several_heads_is_each_column_s_largest_magnitude(rows, Dv):
    # A unit's block as the faces hand it over: rows t0:t1 of several heads of a larger result
    # (not contiguous across heads), its rows laid side by side inside the function.
    rng = np.random.default_rng(rows * Dv)
    result = rng.standard_normal((2, 3, rows + 5, Dv)).astype(np.float32)
    block = result[:, 1:, 2 : 2 + rows]
    top = np.full(Dv, 0.5, np.float32)
    expected = np.maximum(0.5, np.abs(block.astype(np.float64)).reshape(-1, Dv).max(axis=0))
    widen_column_top(top, block)
    np.testing.assert_array_equal(top, expected.astype(np.float32))
    block[-1, -1, rows // 2, Dv - 1] = np.nan  # met anywhere, it reaches its column only
    widen_column_top(top, block)
    assert np.isnan(top[-1]) and not np.isnan(top[:-1]).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_restore_scale_undoes_the_scaling_exactly(dtype, rng):
    S = 4
    out = rng.uniform(-1, 1, size=(2, 3, 3)).astype(dtype)
    out[..., 1] *= dtype(high(dtype, S) * 100)
    out[..., 2] *= dtype(low(dtype) / 100)
    e = value_exponents(out, S)  # as the values would be scaled
    assert e is not None and e[0] == 0
    scaled = np.ldexp(out, -e.astype(np.int32))  # the result computed on scaled values
    top = np.zeros(3, dtype)
    restore_scale(scaled, e, top)
    np.testing.assert_array_equal(scaled, out)
    np.testing.assert_array_equal(top, 0)  # a scaled call has nothing left to check


def test_restore_scale_without_exponents_records_the_top():
    out = np.array([[1.0, -4.0], [-2.0, 0.5]])
    top = np.zeros(2)
    restore_scale(out, None, top)
    np.testing.assert_array_equal(out, [[1.0, -4.0], [-2.0, 0.5]])
    np.testing.assert_array_equal(top, [2.0, 4.0])
