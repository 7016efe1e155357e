"""sdpa.problem: ``prepare_attention`` normalises a call into an ``AttentionProblem``, the start of
every path. Checked against definitions written here:

* the causal and window band (``band_mask``, whole and in pieces) against the band from its
  definition, query ``i`` at key position ``i + o`` (``o = 0`` top-left, ``S - T`` bottom-right)
  allowed keys ``j`` with ``i + o - left <= j <= i + o + right``;
* the grouped layout of grouped-query attention: query head ``h`` meets key head ``h // G``, and
  ``finish`` merges the groups back into the caller's heads and dtype;
* the working dtype (float32 for float16, float64 for integers), the default scale
  ``1 / sqrt(Dk)``, rows holding NaN or inf replaced by zeros and flagged, inputs left as given,
  and ``may_overflow`` on inputs whose scores do and cannot overflow.

The errors of every argument are those of ``scaled_dot_product_attention``, in test_attention.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from sdpa.problem import prepare_attention

T, S, DK, DV = 5, 7, 4, 3


def band_by_definition(T, S, offset, left, right):
    """``(T, S)`` bool: key ``j`` allowed for query ``i`` inside the band around ``i + offset``."""
    allowed = np.zeros((T, S), dtype=bool)
    for i in range(T):
        for j in range(S):
            centre = i + offset
            allowed[i, j] = (left is None or j >= centre - left) and (
                right is None or j <= centre + right
            )
    return allowed


CALLS = [
    # (is_causal, causal_alignment, window) -> (offset, left, right)
    ((True, "top_left", None), (0, None, 0)),
    ((True, "bottom_right", None), (S - T, None, 0)),
    ((False, "top_left", (2, 1)), (0, 2, 1)),
    ((False, "bottom_right", (1, None)), (S - T, 1, None)),
    ((True, "top_left", (3, 4)), (0, 3, 0)),  # causal caps the window's right side at 0
    ((False, "top_left", (None, 0)), (0, None, 0)),
]


@pytest.mark.parametrize("call, band", CALLS, ids=[str(c) for c, _ in CALLS])
def test_the_band_is_the_band_of_its_definition(rng, call, band):
    is_causal, alignment, window = call
    q, k, v = (
        rng.standard_normal((T, DK)),
        rng.standard_normal((S, DK)),
        rng.standard_normal((S, DV)),
    )
    problem = prepare_attention(
        q, k, v, is_causal=is_causal, causal_alignment=alignment, window=window
    )
    want = band_by_definition(T, S, *band)
    np.testing.assert_array_equal(problem.band_mask(), want)
    # In pieces, as a tiled path asks for it: the same band, cut.
    np.testing.assert_array_equal(problem.band_mask(1, 4, 2, 6), want[1:4, 2:6])


def test_no_band_without_causal_or_window(rng):
    q, k, v = (
        rng.standard_normal((T, DK)),
        rng.standard_normal((S, DK)),
        rng.standard_normal((S, DV)),
    )
    assert prepare_attention(q, k, v).band_mask() is None


def test_grouped_heads_meet_their_key_head_and_finish_merges_them(rng):
    B, HQ, HKV = 2, 6, 2
    G = HQ // HKV
    q = rng.standard_normal((B, HQ, T, DK)).astype(np.float32)
    k = rng.standard_normal((B, HKV, S, DK)).astype(np.float32)
    v = rng.standard_normal((B, HKV, S, DV)).astype(np.float32)
    problem = prepare_attention(q, k, v, enable_gqa=True)
    assert problem.groups == G
    assert problem.query.shape == (B, HKV, G, T, DK)
    assert problem.key.shape == (B, HKV, 1, S, DK) and problem.value.shape == (B, HKV, 1, S, DV)
    for h in range(HQ):
        np.testing.assert_array_equal(problem.query[:, h // G, h % G], q[:, h])
        np.testing.assert_array_equal(problem.key[:, h // G, 0], k[:, h // G])
    # Per-head results in the grouped layout come back as (B, Hq, T, Dv), head h in place h.
    grouped = np.broadcast_to(
        np.arange(HKV * G, dtype=np.float32).reshape(HKV, G, 1, 1), (B, HKV, G, T, DV)
    )
    out = problem.finish(grouped)
    assert out.shape == (B, HQ, T, DV) and out.dtype == np.float32
    np.testing.assert_array_equal(out[:, :, 0, 0], np.broadcast_to(np.arange(HQ), (B, HQ)))


@pytest.mark.parametrize(
    "dtype, work",
    [
        (np.float16, np.float32),
        (np.float32, np.float32),
        (np.float64, np.float64),
        (np.int64, np.float64),
    ],
)
def test_the_working_dtype_and_the_default_scale(dtype, work):
    q, k, v = np.ones((T, DK), dtype), np.ones((S, DK), dtype), np.ones((S, DV), dtype)
    problem = prepare_attention(q, k, v)
    assert problem.work_dtype == work and problem.query.dtype == work
    assert problem.out_dtype == (np.float64 if dtype == np.int64 else dtype)
    assert problem.scale == pytest.approx(1 / math.sqrt(DK), rel=1e-15)
    assert (problem.T, problem.S, problem.Dk, problem.Dv) == (T, S, DK, DV)
    assert prepare_attention(q, k, v, scale=0.25).scale == 0.25


def test_non_finite_rows_are_zeroed_and_flagged_and_the_inputs_left_alone(rng):
    q, k, v = (
        rng.standard_normal((T, DK)),
        rng.standard_normal((S, DK)),
        rng.standard_normal((S, DV)),
    )
    q[1, 2], k[4, 0], v[6, 1] = np.nan, np.inf, -np.inf
    before = [a.copy() for a in (q, k, v)]
    problem = prepare_attention(q, k, v)
    for given, kept in zip((q, k, v), before):
        np.testing.assert_array_equal(given, kept)  # NaN compares equal to NaN here
    for array, flags, row in (
        (problem.query, problem.bad_query, 1),
        (problem.key, problem.bad_key, 4),
        (problem.value, problem.bad_value, 6),
    ):
        want = np.zeros(array.shape[-2], dtype=bool)
        want[row] = True
        np.testing.assert_array_equal(flags, want)
        np.testing.assert_array_equal(array[row], 0.0)
    np.testing.assert_array_equal(problem.query[0], q[0])  # finite rows unchanged


def test_may_overflow_only_where_a_score_can(rng):
    q, k, v = (
        rng.standard_normal((T, DK)),
        rng.standard_normal((S, DK)),
        rng.standard_normal((S, DV)),
    )
    small = [a.astype(np.float32) for a in (q, k, v)]
    assert not prepare_attention(*small).may_overflow
    # Scores of about 1e20 * 1e20 = 1e40 exceed float32's largest, 3.4e38.
    large = [(1e20 * a).astype(np.float32) for a in (q, k)] + [small[2]]
    scores = np.abs(q.astype(np.float64) * 1e20 @ (k.astype(np.float64) * 1e20).T)
    assert scores.max() > np.finfo(np.float32).max
    assert prepare_attention(*large).may_overflow
