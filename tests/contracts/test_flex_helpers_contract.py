"""Acceptance tests for part 5 of the 2026 API contract (``../shared/api-2026.md``), written from
the contract alone: ``noop_mask``, ``and_masks``, ``or_masks``, ``create_mask``, ``AuxRequest``,
``AuxOutput`` and ``flex_attention(..., return_aux=...)``.

Black-box, public API only. Every expected value comes from an explicit formula written here
(boolean matrices built index by index, scores and a log-sum-exp in float64 loops), never from
the code under test. ``tests/sdpa/test_flex_helpers.py`` holds the package's own, finer tests.
"""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest

import sdpa
from sdpa import (
    AuxOutput,
    AuxRequest,
    and_masks,
    create_block_mask,
    create_mask,
    flex_attention,
    noop_mask,
    or_masks,
)

IMPLEMENTATIONS = ["reference", "tiled", "auto"]
NAMES = ["noop_mask", "and_masks", "or_masks", "create_mask", "AuxRequest", "AuxOutput"]


def _rand(rng, *shape, dtype=np.float64):
    return rng.standard_normal(shape).astype(dtype)


def _row_stats(q, k, allowed, score_fn=None):
    """``(lse, max)`` ``(B, H, T)`` by hand: scaled scores, modified, the allowed ones kept."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    B, H, T, D = q.shape
    S = k.shape[2]
    lse, top = np.full((B, H, T), -np.inf), np.full((B, H, T), -np.inf)
    for b, h, i in np.ndindex(B, H, T):
        zs = []
        for j in range(S):
            z = sum(q[b, h, i, d] * k[b, h, j, d] for d in range(D)) / math.sqrt(D)
            if score_fn is not None:
                z = score_fn(z, b, h, i, j)
            if allowed(b, h, i, j) and z != -math.inf:
                zs.append(z)
        if zs:
            top[b, h, i] = max(zs)
            lse[b, h, i] = math.log(math.fsum(math.exp(z) for z in zs))
    return lse, top


def test_names_are_public():
    for name in NAMES:
        assert name in sdpa.__all__
        assert getattr(sdpa, name) is not None


def test_noop_mask_is_all_true_in_the_broadcast_shape():
    b = np.arange(2).reshape(2, 1, 1, 1)
    h = np.arange(3).reshape(1, 3, 1, 1)
    i = np.arange(4).reshape(1, 1, 4, 1)
    j = np.arange(5).reshape(1, 1, 1, 5)
    result = np.asarray(noop_mask(b, h, i, j))
    assert result.dtype == bool and result.shape == (2, 3, 4, 5) and result.all()


def test_and_or_masks_are_entrywise():
    def lower(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def odd_head_or_first(b, h, q_idx, kv_idx):
        return (h % 2 == 1) | (kv_idx == 0)

    B, H, T, S = 2, 3, 4, 5
    expected_and = np.zeros((B, H, T, S), bool)
    expected_or = np.zeros((B, H, T, S), bool)
    for b, h, i, j in np.ndindex(B, H, T, S):
        x, y = i >= j, h % 2 == 1 or j == 0
        expected_and[b, h, i, j] = x and y
        expected_or[b, h, i, j] = x or y
    got_and = create_mask(and_masks(lower, odd_head_or_first), B, H, T, S)
    got_or = create_mask(or_masks(lower, odd_head_or_first), B, H, T, S)
    np.testing.assert_array_equal(got_and, expected_and)
    np.testing.assert_array_equal(got_or, expected_or)


def test_and_or_masks_of_nothing():
    assert create_mask(and_masks(), 1, 2, 3, 4).all()
    assert not create_mask(or_masks(), 1, 2, 3, 4).any()


def test_and_or_masks_refuse_non_callables():
    with pytest.raises(TypeError):
        and_masks(lambda b, h, i, j: i >= j, None)
    with pytest.raises(TypeError):
        or_masks(1)


def test_create_mask_of_a_mask_mod_and_a_score_mod():
    got = create_mask(lambda b, h, i, j: j <= i + b, 2, None, 3, 4)
    assert got.shape == (2, 1, 3, 4) and got.dtype == bool
    for b, i, j in np.ndindex(2, 3, 4):
        assert got[b, 0, i, j] == (j <= i + b)
    # a score_mod: evaluated on zero scores, True where the result is not -inf
    got = create_mask(lambda s, b, h, i, j: np.where(j > i + h, -np.inf, s - 5.0), None, 2, 3, 4)
    assert got.shape == (1, 2, 3, 4)
    for h, i, j in np.ndindex(2, 3, 4):
        assert got[0, h, i, j] == (j <= i + h)


def test_aux_named_tuples():
    assert AuxRequest() == (False, False) and AuxRequest()._fields == ("lse", "max_scores")
    assert AuxOutput() == (None, None) and AuxOutput()._fields == ("lse", "max_scores")
    assert AuxRequest(max_scores=True).lse is False


def test_return_aux_is_keyword_only():
    parameter = inspect.signature(flex_attention).parameters["return_aux"]
    assert parameter.kind is inspect.Parameter.KEYWORD_ONLY and parameter.default is None


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_return_aux_lse_and_max_scores(rng, implementation):
    B, H, T, S = 2, 2, 20, 24
    q, k, v = _rand(rng, B, H, T, 4), _rand(rng, B, H, S, 4), _rand(rng, B, H, S, 3)

    def allowed(b, h, i, j):  # rows 16.. of batch 1 attend nothing
        return (j <= i + 2) & ((b == 0) | (i < 16))

    def score_fn(z, b, h, i, j):
        return z - 0.25 * (h + 1) * abs(i - j)

    def score_mod(score, b, h, i, j):
        return score - 0.25 * (h + 1) * abs(i - j)

    mask = create_block_mask(allowed, B, None, T, S, BLOCK_SIZE=4)
    lse, top = _row_stats(q, k, lambda b, h, i, j: bool(allowed(b, h, i, j)), score_fn)
    out, aux = flex_attention(
        q,
        k,
        v,
        score_mod,
        mask,
        implementation=implementation,
        return_aux=AuxRequest(lse=True, max_scores=True),
    )
    assert isinstance(aux, AuxOutput)
    assert out.shape == (B, H, T, 3) and aux.lse.shape == aux.max_scores.shape == (B, H, T)
    np.testing.assert_allclose(aux.max_scores, top, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(aux.lse, lse, rtol=1e-10, atol=1e-10)
    assert np.isneginf(aux.max_scores[1, :, 16:]).all() and np.isneginf(aux.lse[1, :, 16:]).all()
    # lse as with return_lse; only the fields asked for
    _, lse_alone = flex_attention(
        q, k, v, score_mod, mask, implementation=implementation, return_lse=True
    )
    np.testing.assert_allclose(aux.lse, lse_alone, rtol=1e-12, atol=0)
    _, only_max = flex_attention(
        q,
        k,
        v,
        score_mod,
        mask,
        implementation=implementation,
        return_aux=AuxRequest(max_scores=True),
    )
    assert only_max.lse is None
    np.testing.assert_allclose(only_max.max_scores, top, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_max_scores_with_minus_inf_from_score_mod(rng, implementation):
    q, k, v = _rand(rng, 1, 1, 6, 4), _rand(rng, 1, 1, 6, 4), _rand(rng, 1, 1, 6, 4)

    def score_mod(score, b, h, i, j):
        return np.where(j > i, -np.inf, score)

    lse, top = _row_stats(q, k, lambda b, h, i, j: j <= i)
    _, aux = flex_attention(
        q,
        k,
        v,
        score_mod,
        implementation=implementation,
        return_aux=AuxRequest(lse=True, max_scores=True),
    )
    np.testing.assert_allclose(aux.max_scores, top, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(aux.lse, lse, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "dtype, aux_dtype",
    [(np.float16, np.float32), (np.float32, np.float32), (np.float64, np.float64)],
)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_aux_dtypes(rng, dtype, aux_dtype, implementation):
    q, k, v = (_rand(rng, 1, 2, 5, 4, dtype=dtype) for _ in range(3))
    out, aux = flex_attention(
        q, k, v, implementation=implementation, return_aux=AuxRequest(lse=True, max_scores=True)
    )
    assert out.dtype == dtype
    assert aux.lse.dtype == aux_dtype and aux.max_scores.dtype == aux_dtype
    lse, top = _row_stats(q, k, lambda b, h, i, j: True)
    tol = 2e-3 if dtype == np.float16 else 1e-5
    np.testing.assert_allclose(aux.max_scores, top, rtol=tol, atol=tol)


def test_return_lse_with_return_aux_is_refused(rng):
    q = _rand(rng, 1, 1, 2, 2)
    with pytest.raises(ValueError):
        flex_attention(q, q, q, return_lse=True, return_aux=AuxRequest(lse=True))
