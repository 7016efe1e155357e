"""Tests of FlexAttention's helpers: noop_mask, and_masks, or_masks, create_mask, AuxRequest,
AuxOutput and ``flex_attention(..., return_aux=...)`` (issue 35, item 1).

* the masks against hand-built boolean matrices and against PyTorch's own helpers (the same
  mods, written with operators, run through both);
* ``lse`` and ``max_scores`` on every path against a float64 loop written here, with and
  without a ``score_mod`` (the tiled path's base-2 scores), over several pieces per row (the
  tiled path's running maximum is its own, not the softmax's shift), fully masked rows, GQA,
  dtypes, threads and non-finite inputs;
* PyTorch 2.13: its public ``flex_attention`` refuses ``max_scores`` on CPU, so its row maxima
  come from the eager math implementation that the public function runs on CPU
  (``torch._higher_order_ops.flex_attention.math_attention``, which returns them in base 2
  for the top level to multiply by ln 2: natural units, as here);
* one test per error message.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from references import torch_flex

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
from sdpa.flex import flex_attention_tiled

PATHS = ["reference", "tiled", "auto"]


def normal(rng, *shape, dtype=np.float64):
    return rng.standard_normal(shape).astype(dtype)


def loop_stats(q, k, v, *, score=None, allowed=None, scale=None):
    """``(lse, max)`` ``(B, Hq, T)`` in float64, one score at a time, from scalar functions
    ``score(z, b, h, i, j)`` and ``allowed(b, h, i, j)``; GQA by ``h // G``."""
    q, k = (np.asarray(x, dtype=np.float64) for x in (q, k))
    B, Hq, T, Dk = q.shape
    S, G = k.shape[2], Hq // k.shape[1]
    scale = 1 / math.sqrt(Dk) if scale is None else scale
    lse = np.full((B, Hq, T), -np.inf)
    top = np.full((B, Hq, T), -np.inf)
    for b, h, i in np.ndindex(B, Hq, T):
        kept = []
        for j in range(S):
            if allowed is not None and not allowed(b, h, i, j):
                continue
            z = math.fsum(q[b, h, i] * k[b, h // G, j]) * scale
            z = z if score is None else score(z, b, h, i, j)
            if z > -math.inf:
                kept.append(z)
        if kept:
            m = max(kept)
            top[b, h, i] = m
            lse[b, h, i] = m + math.log(math.fsum(math.exp(z - m) for z in kept))
    return lse, top


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def near(b, h, q_idx, kv_idx):
    return q_idx - kv_idx < 3


def even_key(b, h, q_idx, kv_idx):
    return kv_idx % 2 == 0


# ---------------------------------------------------------------------------------------------
# noop_mask, and_masks, or_masks, create_mask
# ---------------------------------------------------------------------------------------------


def test_noop_mask_is_true_in_the_broadcast_shape():
    b, h, i, j = np.zeros((2, 1, 1, 1), int), np.zeros((1, 3, 1, 1), int), 0, np.arange(5)
    result = noop_mask(b, h, i, j)
    assert result.dtype == np.bool_ and result.shape == (2, 3, 1, 5) and result.all()


def test_and_or_masks_against_hand_matrices():
    i, j = np.arange(6)[:, None], np.arange(6)[None, :]
    lower, band, even = i >= j, i - j < 3, np.broadcast_to(j % 2 == 0, (6, 6))
    both = create_mask(and_masks(causal, near, even_key), None, None, 6, 6)[0, 0]
    either = create_mask(or_masks(near, even_key), None, None, 6, 6)[0, 0]
    np.testing.assert_array_equal(both, lower & band & even)
    np.testing.assert_array_equal(either, band | even)


def test_and_or_masks_with_one_or_none():
    np.testing.assert_array_equal(
        create_mask(and_masks(causal), 2, 1, 4, 3),
        np.broadcast_to(np.tri(4, 3, dtype=bool), (2, 1, 4, 3)),
    )
    assert create_mask(and_masks(), 2, 3, 4, 5).all()
    assert not create_mask(or_masks(), 2, 3, 4, 5).any()
    assert create_mask(or_masks(), 2, 3, 4, 5).shape == (2, 3, 4, 5)


def test_combined_masks_have_readable_names():
    assert and_masks(causal, near).__name__ == "and_masks(causal, near)"
    assert or_masks(causal).__name__ == "or_masks(causal)"


def test_combined_masks_make_block_masks():
    mask = create_block_mask(and_masks(causal, near), None, None, 64, 64, BLOCK_SIZE=16)
    dense = np.tri(64, dtype=bool) & ~np.tri(64, k=-3, dtype=bool)
    blocks = dense.reshape(4, 16, 4, 16).any(axis=(1, 3))
    np.testing.assert_array_equal(mask.to_dense()[0, 0], blocks)


def test_create_mask_of_a_mask_mod_against_a_loop():
    lengths = np.array([3, 5])

    def padded(b, h, q_idx, kv_idx):
        return (kv_idx < lengths[b]) & (q_idx + h >= kv_idx)

    got = create_mask(padded, 2, 3, 4, 6)
    expected = np.zeros((2, 3, 4, 6), bool)
    for b, h, i, j in np.ndindex(*expected.shape):
        expected[b, h, i, j] = j < lengths[b] and i + h >= j
    np.testing.assert_array_equal(got, expected)
    assert got.flags.writeable  # the caller's own array, not a broadcast view


def test_create_mask_of_a_score_mod_marks_its_minus_inf():
    def cut(score, b, h, q_idx, kv_idx):
        return np.where(kv_idx > q_idx + h, -np.inf, score + 1.0)

    got = create_mask(cut, None, 2, 3, 4)
    expected = np.array([[[j <= i + h for j in range(4)] for i in range(3)] for h in range(2)])
    np.testing.assert_array_equal(got, expected[None])


def test_create_mask_counts_parameters_as_pytorch_does():
    # a default makes a parameter optional: 4 required ones are a mask_mod
    def with_default(b, h, q_idx, kv_idx, extra=0):
        return q_idx >= kv_idx + extra

    np.testing.assert_array_equal(create_mask(with_default, None, None, 3, 3)[0, 0], np.tri(3) > 0)


def test_create_mask_against_torch(torch):
    from torch.nn.attention import flex_attention as tf

    def t_score(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx - kv_idx > h, -math.inf, score)

    def score(score, b, h, q_idx, kv_idx):
        return np.where(q_idx - kv_idx > h, -np.inf, score)

    for ours, theirs in (
        (and_masks(causal, near, even_key), tf.and_masks(causal, near, even_key)),
        (or_masks(near, even_key), tf.or_masks(near, even_key)),
        (and_masks(), tf.and_masks()),
        (or_masks(), tf.or_masks()),
        (noop_mask, tf.noop_mask),
        (score, t_score),
    ):
        expected = tf.create_mask(theirs, 2, 3, 7, 9, device="cpu").numpy()
        np.testing.assert_array_equal(create_mask(ours, 2, 3, 7, 9), expected)


def test_our_combinations_run_on_torch_tensors(torch):
    # and_masks/or_masks combine with operators: PyTorch can trace them as they are
    from torch.nn.attention import flex_attention as tf

    for ours in (and_masks(causal, near), or_masks(near, even_key)):
        expected = create_mask(ours, None, None, 8, 8)
        np.testing.assert_array_equal(
            tf.create_mask(ours, 1, 1, 8, 8, device="cpu").numpy(), expected
        )


def test_mask_helpers_refuse_bad_input():
    with pytest.raises(TypeError, match=r"and_masks takes mask_mods.*argument 1 is a int"):
        and_masks(causal, 3)
    with pytest.raises(TypeError, match=r"or_masks takes mask_mods.*argument 0 is a str"):
        or_masks("causal")
    with pytest.raises(TypeError, match="mod_fn must be a callable"):
        create_mask(None, None, None, 2, 2)
    with pytest.raises(TypeError, match="4 or 5 positional parameters without defaults; got 3"):
        create_mask(lambda b, h, q: q, None, None, 2, 2)
    with pytest.raises(ValueError, match="Q_LEN must be a positive"):
        create_mask(causal, None, None, 0, 2)
    with pytest.raises(TypeError, match="B must be a positive integer or None"):
        create_mask(causal, 1.5, None, 2, 2)
    with pytest.raises(TypeError, match="mask_mod must return a bool array"):
        create_mask(lambda b, h, i, j: i - j, None, None, 2, 2)
    with pytest.raises(ValueError, match="must return real scores that broadcast"):
        create_mask(lambda s, b, h, i, j: np.zeros(7), None, None, 2, 2)


# ---------------------------------------------------------------------------------------------
# return_aux: lse and max_scores
# ---------------------------------------------------------------------------------------------


def alibi_cap(slopes):
    """A score_mod (vectorised) and its scalar twin for the loop, written apart."""

    def vectorised(score, b, h, q_idx, kv_idx):
        return 4 * np.tanh((score + slopes[h] * (kv_idx - q_idx)) / 4)

    def scalar(z, b, h, i, j):
        return 4 * math.tanh((z + slopes[h] * (j - i)) / 4)

    return vectorised, scalar


@pytest.mark.parametrize("implementation", PATHS)
@pytest.mark.parametrize("modified", [False, True])
def test_lse_and_max_scores_against_a_loop(rng, implementation, modified):
    B, Hq, Hkv, T, S = 2, 4, 2, 37, 50
    q, k, v = normal(rng, B, Hq, T, 8), normal(rng, B, Hkv, S, 8), normal(rng, B, Hkv, S, 3)
    q *= 3  # scores spread over several units: the row maxima stand out
    lengths = np.array([50, 21])

    def window(b, h, q_idx, kv_idx):  # rows 30.. of batch 1 see no key at all
        return (kv_idx < lengths[b]) & (kv_idx <= q_idx + 4) & (q_idx - 10 < kv_idx)

    mask = create_block_mask(window, B, None, T, S, BLOCK_SIZE=(8, 4))
    score, scalar = alibi_cap(np.array([0.5, 0.25, 0.125, 0.0625])) if modified else (None, None)
    out, aux = flex_attention(
        q,
        k,
        v,
        score,
        mask,
        enable_gqa=True,
        implementation=implementation,
        return_aux=AuxRequest(lse=True, max_scores=True),
    )
    lse, top = loop_stats(
        q, k, v, score=scalar, allowed=lambda b, h, i, j: bool(window(b, h, i, j))
    )
    assert isinstance(aux, AuxOutput)
    np.testing.assert_allclose(aux.max_scores, top, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(aux.lse, lse, rtol=1e-12, atol=1e-12)
    assert np.isneginf(top[1, :, 30:]).all()  # the loop's empty rows, -inf in both
    np.testing.assert_array_equal(aux.max_scores[1, :, 30:], top[1, :, 30:])
    assert (aux.max_scores <= aux.lse).all()  # max z <= log sum exp z, -inf rows aside
    # the same out as without return_aux
    np.testing.assert_array_equal(
        out, flex_attention(q, k, v, score, mask, enable_gqa=True, implementation=implementation)
    )


@pytest.mark.parametrize("block_k", [4, 12, 64])
def test_tiled_max_scores_over_many_pieces_and_threads(rng, block_k):
    # No score_mod and no mask: the tiled path works in base 2, starts its units at the shift
    # 0 and takes lazy steps; its running maximum must still be each row's true one.
    q, k, v = normal(rng, 1, 2, 40, 4), normal(rng, 1, 2, 70, 4), normal(rng, 1, 2, 70, 4)
    k[..., 65, :] *= 6  # a late, large score in some rows (the shift lags behind it)
    lse, top = loop_stats(q, k, v)
    results = [
        flex_attention_tiled(
            q, k, v, block_k=block_k, num_threads=n, return_aux=AuxRequest(True, True)
        )[1]
        for n in (1, 3)
    ]
    np.testing.assert_allclose(results[0].max_scores, top, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(results[0].lse, lse, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(results[0].max_scores, results[1].max_scores)  # threads


def test_max_scores_is_not_the_first_allowed_score(rng):
    # scores rising along the keys: a unit's first piece holds none of a row's maxima
    q = np.ones((1, 1, 16, 2))
    k = np.linspace(0, 3, 64).reshape(1, 1, 32, 2)
    for implementation in PATHS:
        _, aux = flex_attention(
            q,
            k,
            k,
            scale=1.0,
            implementation=implementation,
            return_aux=AuxRequest(max_scores=True),
        )
        np.testing.assert_allclose(
            aux.max_scores, np.full((1, 1, 16), k[0, 0, -1].sum()), rtol=1e-14
        )


@pytest.mark.parametrize(
    "dtype, expected",
    [(np.float16, np.float32), (np.float32, np.float32), (np.float64, np.float64)],
)
@pytest.mark.parametrize("implementation", PATHS)
def test_aux_dtypes(rng, dtype, expected, implementation):
    q, k, v = (normal(rng, 1, 2, 9, 4, dtype=dtype) for _ in range(3))
    out, aux = flex_attention(
        q, k, v, implementation=implementation, return_aux=AuxRequest(lse=True, max_scores=True)
    )
    assert out.dtype == dtype
    assert aux.lse.dtype == expected and aux.max_scores.dtype == expected
    lse, top = loop_stats(q, k, v)
    tol = 1e-3 if dtype == np.float16 else 1e-5
    np.testing.assert_allclose(aux.max_scores, top, rtol=tol, atol=tol)
    np.testing.assert_allclose(aux.lse, lse, rtol=tol, atol=tol)


@pytest.mark.parametrize("implementation", PATHS)
def test_aux_fields_only_as_asked(rng, implementation):
    q, k, v = (normal(rng, 1, 1, 5, 4) for _ in range(3))
    out = flex_attention(q, k, v, implementation=implementation)
    out_none, aux = flex_attention(q, k, v, implementation=implementation, return_aux=AuxRequest())
    assert aux == AuxOutput(None, None)
    np.testing.assert_array_equal(out_none, out)
    _, only_lse = flex_attention(
        q, k, v, implementation=implementation, return_aux=AuxRequest(lse=True)
    )
    _, lse = flex_attention(q, k, v, implementation=implementation, return_lse=True)
    assert only_lse.max_scores is None
    np.testing.assert_array_equal(only_lse.lse, lse)
    _, only_max = flex_attention(
        q, k, v, implementation=implementation, return_aux=AuxRequest(max_scores=True)
    )
    assert only_max.lse is None and only_max.max_scores.shape == (1, 1, 5)


@pytest.mark.parametrize("implementation", PATHS)
def test_max_scores_of_empty_and_non_finite_rows(rng, implementation):
    q, k, v = (normal(rng, 1, 1, 6, 4) for _ in range(3))
    q[0, 0, 1, 0] = np.nan  # query 1: NaN in, NaN out
    v[0, 0, 2, 0] = np.inf  # value 2: out of the rows that see it, not their scores
    mask = create_block_mask(lambda b, h, i, j: (i < 5) & (j <= i), None, None, 6, 6, BLOCK_SIZE=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, aux = flex_attention(
            q,
            k,
            v,
            block_mask=mask,
            implementation=implementation,
            return_aux=AuxRequest(lse=True, max_scores=True),
        )
    assert np.isnan(aux.max_scores[0, 0, 1]) and np.isnan(aux.lse[0, 0, 1])
    assert np.isneginf(aux.max_scores[0, 0, 5])  # no allowed key
    assert np.isfinite(aux.max_scores[0, 0, [0, 2, 3, 4]]).all()
    assert np.isnan(out[0, 0, 2:5]).any(axis=-1).all()
    qq = np.where(np.isnan(q), 0, q)
    _, top = loop_stats(qq, k, v, allowed=lambda b, h, i, j: i < 5 and j <= i)
    np.testing.assert_allclose(
        aux.max_scores[0, 0, [0, 2, 3, 4]], top[0, 0, [0, 2, 3, 4]], rtol=1e-12
    )


@pytest.mark.parametrize("implementation", PATHS)
def test_empty_inputs_give_empty_aux(implementation):
    q = np.zeros((1, 2, 0, 4))
    k = np.zeros((1, 2, 3, 4))
    _, aux = flex_attention(
        q, k, k, implementation=implementation, return_aux=AuxRequest(lse=True, max_scores=True)
    )
    assert aux.lse.shape == aux.max_scores.shape == (1, 2, 0)


# ---------------------------------------------------------------------------------------------
# PyTorch 2.13
# ---------------------------------------------------------------------------------------------


def torch_max_scores(torch, q, k, v, t_score, t_mask, B=None):
    """PyTorch's row maxima from its eager math implementation (the public function refuses
    them on CPU), converted as its top level converts them: times ln 2."""
    from torch._higher_order_ops.flex_attention import math_attention
    from torch.nn.attention.flex_attention import create_block_mask as t_create_block_mask

    T, S = q.shape[-2], k.shape[-2]
    mask = t_create_block_mask(t_mask, B, None, T, S, device="cpu", BLOCK_SIZE=16)
    tensors = [torch.from_numpy(x) for x in (q, k, v)]
    identity = lambda score, b, h, i, j: score  # noqa: E731
    _, _, top2 = math_attention(
        *tensors, t_score or identity, mask.as_tuple(), q.shape[-1] ** -0.5, {}
    )
    return (top2 * math.log(2)).numpy()


def test_torch_refuses_max_scores_on_cpu(torch):
    # The difference documented in flex_attention's Notes: here max_scores works everywhere.
    from torch.nn.attention.flex_attention import AuxRequest as TAuxRequest
    from torch.nn.attention.flex_attention import flex_attention as t_flex

    x = torch.zeros(1, 1, 4, 4)
    with warnings.catch_warnings(), pytest.raises(NotImplementedError, match="max scores"):
        warnings.simplefilter("ignore")
        t_flex(x, x, x, return_aux=TAuxRequest(max_scores=True))


@pytest.mark.parametrize("implementation", PATHS)
def test_lse_and_max_scores_against_torch(torch, rng, implementation):
    B, H, T, S = 2, 2, 48, 64
    q, k, v = normal(rng, B, H, T, 8), normal(rng, B, H, S, 8), normal(rng, B, H, S, 4)
    lengths = np.array([64, 30])
    t_lengths = torch.from_numpy(lengths)

    def t_mask(b, h, i, j):
        return (j < t_lengths[b]) & (i + 16 >= j) & (i < 40)

    def mask_mod(b, h, i, j):
        return (j < lengths[b]) & (i + 16 >= j) & (i < 40)

    def t_score(score, b, h, i, j):
        # 0.125 * an int tensor is float32 in torch, exact for these distances (0.1 is not)
        return 3 * torch.tanh(score / 3) - 0.125 * (i - j).abs()

    def score(score, b, h, i, j):
        return 3 * np.tanh(score / 3) - 0.125 * abs(i - j)

    mask = create_block_mask(mask_mod, B, None, T, S, BLOCK_SIZE=16)
    for ours, theirs in ((None, None), (score, t_score)):
        _, t_lse, _ = torch_flex(torch, q, k, v, theirs, t_mask, B=B)
        t_top = torch_max_scores(torch, q, k, v, theirs, t_mask, B=B)
        _, aux = flex_attention(
            q,
            k,
            v,
            ours,
            mask,
            implementation=implementation,
            return_aux=AuxRequest(lse=True, max_scores=True),
        )
        np.testing.assert_allclose(aux.lse, t_lse, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(aux.max_scores, t_top, rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(aux.max_scores[:, :, 40:], t_top[:, :, 40:])  # -inf


def test_names_match_torch(torch):
    from torch.nn.attention import flex_attention as tf

    assert AuxRequest._fields == tf.AuxRequest._fields and AuxRequest() == (False, False)
    assert AuxOutput._fields == tf.AuxOutput._fields and AuxOutput() == (None, None)
    for name in ("noop_mask", "and_masks", "or_masks", "create_mask", "AuxRequest", "AuxOutput"):
        assert name in sdpa.__all__ and hasattr(tf, name)


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def test_return_aux_errors(rng):
    q = normal(rng, 1, 1, 3, 2)
    with pytest.raises(ValueError, match="return_lse=True and return_aux"):
        flex_attention(q, q, q, return_lse=True, return_aux=AuxRequest(lse=True))
    with pytest.raises(ValueError, match="return_lse=True and return_aux"):
        flex_attention_tiled(q, q, q, return_lse=True, return_aux=AuxRequest())
    with pytest.raises(TypeError, match="return_aux must be an sdpa.AuxRequest or None; got tuple"):
        flex_attention(q, q, q, return_aux=(True, False))
    with pytest.raises(TypeError, match="return_aux.max_scores must be a bool"):
        flex_attention(q, q, q, return_aux=AuxRequest(True, "yes"))
    with pytest.raises(TypeError, match="positional"):
        flex_attention(q, q, q, None, None, None, False, False, "auto", AuxRequest())


@pytest.mark.parametrize("implementation", PATHS)
def test_a_nan_score_makes_its_row_max_nan_and_a_masked_one_does_not(rng, implementation):
    x = normal(rng, 1, 1, 8, 4)
    mask = create_block_mask(causal, None, None, 8, 8, BLOCK_SIZE=2)

    def score(s, b, h, i, j):  # NaN at (5, 2), allowed, and at (1, 3), masked
        return np.where(((i == 5) & (j == 2)) | ((i == 1) & (j == 3)), np.nan, s)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, aux = flex_attention(x, x, x, score, mask, implementation=implementation,
                                return_aux=AuxRequest(max_scores=True))  # fmt: skip
    _, top = loop_stats(x, x, x, allowed=lambda b, h, i, j: j <= i)
    assert np.isnan(aux.max_scores[0, 0, 5])
    rows = [0, 1, 2, 3, 4, 6, 7]
    np.testing.assert_allclose(aux.max_scores[0, 0, rows], top[0, 0, rows], rtol=1e-12)
