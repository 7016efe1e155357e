"""The online softmax of the engine (sdpa.tiles.softmax), step by step, on hand-computed rows.

Each test builds a few rows (2 to 4 rows, 1 to 3 keys per piece, ``Dv`` 1 or 2) whose running
state ``m``, ``l``, ``acc`` and whose ``out`` and ``lse`` are worked out by hand in the test,
in natural units (``np.exp``) and in base 2 (``np.exp2``, scores in units of ``ln 2``, where
small integer scores make every term a power of two and the sums exact). A Hypothesis test
then adds random pieces in any mix of lazy and exact steps, following the faces' protocol
(the lazy step only once every row has a shift, a failed one redone by the exact step, a unit
started at zero redone without it when its sums do not hold), against a float64 softmax
written in the test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sdpa
from sdpa.tiles.softmax import (
    LAZY_BOUND,
    LAZY_FLOOR,
    SCRATCH,
    OnlineSoftmax,
    ScratchPool,
    Workspace,
    add_sinks,
)
from sdpa.tuning import LAZY_MARGIN

LN2, LN3, LN5 = math.log(2), math.log(3), math.log(5)
TIGHT = dict(rtol=1e-15, atol=0)  # a few roundings of exp and log at most
F64 = np.dtype(np.float64)


def softmax_state(rows, keys, Dv, *, base2=False, at_zero=True, groups=1):
    """A fresh online softmax of ``rows`` rows in float64, for pieces of up to ``keys`` keys."""
    space = Workspace(rows, keys, Dv, F64)
    exp = np.exp2 if base2 else np.exp
    return OnlineSoftmax(space, rows, Dv, exp, base2, at_zero, groups=groups)


def snapshot(sm):
    """Copies of the running state (the buffers are reused: copies, not views)."""
    return sm.m.copy(), sm.l.copy(), sm.acc.copy()


def finished(sm, sinks=None):
    """``(out, lse, m, l)`` of a state, ``out`` ``(rows, Dv)``."""
    out = np.full((sm.rows, sm.Dv), np.nan)
    lse, m, l = sm.finish(out, None if sinks is None else np.asarray(sinks, dtype=np.float64))
    return out, lse, m.copy(), l.copy()


def piece(rows):
    """Scores ``(rows, keys)`` as a fresh float64 array (the steps overwrite it)."""
    return np.array(rows, dtype=np.float64)


def vals(*keys_rows):
    """Values of one key head: ``(1, keys, Dv)``."""
    return np.array(keys_rows, dtype=np.float64)[None]


def test_the_lazy_bounds_are_the_margin():
    assert LAZY_BOUND == pytest.approx(math.exp(LAZY_MARGIN), rel=1e-15)
    assert LAZY_FLOOR == pytest.approx(math.exp(-LAZY_MARGIN), rel=1e-15)
    assert LAZY_FLOOR * LAZY_BOUND == pytest.approx(1.0, rel=1e-15)


def test_workspace_views_the_scores_at_any_smaller_shape():
    space = Workspace(rows=3, keys=5, Dv=2, dtype=F64)
    view = space.scores_view((2, 1, 4))
    assert view.shape == (2, 1, 4) and np.shares_memory(view, space.scores)
    assert space.ones.shape == (5,) and np.all(space.ones == 1)
    assert np.all(space.top == 0)


def test_start_at_zero_then_lazy_steps_natural_units():
    # Row 0: scores [0, ln 2] then [ln 5]: terms 1, 2, 5;   l = 8, acc = 1*1 + 2*4 + 5*2 = 19.
    # Row 1: scores [ln 3, 0] then [0]:    terms 3, 1, 1;   l = 5, acc = 3*1 + 1*4 + 1*2 = 9.
    sm = softmax_state(2, 2, 1)
    assert sm.all_started and not sm.moved
    assert sm.lazy_step(piece([[0, LN2], [LN3, 0]]), vals([1], [4]))
    np.testing.assert_allclose(sm.l, [3, 4], **TIGHT)
    np.testing.assert_allclose(sm.acc, [[9], [7]], **TIGHT)
    assert sm.lazy_step(piece([[LN5], [0]]), vals([2]))
    np.testing.assert_array_equal(sm.m, [0, 0])  # the lazy step never moves the shift
    assert not sm.moved
    np.testing.assert_allclose(sm.l, [8, 5], **TIGHT)
    np.testing.assert_allclose(sm.acc, [[19], [9]], **TIGHT)
    out, lse, m, l = finished(sm)
    np.testing.assert_allclose(out, [[19 / 8], [9 / 5]], **TIGHT)
    np.testing.assert_allclose(lse, [math.log(8), math.log(5)], **TIGHT)
    np.testing.assert_array_equal(m, [0, 0])


def test_start_at_zero_then_lazy_steps_base_2_is_exact():
    # Scores in units of ln 2, so the terms are powers of two and every sum is exact.
    # Row 0: [0, 1] then [2]:  terms 1, 2, 4;    l = 7,   acc = 1*1 + 2*4 + 4*2 = 17.
    # Row 1: [2, 0] then [-1]: terms 4, 1, 1/2;  l = 5.5, acc = 4*1 + 1*4 + 0.5*2 = 9.
    sm = softmax_state(2, 2, 1, base2=True)
    assert sm.lazy_step(piece([[0, 1], [2, 0]]), vals([1], [4]))
    assert sm.lazy_step(piece([[2], [-1]]), vals([2]))
    np.testing.assert_array_equal(sm.l, [7, 5.5])
    np.testing.assert_array_equal(sm.acc, [[17], [9]])
    out, lse, m, _ = finished(sm)
    np.testing.assert_allclose(out, [[17 / 7], [9 / 5.5]], **TIGHT)
    np.testing.assert_allclose(lse, [math.log(7), math.log(5.5)], **TIGHT)  # natural units
    np.testing.assert_array_equal(m, [0, 0])


def test_steps_on_a_run_of_rows_of_each_group_base_2():
    # Two groups (folded heads) of 3 rows each, scores in base 2 (sums exact), values of the
    # two key heads in turn: rows 0-2 take key head 0's values, rows 3-5 key head 1's.
    # Piece 1, every row, one key: scores 0 (term 1), values 1 and 10.
    # Piece 2, the run 1:3 (rows 1, 2 and 4, 5), one key: scores 1 and 2 (terms 2 and 4).
    # Piece 3, the run 2:3 (rows 2 and 5), exact: scores 3 and 5, each row's new maximum.
    sm = softmax_state(6, 2, 1, base2=True, groups=2)
    assert sm.lazy_step(np.zeros((2, 1, 3, 1)), np.array([[[1.0]], [[10.0]]]))
    p = np.array([[1.0], [2.0], [1.0], [2.0]]).reshape(2, 1, 2, 1)  # (n, G, r, keys)
    assert sm.lazy_step(p, np.array([[[3.0]], [[30.0]]]), run=slice(1, 3))
    np.testing.assert_array_equal(sm.l, [1, 3, 5, 1, 3, 5])
    np.testing.assert_array_equal(sm.acc[:, 0], [1, 7, 13, 10, 70, 130])
    assert sm.started_in(slice(2, 3)) and sm.started_in()
    sm.exact_step(
        np.array([3.0, 5.0]).reshape(2, 1, 1, 1), np.array([[[2.0]], [[20.0]]]), run=slice(2, 3)
    )
    # Rows 2 and 5: shift 0 -> 3 and 0 -> 5; old sums times 2^-3 and 2^-5, plus 1.
    np.testing.assert_array_equal(sm.m, [0, 0, 3, 0, 0, 5])
    np.testing.assert_array_equal(sm.l, [1, 3, 5 / 8 + 1, 1, 3, 5 / 32 + 1])
    np.testing.assert_array_equal(sm.acc[:, 0], [1, 7, 13 / 8 + 2, 10, 70, 130 / 32 + 20])
    out, lse, m, _ = finished(sm)
    np.testing.assert_allclose(
        out[:, 0], [1, 7 / 3, 3.625 / 1.625, 10, 70 / 3, 24.0625 / 1.15625], **TIGHT
    )
    np.testing.assert_allclose(lse, np.log([1, 3, 13, 1, 3, 37]), **TIGHT)  # m ln 2 + ln l


def test_a_masked_run_drops_its_terms_by_bools_or_by_weights():
    # One group of 3 rows, the run 1:3 with its first row (row 1) masked on key 1: by a bool
    # mask (True = disallowed) or by weights (0 = disallowed); the same sums either way, and
    # a NaN under a weight 0 stays NaN and fails the bound (the exact step then drops it).
    for mask in (np.array([[False, True]]), np.array([[1.0, 0.0]])):
        sm = softmax_state(3, 2, 1)
        p = np.array([[0.0, LN2], [LN3, 0.0]])  # rows 1 and 2 of the run
        assert sm.lazy_step(p, vals([1], [4]), mask, run=slice(1, 3), masked=slice(0, 1))
        np.testing.assert_allclose(sm.l, [0, 1, 4], **TIGHT)
        np.testing.assert_allclose(sm.acc[:, 0], [0, 1, 7], **TIGHT)
    sm = softmax_state(3, 2, 1)
    p = np.array([[0.0, np.nan], [0.0, 0.0]])
    weights = np.array([[1.0, 0.0]])
    assert not sm.lazy_step(p, vals([1], [4]), weights, run=slice(1, 3), masked=slice(0, 1))
    np.testing.assert_array_equal(sm.l, [0, 0, 0])  # nothing added
    sm = softmax_state(3, 2, 1)
    p = np.array([[0.0, np.nan], [0.0, 0.0]])
    bools = np.array([[False, True]])
    assert sm.lazy_step(p, vals([1], [4]), bools, run=slice(1, 3), masked=slice(0, 1))
    np.testing.assert_allclose(sm.l, [0, 1, 2], **TIGHT)


@pytest.mark.parametrize(
    "bad_row",
    [
        [LAZY_MARGIN + 0.5, 0, 0],  # one score beyond the margin above the shift 0
        [LAZY_MARGIN - 0.5] * 3,  # each within it, but 3 e^19.5 > e^20: the row sum proves nothing
        [0, np.nan, 0],  # NaN fails the bound too
    ],
    ids=["one-score", "row-sum", "nan"],
)
def test_a_lazy_step_that_breaks_the_bound_changes_nothing(bad_row):
    sm = softmax_state(2, 3, 1)
    assert sm.lazy_step(piece([[0, LN2, 0], [0, 0, 0]]), vals([1], [4], [0]))
    before = snapshot(sm)
    assert sm.lazy_step(piece([bad_row, [1, 1, 1]]), vals([2], [2], [2])) is False
    for was, now in zip(before, snapshot(sm), strict=True):
        np.testing.assert_array_equal(now, was)
    assert not sm.moved and sm.all_started


def test_a_redone_piece_is_added_by_the_exact_step_then_lazy_steps_resume():
    # Piece 1 (lazy at 0): row 0 [0, ln 2] (terms 1, 2), row 1 [0, 0] (terms 1, 1); v = 1, 4.
    # Piece 2, row 0 [20.5], breaks the bound: redone by the exact step, m = [20.5, 1].
    # Piece 3 (lazy at the new shifts): row 0 [20.5 + ln 2], row 1 [1]; v = 3.
    margin = LAZY_MARGIN + 0.5
    sm = softmax_state(2, 2, 1)
    assert sm.lazy_step(piece([[0, LN2], [0, 0]]), vals([1], [4]))
    raw = piece([[margin], [1]])
    assert not sm.lazy_step(raw.copy(), vals([2]))
    sm.exact_step(raw, vals([2]))
    np.testing.assert_allclose(sm.m, [margin, 1], **TIGHT)
    a0, a1 = math.exp(-margin), math.exp(-1)  # alpha = exp(m_old - m_new), m_old = 0
    np.testing.assert_allclose(sm.l, [3 * a0 + 1, 2 * a1 + 1], **TIGHT)
    np.testing.assert_allclose(sm.acc, [[9 * a0 + 2], [5 * a1 + 2]], **TIGHT)
    assert sm.moved
    scores = piece([[margin + LN2], [1]])
    sm.subtract_shift(scores)  # the face's p = s - m
    np.testing.assert_allclose(scores, [[LN2], [0]], atol=1e-14)
    assert sm.lazy_step(scores, vals([3]))
    l = np.array([3 * a0 + 1 + 2, 2 * a1 + 1 + 1])
    acc = np.array([9 * a0 + 2 + 6, 5 * a1 + 2 + 3])
    out, lse, m, _ = finished(sm)
    np.testing.assert_allclose(out[:, 0], acc / l, **TIGHT)
    # lse by hand from every term: row 0 saw 1, 2, e^20.5, 2 e^20.5; row 1 saw 1, 1, e, e.
    want = [math.log(3 + 3 * math.exp(margin)), math.log(2 + 2 * math.e)]
    np.testing.assert_allclose(lse, want, rtol=1e-14)
    np.testing.assert_allclose(m, [margin, 1], **TIGHT)


@pytest.mark.parametrize("base2", [False, True])
def test_exact_step_starts_rows_at_their_first_score_and_rescales(base2):
    # Not at zero. Piece 1: row 0 all -inf (stays unstarted), row 1 [1, 3] starts at m = 3.
    # Piece 2: row 0 [2] starts at 2 with l = 1; row 1 [5]: alpha = exp(3 - 5).
    def exp(x):  # the base's exponential, by hand
        return 2.0**x if base2 else math.exp(x)

    sm = softmax_state(2, 2, 1, base2=base2, at_zero=False)
    assert not sm.all_started
    sm.exact_step(piece([[-np.inf, -np.inf], [1, 3]]), vals([1], [4]), masked=True)
    np.testing.assert_array_equal(sm.started, [False, True])
    assert not sm.all_started
    np.testing.assert_array_equal(sm.l[0], 0)
    np.testing.assert_array_equal(sm.acc[0], [0])
    np.testing.assert_array_equal(sm.m[1], 3)
    l1 = float(exp(1 - 3)) + 1
    np.testing.assert_allclose(sm.l[1], l1, **TIGHT)
    np.testing.assert_allclose(sm.acc[1], [float(exp(1 - 3)) * 1 + 4], **TIGHT)
    sm.exact_step(piece([[2], [5]]), vals([2]), masked=False)
    assert sm.all_started
    np.testing.assert_array_equal(sm.m, [2, 5])
    alpha = float(exp(3 - 5))
    np.testing.assert_allclose(sm.l, [1, l1 * alpha + 1], **TIGHT)
    acc1 = (float(exp(1 - 3)) + 4) * alpha + 2
    np.testing.assert_allclose(sm.acc, [[2], [acc1]], **TIGHT)
    out, lse, m, _ = finished(sm)
    np.testing.assert_allclose(out, [[2], [acc1 / (l1 * alpha + 1)]], **TIGHT)
    unit = LN2 if base2 else 1.0  # a score s means s * unit in natural units
    want = [2 * unit, math.log(float(exp(1) + exp(3) + exp(5)))]
    np.testing.assert_allclose(lse, want, rtol=1e-15)
    np.testing.assert_allclose(m, [2 * unit, 5 * unit], **TIGHT)


def test_base_2_masked_exact_step_agrees_with_exp2():
    # masked=True takes exp(x ln 2) rather than exp2(x): the same terms to rounding.
    results = []
    for masked in (False, True):
        sm = softmax_state(2, 3, 1, base2=True, at_zero=False)
        sm.exact_step(piece([[0.3, -1.7, 2.25], [-4.5, 0.5, 1]]), vals([1], [2], [3]), masked)
        results.append(finished(sm))
    for a, b in zip(*results, strict=True):
        np.testing.assert_allclose(a, b, rtol=4e-16)


def test_a_row_that_meets_no_score_finishes_empty():
    sm = softmax_state(2, 2, 2, at_zero=False)
    sm.exact_step(piece([[-np.inf, -np.inf], [0, LN3]]), vals([1, 2], [5, 6]), masked=True)
    out, lse, _, l = finished(sm)
    np.testing.assert_array_equal(out[0], [0, 0])
    assert lse[0] == -np.inf and l[0] == 0
    np.testing.assert_allclose(out[1], [(1 + 15) / 4, (2 + 18) / 4], **TIGHT)
    np.testing.assert_allclose(lse[1], math.log(4), **TIGHT)


def test_a_nan_score_fails_the_lazy_step_and_the_exact_step_keeps_it():
    sm = softmax_state(2, 2, 1)
    raw = piece([[0, np.nan], [0, LN2]])
    assert not sm.lazy_step(raw.copy(), vals([1], [1]))
    sm.exact_step(raw, vals([1], [1]))
    out, lse, _, l = finished(sm)
    assert np.isnan(l[0]) and np.isnan(lse[0]) and np.isnan(out[0, 0])  # NaN is not empty
    np.testing.assert_allclose([out[1, 0], lse[1]], [1, math.log(3)], **TIGHT)


def test_disallowed_terms_are_zeroed_even_when_inf_or_nan():
    # Row 0: [0, +inf (dropped), ln 2] -> l = 3, acc = 1*1 + 2*4 = 9.
    # Row 1: [NaN (dropped), ln 3, 0]  -> l = 4, acc = 3*7 + 1*4 = 25.
    sm = softmax_state(2, 3, 1)
    scores = piece([[0, np.inf, LN2], [np.nan, LN3, 0]])
    disallowed = np.array([[False, True, False], [True, False, False]])
    assert sm.lazy_step(scores, vals([1], [7], [4]), disallowed)
    np.testing.assert_allclose(sm.l, [3, 4], **TIGHT)
    np.testing.assert_allclose(sm.acc, [[9], [25]], **TIGHT)


@pytest.mark.parametrize("step", ["lazy", "exact"])
def test_two_key_heads_each_against_its_own_values(step):
    # Rows 0-1 read key head 0's values, rows 2-3 key head 1's; rows 0 and 2 have scores
    # [0, ln 2] (weights 1/3, 2/3), rows 1 and 3 [ln 3, 0] (weights 3/4, 1/4).
    values = np.array([[[1, 0], [0, 1]], [[2, 3], [5, 7]]], dtype=np.float64)  # (n, keys, Dv)
    sm = softmax_state(4, 2, 2)
    scores = piece([[0, LN2], [LN3, 0]] * 2)
    if step == "lazy":
        assert sm.lazy_step(scores, values)
    else:
        sm.exact_step(scores, values)
    out, lse, _, _ = finished(sm)
    want = [[1 / 3, 2 / 3], [3 / 4, 1 / 4], [12 / 3, 17 / 3], [11 / 4, 16 / 4]]
    np.testing.assert_allclose(out, want, rtol=1e-15)
    np.testing.assert_allclose(lse, np.log([3, 4, 3, 4]), rtol=1e-15)


def test_finish_writes_any_shape_holding_the_rows_in_order():
    sm = softmax_state(4, 2, 1, base2=True)
    assert sm.lazy_step(piece([[0, 1], [1, 1], [0, 0], [2, 0]]), vals([2], [4]))
    out = np.zeros((2, 2, 1))  # (G, bq, Dv)
    lse, _, _ = sm.finish(out)
    np.testing.assert_allclose(out.reshape(4), [10 / 3, 3, 3, 12 / 5], **TIGHT)
    np.testing.assert_allclose(lse, np.log([3, 4, 2, 5]), **TIGHT)


def test_finish_converts_a_base_2_shift_to_natural_units():
    # Scores [3, 1] in units of ln 2: m = 3, l = 1 + 2^-2; lse = 3 ln 2 + ln 1.25 = ln 10.
    sm = softmax_state(1, 2, 1, base2=True, at_zero=False)
    sm.exact_step(piece([[3, 1]]), vals([1], [1]))
    np.testing.assert_array_equal(sm.m, [3])
    np.testing.assert_array_equal(sm.l, [1.25])
    _, lse, m, l = finished(sm)
    np.testing.assert_allclose(m, [3 * LN2], **TIGHT)
    np.testing.assert_array_equal(l, [1.25])
    np.testing.assert_allclose(lse, [math.log(10)], **TIGHT)


@pytest.mark.parametrize("base2", [False, True])
def test_a_sink_joins_the_normaliser(base2):
    # Row 0: keys with l = 3 at m = 0 (acc = 9) and a sink ln 5: lse = ln(3 + 5) = ln 8.
    # Row 1: the same keys, a sink 30 far above the lazy shift: lse = ln(3 + e^30).
    sm = softmax_state(2, 2, 1, base2=base2)
    first = [0, 1] if base2 else [0, LN2]
    assert sm.lazy_step(piece([first, first]), vals([1], [4]))
    out, lse, m, l = finished(sm, [LN5, 30.0])
    np.testing.assert_allclose(lse, [math.log(8), math.log(3 + math.exp(30))], rtol=1e-15)
    np.testing.assert_allclose(out[:, 0], [9 / 8, 9 / (3 + math.exp(30))], rtol=1e-15)
    np.testing.assert_allclose(m, [LN5, 30], **TIGHT)  # the sink is above the keys' shift 0
    np.testing.assert_allclose(l, [3 / 5 + 1, 3 * math.exp(-30) + 1], rtol=1e-15)


def test_a_sink_of_minus_inf_leaves_the_row_bit_for_bit():
    sm = softmax_state(2, 3, 2, at_zero=False)
    sm.exact_step(piece([[0.25, -1.5, 3.0], [-2.0, 0.7, 0.1]]), vals([1, 2], [3, -4], [0.5, 6]))
    plain = finished(sm)
    sunk = finished(sm, [-np.inf, -np.inf])
    for a, b in zip(plain, sunk, strict=True):
        np.testing.assert_array_equal(b, a)


def test_a_sink_on_an_empty_row():
    # Row 0 met no key: with the sink 1.5 its lse is 1.5 exactly (l = 1), out 0.
    # Row 1 met no key and its sink is -inf: it stays empty.
    sm = softmax_state(2, 2, 1, at_zero=False)
    sm.exact_step(piece([[-np.inf, -np.inf]] * 2), vals([1], [2]), masked=True)
    out, lse, m, l = finished(sm, [1.5, -np.inf])
    np.testing.assert_array_equal(out, [[0], [0]])
    np.testing.assert_array_equal(lse, [1.5, -np.inf])
    np.testing.assert_array_equal(l, [1, 0])
    assert m[0] == 1.5


def test_add_sinks_by_hand():
    # m = [0, 2], l = [3, 0.5] and sinks [ln 5, -1]: row 0 moves to ln 5 (alpha 1/5,
    # l = 3/5 + 1); row 1 keeps m = 2 (alpha 1, l = 0.5 + e^-3).
    m, l, alpha = add_sinks(np.array([0.0, 2.0]), np.array([3.0, 0.5]), np.array([LN5, -1.0]))
    np.testing.assert_allclose(m, [LN5, 2], **TIGHT)
    np.testing.assert_allclose(alpha, [1 / 5, 1], **TIGHT)
    np.testing.assert_allclose(l, [3 / 5 + 1, 0.5 + math.exp(-3)], **TIGHT)


def test_sums_hold_at_the_floor():
    # At zero, scores all more than LAZY_MARGIN below 0: l = e^-(margin + 1) < LAZY_FLOOR.
    low = -(LAZY_MARGIN + 1)
    sm = softmax_state(4, 1, 1)
    assert sm.lazy_step(piece([[0], [low], [LN2], [0]]), vals([1]))
    assert not sm.sums_hold()
    # One group of 4 rows: rows 2 and 3 hold, rows 0 and 1 include the failing one.
    assert sm.sums_hold(slice(2, 4)) and not sm.sums_hold(slice(0, 2))
    # Two groups (folded heads) of 2 rows: the run slice(0, 1) reads rows 0 and 2 (both
    # hold), slice(1, 2) rows 1 and 3 (row 1 fails).
    sm = softmax_state(4, 1, 1, groups=2)
    assert sm.lazy_step(piece([[0], [low], [LN2], [0]]), vals([1]))
    assert sm.sums_hold(slice(0, 1))
    assert not sm.sums_hold(slice(1, 2))
    assert sm.sums_hold(slice(1, 1))  # no row to check


def test_sums_hold_fails_on_nan():
    sm = softmax_state(2, 1, 1, at_zero=False)
    sm.exact_step(piece([[np.nan], [0]]), vals([1]))
    assert not sm.sums_hold()
    assert sm.sums_hold(slice(1, 2))


def test_sums_hold_exactly_at_the_floor():
    sm = softmax_state(1, 1, 1)
    assert sm.lazy_step(piece([[-LAZY_MARGIN]]), vals([1]))
    # exp(-20) rounded is LAZY_FLOOR (both are np.exp(-20.0)): the floor itself holds.
    assert sm.l[0] == LAZY_FLOOR and sm.sums_hold()


# ---------------------------------------------------------------- random pieces, any steps


def reference(scores, allowed, values, n, base2):
    """``(out, lse)`` of each row over all its allowed keys: a float64 softmax, row by row."""
    rows, Dv = scores.shape[0], values.shape[-1]
    per_head = rows // n
    out, lse = np.zeros((rows, Dv)), np.full(rows, -np.inf)
    for i in range(rows):
        s = scores[i][allowed[i]] * (LN2 if base2 else 1.0)  # natural units
        if s.size == 0:
            continue
        top = s.max()
        w = np.exp(s - top)
        out[i] = w @ values[i // per_head][allowed[i]] / w.sum()
        lse[i] = top + math.log(w.sum())
    return out, lse


def walk(pieces, n, Dv, base2, at_zero, lazy_wanted):
    """The faces' protocol over ``pieces`` [(scores, allowed, values)]: the lazy step when every
    row has a shift and it is wanted, else (or if it fails) the exact step on -inf-masked
    scores. Returns the state, or None when a unit started at zero must be redone."""
    rows = pieces[0][0].shape[0]
    keys = max(p[0].shape[1] for p in pieces)
    sm = softmax_state(rows, keys, Dv, base2=base2, at_zero=at_zero)
    for i, ((scores, allowed, values), lazy) in enumerate(zip(pieces, lazy_wanted, strict=True)):
        if lazy and sm.all_started:
            p = scores.copy()  # the disallowed scores stay as they are: the mask zeroes them
            if sm.moved:
                sm.subtract_shift(p)
            if sm.lazy_step(p, values, ~allowed):
                if at_zero and i == 0 and not sm.sums_hold(np.any(allowed, axis=1)):
                    return None
                continue
        s = np.where(allowed, scores, -np.inf)
        sm.exact_step(s, values, masked=True)
        if at_zero and i == 0 and not sm.sums_hold(np.any(allowed, axis=1)):
            return None
    return sm if not at_zero or sm.sums_hold() else None


@st.composite
def unit_pieces(draw):
    rows = draw(st.integers(2, 4))
    n = draw(st.sampled_from([1, 2] if rows % 2 == 0 else [1]))
    Dv = draw(st.integers(1, 2))
    count = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    pieces = []
    for _ in range(count):
        keys = int(rng.integers(1, 6))
        scores = rng.uniform(-30, 30, size=(rows, keys))
        allowed = rng.random((rows, keys)) < draw(st.sampled_from([0.0, 0.5, 0.8, 1.0]))
        values = rng.standard_normal((n, keys, Dv))
        pieces.append((scores, allowed, values))
    lazy = draw(st.lists(st.booleans(), min_size=count, max_size=count))
    return pieces, n, Dv, lazy


@settings(max_examples=150, deadline=None)
@given(case=unit_pieces(), base2=st.booleans(), at_zero=st.booleans())
def test_random_pieces_in_any_mix_of_steps_match_a_float64_softmax(case, base2, at_zero):
    pieces, n, Dv, lazy = case
    sm = walk(pieces, n, Dv, base2, at_zero, lazy)
    if sm is None:  # the shift 0 did not hold: the unit is walked again without it
        sm = walk(pieces, n, Dv, base2, False, lazy)
    out, lse, _, _ = finished(sm)
    scores = np.concatenate([p[0] for p in pieces], axis=1)
    allowed = np.concatenate([p[1] for p in pieces], axis=1)
    values = np.concatenate([p[2] for p in pieces], axis=1)
    want_out, want_lse = reference(scores, allowed, values, n, base2)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=0)


# -- the scratch pool -----------------------------------------------------------------------


def test_the_pool_hands_out_the_smallest_kept_buffer_that_fits_of_the_dtype():
    pool = ScratchPool(max_bytes=1 << 20)
    first = pool.take(100, np.float32)  # nothing kept yet: a new array
    assert first.shape == (100,) and first.dtype == np.float32 and first.base is None
    small, large = np.empty(50, np.float32), np.empty(400, np.float32)
    for buffer in (first, small, large):
        pool.give(buffer)
    view = pool.take(80, np.float32)  # 100 is the smallest of 50, 100, 400 that holds 80
    assert view.shape == (80,) and view.base is first
    assert pool.take(90, np.float64).base is None  # float32 buffers do not serve float64
    assert pool.take(120, np.float32).base is large
    assert pool.take(120, np.float32).base is None  # none left that fits
    pool.give(view)  # a view goes back as its whole buffer
    assert pool.take(100, np.float32).base is first


def test_the_pool_keeps_the_largest_buffers_within_its_bytes():
    pool = ScratchPool(max_bytes=1000)
    a, b, c, huge = (np.empty(n, np.uint8) for n in (600, 300, 200, 1001))
    for buffer in (b, huge, a, c):
        pool.give(buffer)
    kept = [pool.take(1, np.uint8).base for _ in range(3)]  # smallest first
    assert kept == [b, a, None]  # 600 + 300 fit in 1000; 200 more would not; 1001 never


def test_calls_leave_their_buffers_to_the_next_whose_results_never_read_them(rng):
    # The tiled paths take their scores buffers from SCRATCH and give them back: filled with
    # NaN in between, the next calls must return the same bits.
    x = rng.standard_normal((2, 3, 300, 16)).astype(np.float32)
    mask = sdpa.create_block_mask(lambda b, h, q, k: q >= k, None, None, 300, 300)
    calls = [
        lambda: sdpa.scaled_dot_product_attention(x, x, x, is_causal=True, implementation="tiled"),
        lambda: sdpa.flex_attention(x, x, x, block_mask=mask, implementation="tiled"),
    ]
    for call in calls:
        first = call()
        assert SCRATCH._free, "the call gave its buffers back"
        for buffer in SCRATCH._free:
            buffer.view(np.uint8).fill(0xFF)  # NaN in every float dtype
        np.testing.assert_array_equal(call(), first)


def test_steps_on_the_same_run_of_each_part_base_2():
    # One group of 4 rows cut into 2 parts (squares) of 2 rows: rows 0-1 and 2-3. A piece in
    # parts adds to the same run of each part, the first part's tile with the first values,
    # the second's with the second: (parts, r, keys) @ (parts, keys, Dv).
    # Piece 1, every row of each part, one key: scores 0 and 1 (terms 1, 2), values 1 and 10.
    # Piece 2, the run 1:2 of each part (rows 1 and 3), lazy: scores 2 (term 4), values 3, 30.
    # Piece 3, the run 1:2 again, exact: scores 4 and 3, each row's new maximum.
    sm = softmax_state(4, 1, 1, base2=True)
    p = np.array([0.0, 0.0, 1.0, 1.0]).reshape(1, 2, 2, 1)  # (G, parts, r, keys)
    values = np.array([[[1.0]], [[10.0]]])[None]  # (1, parts, keys, Dv)
    assert sm.lazy_step(p, values, parts=2)
    np.testing.assert_array_equal(sm.l, [1, 1, 2, 2])
    np.testing.assert_array_equal(sm.acc[:, 0], [1, 1, 20, 20])
    p = np.full((1, 2, 1, 1), 2.0)
    assert sm.lazy_step(p, np.array([[[3.0]], [[30.0]]])[None], run=slice(1, 2), parts=2)
    np.testing.assert_array_equal(sm.l, [1, 5, 2, 6])
    np.testing.assert_array_equal(sm.acc[:, 0], [1, 13, 20, 140])
    assert sm.started_in(slice(1, 2), parts=2) and sm.sums_hold(slice(0, 1), parts=2)
    s = np.array([4.0, 3.0]).reshape(1, 2, 1, 1)
    sm.exact_step(s, np.array([[[2.0]], [[5.0]]])[None], run=slice(1, 2), parts=2)
    # Rows 1 and 3: shift 0 -> 4 and 0 -> 3; old sums times 2^-4 and 2^-3, plus 1.
    np.testing.assert_array_equal(sm.m, [0, 4, 0, 3])
    np.testing.assert_array_equal(sm.l, [1, 5 / 16 + 1, 2, 6 / 8 + 1])
    np.testing.assert_array_equal(sm.acc[:, 0], [1, 13 / 16 + 2, 20, 140 / 8 + 5])
    out, lse, _, _ = finished(sm)
    np.testing.assert_allclose(out[:, 0], [1, (13 / 16 + 2) / (21 / 16), 10, (140 / 8 + 5) / 1.75])
    np.testing.assert_allclose(lse, np.log([1, 2**4 * 21 / 16, 2, 2**3 * 1.75]), **TIGHT)


def test_acc_is_set_by_a_first_step_over_every_row_and_zeroed_before_any_other():
    # The buffers are reused from unit to unit: acc starts with another unit's garbage.
    space = Workspace(3, 2, 1, F64)
    space.acc[:] = np.nan
    sm = OnlineSoftmax(space, 3, 1, np.exp, False, True)
    assert sm.lazy_step(piece([[0], [0], [LN2]]), vals([5]))  # every row: written
    np.testing.assert_array_equal(sm.acc[:, 0], [5, 5, 10])
    space.acc[:] = np.nan
    sm = OnlineSoftmax(space, 3, 1, np.exp, False, True)
    assert sm.lazy_step(piece([[0], [LN2]]), vals([5]), run=slice(1, 3))  # rows 1 and 2 only
    np.testing.assert_array_equal(sm.acc[:, 0], [0, 5, 10])
    space.acc[:] = np.nan
    sm = OnlineSoftmax(space, 3, 1, np.exp, False, False)
    sm.exact_step(piece([[1], [2]]), vals([3]), run=slice(0, 2))  # an exact step first
    np.testing.assert_array_equal(sm.acc[:, 0], [3, 3, 0])
    space.acc[:] = np.nan
    out, lse, _, _ = finished(OnlineSoftmax(space, 3, 1, np.exp, False, False))  # no step
    np.testing.assert_array_equal(out, 0)
    np.testing.assert_array_equal(lse, -np.inf)
