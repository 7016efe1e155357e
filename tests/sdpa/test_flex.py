"""Tests of sdpa.flex and sdpa.block_mask: programmable attention and block masks.

* every example of the contract (ALiBi, soft-capping, causal, sliding window, document
  masking, prefix-LM) against an independent float64 loop that applies a scalar score function
  and an explicit mask to one score at a time;
* the reference and tiled paths against each other on shapes Hypothesis draws (T, S not
  multiples of the block, T != S, several block sizes, per-batch and per-head masks, GQA);
* what the tiled path calls: never a mod on an empty block, ``mask_mod`` on partial blocks
  only, every index inside the matrix, the same result whatever the tiling and the threads;
* fully masked rows, ``-inf`` from a ``score_mod``, the lse, dtypes, non-finite inputs;
* PyTorch's FlexAttention on CPU (eager: unfused, but exact) as a second reference;
* block masks (``to_dense``, ``sparsity``, the FlexAttention layout) against hand counts;
* one test per error message.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from references import attention_loop_2d, torch_flex

import sdpa
from sdpa import BlockMask, create_block_mask, flex_attention
from sdpa.flex import FlexStats, flex_attention_tiled

PATHS = ["reference", "tiled", "auto"]
TOL = {
    np.float64: dict(rtol=1e-12, atol=1e-12),
    np.float32: dict(rtol=2e-5, atol=2e-5),
    np.float16: dict(rtol=4e-3, atol=4e-3),
}


def normal(rng, *shape, dtype=np.float64):
    return rng.standard_normal(shape).astype(dtype)


def explicit(q, k, v, *, score=None, allowed=None, scale=None):
    """The contract as a float64 loop, one score at a time (``math.fsum`` for every sum).

    ``score(z, b, h, i, j)`` and ``allowed(b, h, i, j)`` are scalar functions, written apart
    from the vectorised mods under test. Query head ``h`` reads key head ``h // G``.
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    B, Hq, T, Dk = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = Hq // Hkv
    scale = 1 / math.sqrt(Dk) if scale is None else scale
    out = np.zeros((B, Hq, T, Dv))
    lse = np.full((B, Hq, T), -np.inf)
    for b, h, i in np.ndindex(B, Hq, T):
        kv = h // G
        z = {}
        for j in range(S):
            if allowed is not None and not allowed(b, h, i, j):
                continue
            s = scale * math.fsum(float(x) * float(y) for x, y in zip(q[b, h, i], k[b, kv, j]))
            s = s if score is None else score(s, b, h, i, j)
            if s != -math.inf:
                z[j] = s
        if not z:
            continue
        top = max(z.values())
        e = {j: math.exp(s - top) for j, s in z.items()}
        total = math.fsum(e.values())
        lse[b, h, i] = top + math.log(total)
        for d in range(Dv):
            out[b, h, i, d] = math.fsum(e[j] * float(v[b, kv, j, d]) for j in e) / total
    return out, lse


def assert_close(got, want, tol, what=""):
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=what)
    np.testing.assert_allclose(got, want, err_msg=what, **tol)


# ---------------------------------------------------------------------------------------------
# The examples of the contract, against the float64 loop
# ---------------------------------------------------------------------------------------------

SLOPES = np.array([0.5, 0.25, 0.125])
DOCUMENT = np.repeat([0, 1, 2], [7, 12, 6])  # the document of each of 25 positions
PREFIX = 6


def _causal(b, h, i, j):
    return i >= j


def _window(b, h, i, j):
    return (i >= j) & (i - j <= 4)


def _document(b, h, i, j):
    return DOCUMENT[i] == DOCUMENT[j]


def _prefix_lm(b, h, i, j):
    return (j < PREFIX) | (i >= j)


# (mask_mod, the same rule for one entry)
MASKS = {
    "causal": (_causal, lambda b, h, i, j: j <= i),
    "sliding window": (_window, lambda b, h, i, j: 0 <= i - j <= 4),
    "document": (_document, lambda b, h, i, j: DOCUMENT[i] == DOCUMENT[j]),
    "prefix-LM": (_prefix_lm, lambda b, h, i, j: j < PREFIX or j <= i),
}
# (score_mod, the same modification of one score)
SCORE_MODS = {
    "none": (None, None),
    "ALiBi": (
        lambda s, b, h, i, j: s + SLOPES[h] * (j - i),
        lambda z, b, h, i, j: z + float(SLOPES[h]) * (j - i),
    ),
    "soft-capping": (
        lambda s, b, h, i, j: 0.8 * np.tanh(s / 0.8),
        lambda z, b, h, i, j: 0.8 * math.tanh(z / 0.8),
    ),
}


@pytest.mark.parametrize("implementation", PATHS)
@pytest.mark.parametrize("mod_name", list(SCORE_MODS))
@pytest.mark.parametrize("mask_name", [None, *MASKS])
def test_examples_of_the_contract_match_the_float64_loop(rng, implementation, mod_name, mask_name):
    # 25 queries, 25 keys (document and prefix-LM need T = S), blocks of 8 and 4 that do not
    # divide them, three heads for the three slopes, a batch of two.
    q, k, v = normal(rng, 2, 3, 25, 4), normal(rng, 2, 3, 25, 4), normal(rng, 2, 3, 25, 5)
    score_mod, score = SCORE_MODS[mod_name]
    mask_mod, rule = MASKS[mask_name] if mask_name else (None, None)
    block_mask = None
    if mask_mod is not None:
        block_mask = create_block_mask(mask_mod, None, None, 25, 25, BLOCK_SIZE=(8, 4))
    out, lse = flex_attention(
        q, k, v, score_mod, block_mask, return_lse=True, implementation=implementation
    )
    want_out, want_lse = explicit(q, k, v, score=score, allowed=rule)
    assert_close(out, want_out, TOL[np.float64])
    assert_close(lse, want_lse, TOL[np.float64])


@pytest.mark.parametrize("implementation", PATHS)
def test_alibi_equals_the_package_s_alibi_bias_and_causal_mask(rng, implementation):
    q, k, v = normal(rng, 1, 4, 19, 8), normal(rng, 1, 4, 19, 8), normal(rng, 1, 4, 19, 3)
    slopes = sdpa.alibi_slopes(4)
    mask = create_block_mask(_causal, None, None, 19, 19, BLOCK_SIZE=5)
    out = flex_attention(
        q,
        k,
        v,
        lambda s, b, h, i, j: s + slopes[h] * (j - i),
        mask,
        implementation=implementation,
    )
    want = sdpa.scaled_dot_product_attention(
        q, k, v, sdpa.alibi_bias(4, 19, 19), is_causal=True, implementation="reference"
    )
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("implementation", PATHS)
def test_a_mask_per_batch_entry_and_head(rng, implementation):
    # Padding (a length per batch entry) and, on odd heads, causal: B and H given.
    B, H, T, S = 2, 3, 11, 13
    q, k, v = normal(rng, B, H, T, 4), normal(rng, B, H, S, 4), normal(rng, B, H, S, 2)
    lengths = np.array([9, 13])

    def mask_mod(b, h, i, j):
        return (j < lengths[b]) & ((h % 2 == 0) | (i >= j))

    mask = create_block_mask(mask_mod, B, H, T, S, BLOCK_SIZE=(4, 3))
    out, lse = flex_attention(
        q, k, v, block_mask=mask, return_lse=True, implementation=implementation
    )
    want_out, want_lse = explicit(
        q, k, v, allowed=lambda b, h, i, j: j < lengths[b] and (h % 2 == 0 or j <= i)
    )
    assert_close(out, want_out, TOL[np.float64])
    assert_close(lse, want_lse, TOL[np.float64])


# ---------------------------------------------------------------------------------------------
# Grouped-query attention
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", PATHS)
@pytest.mark.parametrize("Hkv", [1, 2, 3, 6])
@pytest.mark.parametrize("per_head", [False, True])
def test_grouped_query_attention(rng, implementation, Hkv, per_head):
    B, Hq, T, S = 2, 6, 9, 14
    q, k, v = normal(rng, B, Hq, T, 4), normal(rng, B, Hkv, S, 4), normal(rng, B, Hkv, S, 3)

    def mask_mod(b, h, i, j):  # per head: each head sees a window of its own width
        return (i >= j) & (i - j <= h + 1) if per_head else i >= j

    mask = create_block_mask(mask_mod, None, Hq if per_head else None, T, S, BLOCK_SIZE=4)
    slopes = np.linspace(0.1, 0.6, Hq)
    out, lse = flex_attention(
        q,
        k,
        v,
        lambda s, b, h, i, j: s + slopes[h] * (j - i),
        mask,
        enable_gqa=True,
        return_lse=True,
        implementation=implementation,
    )
    want_out, want_lse = explicit(
        q,
        k,
        v,
        score=lambda z, b, h, i, j: z + float(slopes[h]) * (j - i),
        allowed=lambda b, h, i, j: 0 <= i - j <= (h + 1 if per_head else T),
    )
    assert_close(out, want_out, TOL[np.float64])
    assert_close(lse, want_lse, TOL[np.float64])


@pytest.mark.parametrize("implementation", PATHS)
def test_one_key_head_broadcasts_without_enable_gqa(rng, implementation):
    q, k, v = normal(rng, 1, 4, 10, 3), normal(rng, 1, 1, 12, 3), normal(rng, 1, 1, 12, 2)
    mask = create_block_mask(_causal, None, None, 10, 12, BLOCK_SIZE=4)
    plain = flex_attention(q, k, v, block_mask=mask, implementation=implementation)
    grouped = flex_attention(q, k, v, block_mask=mask, enable_gqa=True, implementation="reference")
    np.testing.assert_allclose(plain, grouped, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Fully masked rows, -inf scores, the lse
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", PATHS)
def test_fully_masked_rows_give_zero_and_minus_inf(rng, implementation):
    # Rows 5 and up attend nothing; pytest turns any warning into an error.
    q, k, v = normal(rng, 2, 2, 9, 4), normal(rng, 2, 2, 7, 4), normal(rng, 2, 2, 7, 3)
    mask = create_block_mask(lambda b, h, i, j: i + j < 5, None, None, 9, 7, BLOCK_SIZE=2)
    out, lse = flex_attention(
        q, k, v, block_mask=mask, return_lse=True, implementation=implementation
    )
    assert np.all(out[:, :, 5:] == 0) and np.all(np.isneginf(lse[:, :, 5:]))
    assert np.isfinite(out).all() and np.isfinite(lse[:, :, :5]).all()


@pytest.mark.parametrize("implementation", PATHS)
def test_a_mask_that_allows_nothing(rng, implementation):
    q, k, v = normal(rng, 1, 2, 6, 4), normal(rng, 1, 2, 5, 4), normal(rng, 1, 2, 5, 3)
    mask = create_block_mask(lambda b, h, i, j: i < 0, None, None, 6, 5, BLOCK_SIZE=2)
    assert mask.sparsity() == 100.0
    out, lse = flex_attention(
        q, k, v, block_mask=mask, return_lse=True, implementation=implementation
    )
    np.testing.assert_array_equal(out, np.zeros((1, 2, 6, 3)))
    assert np.all(np.isneginf(lse))


@pytest.mark.parametrize("implementation", PATHS)
def test_a_score_mod_that_returns_minus_inf_excludes_like_a_mask(rng, implementation):
    q, k, v = normal(rng, 1, 2, 8, 4), normal(rng, 1, 2, 8, 4), normal(rng, 1, 2, 8, 3)
    out, lse = flex_attention(
        q,
        k,
        v,
        lambda s, b, h, i, j: np.where(j > i, -np.inf, s),
        return_lse=True,
        implementation=implementation,
    )
    mask = create_block_mask(_causal, None, None, 8, 8, BLOCK_SIZE=3)
    want_out, want_lse = flex_attention(
        q, k, v, block_mask=mask, return_lse=True, implementation="reference"
    )
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)
    # and a row set to -inf entirely is a fully masked row
    out, lse = flex_attention(
        q,
        k,
        v,
        lambda s, b, h, i, j: np.where(i == 2, -np.inf, s),
        return_lse=True,
        implementation=implementation,
    )
    assert np.all(out[:, :, 2] == 0) and np.all(np.isneginf(lse[:, :, 2]))


@pytest.mark.parametrize("implementation", PATHS)
def test_lse_is_the_natural_log_of_the_allowed_row_sum(implementation):
    # Zero queries: every score 0, so row i of a causal mask has lse = log(i + 1); with the
    # score_mod +1 on key 0, log(i + e) (exp(1) + i ones).
    T = 7
    q, k, v = np.zeros((1, 1, T, 3)), np.ones((1, 1, T, 3)), np.ones((1, 1, T, 2))
    mask = create_block_mask(_causal, None, None, T, T, BLOCK_SIZE=3)
    _, lse = flex_attention(
        q, k, v, block_mask=mask, return_lse=True, implementation=implementation
    )
    np.testing.assert_allclose(lse[0, 0], np.log(np.arange(1, T + 1)), rtol=1e-15)
    _, lse = flex_attention(
        q,
        k,
        v,
        lambda s, b, h, i, j: s + (j == 0),
        mask,
        return_lse=True,
        implementation=implementation,
    )
    np.testing.assert_allclose(lse[0, 0], np.log(np.arange(T) + np.e), rtol=1e-15)


@pytest.mark.parametrize("implementation", PATHS)
def test_masked_values_get_weight_exactly_zero(implementation):
    q, k = np.ones((1, 1, 4, 2)), np.ones((1, 1, 4, 2))
    v = np.zeros((1, 1, 4, 1))
    v[0, 0, 3] = 1e300  # hidden from rows 0 to 2 by the causal mask
    mask = create_block_mask(_causal, None, None, 4, 4, BLOCK_SIZE=2)
    out = flex_attention(q, k, v, block_mask=mask, implementation=implementation)
    np.testing.assert_array_equal(out[0, 0, :3], 0.0)


# ---------------------------------------------------------------------------------------------
# Dtypes, inputs, non-finite values
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", PATHS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("mod_name", ["none", "soft-capping"])  # base 2 in float32 without
def test_dtypes(rng, implementation, dtype, mod_name):
    q, k, v = (
        normal(rng, 1, 3, 13, 8, dtype=dtype),
        normal(rng, 1, 3, 17, 8, dtype=dtype),
        normal(rng, 1, 3, 17, 4, dtype=dtype),
    )
    mask = create_block_mask(_window, None, None, 13, 17, BLOCK_SIZE=4)
    score_mod, score = SCORE_MODS["soft-capping"]
    out, lse = flex_attention(
        q, k, v, score_mod, mask, return_lse=True, implementation=implementation
    )
    assert out.dtype == dtype
    assert lse.dtype == (np.float32 if dtype == np.float16 else dtype)
    want_out, want_lse = explicit(q, k, v, score=score, allowed=MASKS["sliding window"][1])
    assert_close(out.astype(np.float64), want_out, TOL[dtype])
    assert_close(lse.astype(np.float64), want_lse, TOL[dtype])


def test_the_mods_see_the_working_dtype(rng):
    seen = []

    def score_mod(s, b, h, i, j):
        seen.append(s.dtype)
        return s

    q = normal(rng, 1, 1, 4, 2, dtype=np.float16)
    for implementation in ("reference", "tiled"):
        flex_attention(q, q, q, score_mod, implementation=implementation)
    assert set(seen) == {np.dtype(np.float32)}


@pytest.mark.parametrize("implementation", PATHS)
def test_inputs_are_not_modified_and_read_only_views_work(rng, implementation):
    q, k, v = normal(rng, 2, 2, 9, 4), normal(rng, 2, 2, 9, 4), normal(rng, 2, 2, 9, 3)
    copies = [x.copy() for x in (q, k, v)]
    for x in (q, k, v):
        x.flags.writeable = False
    mask = create_block_mask(_causal, None, None, 9, 9, BLOCK_SIZE=4)
    out = flex_attention(q, k, v, lambda s, b, h, i, j: s * 2, mask, implementation=implementation)
    for x, c in zip((q, k, v), copies):
        np.testing.assert_array_equal(x, c)
    out[...] = 0  # the result is the caller's own array


@pytest.mark.parametrize("implementation", PATHS)
def test_nan_in_reaches_exactly_the_rows_that_may_attend_it(rng, implementation):
    # NaN in key 6 and value 2; query row 3 of head 1 holds an inf. Causal mask: key 6 reaches
    # rows 6 to 8 (out and lse), value 2 rows 2 to 8 (out only).
    q, k, v = normal(rng, 1, 2, 9, 4), normal(rng, 1, 2, 9, 4), normal(rng, 1, 2, 9, 3)
    k[0, :, 6, 1] = np.nan
    v[0, :, 2, 0] = np.nan
    q[0, 1, 3, 2] = np.inf
    mask = create_block_mask(_causal, None, None, 9, 9, BLOCK_SIZE=(3, 4))
    out, lse = flex_attention(
        q, k, v, block_mask=mask, return_lse=True, implementation=implementation
    )
    nan_lse = np.zeros((2, 9), dtype=bool)
    nan_lse[:, 6:] = True
    nan_lse[1, 3] = True
    nan_out = nan_lse.copy()
    nan_out[:, 2:] = True
    np.testing.assert_array_equal(np.isnan(lse[0]), nan_lse)
    np.testing.assert_array_equal(np.isnan(out[0]).any(axis=-1), nan_out)
    assert not np.isnan(out[0][~nan_out]).any()


@pytest.mark.parametrize("implementation", PATHS)
def test_a_score_mod_that_returns_nan_makes_its_row_nan(rng, implementation):
    q = normal(rng, 1, 1, 5, 2)
    out, lse = flex_attention(
        q,
        q,
        q,
        lambda s, b, h, i, j: np.where((i == 1) & (j == 0), np.nan, s),
        return_lse=True,
        implementation=implementation,
    )
    assert np.isnan(lse[0, 0, 1]) and np.isnan(out[0, 0, 1]).all()
    assert np.isfinite(np.delete(lse[0, 0], 1)).all()


@pytest.mark.parametrize("implementation", PATHS)
@pytest.mark.parametrize("T, S", [(0, 4), (4, 0), (0, 0)])
def test_empty_lengths(implementation, T, S):
    out, lse = flex_attention(
        np.ones((2, 3, T, 4)),
        np.ones((2, 3, S, 4)),
        np.ones((2, 3, S, 5)),
        return_lse=True,
        implementation=implementation,
    )
    assert out.shape == (2, 3, T, 5) and lse.shape == (2, 3, T)
    assert np.all(out == 0) and np.all(np.isneginf(lse))


def test_integer_inputs_compute_in_float64():
    q = np.arange(24).reshape(1, 2, 3, 4) % 3
    out = flex_attention(q, q, q)
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, explicit(q, q, q)[0], rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# What the tiled path calls, and what it skips
# ---------------------------------------------------------------------------------------------


class Recorder:
    """Vectorised mods that record every ``(b, h, i, j)`` they are called on."""

    def __init__(self, mask_mod):
        self.mask_mod = mask_mod
        self.score_calls, self.mask_calls = [], []
        self.recording = False

    @staticmethod
    def entries(b, h, i, j):
        full = np.broadcast_arrays(b, h, i, j)
        return np.stack([x.ravel() for x in full], axis=1)  # (n, 4)

    def score_mod(self, score, b, h, i, j):
        assert np.broadcast_shapes(b.shape, h.shape, i.shape, j.shape) == score.shape
        self.score_calls.append(self.entries(b, h, i, j))
        return score + 0.01 * (i - j)

    def mask(self, b, h, i, j):
        if self.recording:
            self.mask_calls.append(self.entries(b, h, i, j))
        return self.mask_mod(b, h, i, j)


@pytest.mark.parametrize(
    "mask_mod",
    [_causal, _window, lambda b, h, i, j: (i // 5) == (j // 5), lambda b, h, i, j: j < 2 + h],
    ids=["causal", "window", "blocks of 5", "per head"],
)
@pytest.mark.parametrize("block", [3, (4, 2), (5, 7)])
def test_the_tiled_path_never_calls_a_mod_on_an_empty_block(rng, mask_mod, block):
    B, H, T, S = 2, 3, 23, 19  # neither a multiple of any block size
    q, k, v = normal(rng, B, H, T, 4), normal(rng, B, H, S, 4), normal(rng, B, H, S, 2)
    recorder = Recorder(mask_mod)
    mask = create_block_mask(recorder.mask, None, H, T, S, BLOCK_SIZE=block)
    recorder.recording = True
    stats = FlexStats()
    flex_attention_tiled(q, k, v, recorder.score_mod, mask, block_k=5, num_threads=2, stats=stats)
    bq, bk = mask.BLOCK_SIZE
    kinds = mask.kinds[0]  # (H, n_q, n_kv)
    for calls, allowed_kinds in ((recorder.score_calls, (1, 2)), (recorder.mask_calls, (1,))):
        entries = np.concatenate(calls)
        b, h, i, j = entries.T
        assert ((0 <= b) & (b < B) & (0 <= i) & (i < T) & (0 <= j) & (j < S)).all()
        assert np.isin(kinds[h, i // bq, j // bk], allowed_kinds).all()
    # the mask only on partial blocks, with b = 0 (the mask is the same for every batch entry)
    assert (np.concatenate(recorder.mask_calls)[:, 0] == 0).all()
    # score_mod saw every entry of every non-empty block, once per batch entry
    b, h, i, j = np.concatenate(recorder.score_calls).T
    seen = np.zeros((B, H, T, S), dtype=int)
    np.add.at(seen, (b, h, i, j), 1)
    nonempty = np.repeat(np.repeat(kinds > 0, bq, axis=1), bk, axis=2)[:, :T, :S]
    np.testing.assert_array_equal(seen, np.broadcast_to(nonempty, seen.shape).astype(int))
    # and the counts add up
    assert stats.computed == B * np.count_nonzero(kinds)
    assert stats.masked == B * np.count_nonzero(kinds == 1)
    assert stats.skipped == B * np.count_nonzero(kinds == 0)


@pytest.mark.parametrize("mask_heads", [None, 2])
def test_stats_of_a_causal_mask(rng, mask_heads):
    # 8 x 8 blocks of 16: 36 computed (8 partial, on the diagonal), 28 skipped, per head.
    q = normal(rng, 1, 2, 128, 4)
    mask = create_block_mask(_causal, None, mask_heads, 128, 128, BLOCK_SIZE=16)
    stats = FlexStats()
    flex_attention_tiled(q, q, q, block_mask=mask, block_k=48, stats=stats)
    assert (stats.computed, stats.masked, stats.skipped) == (2 * 36, 2 * 8, 2 * 28)
    # block_k = 48 keys: pieces of 3 blocks, the full blocks apart from the partial ones, so
    # query block m (m full blocks, then the partial diagonal one) takes ceil(m / 3) pieces of
    # full blocks and one of its diagonal block, one product each
    pieces = [-(-m // 3) + 1 for m in range(8)]
    # a unit per head and query block: 16 of them, no more than MIN_UNITS, so none takes two
    # heads even where the mask is the same for both
    assert (stats.units, stats.tiles) == (2 * 8, 2 * sum(pieces))
    assert stats.skipped / (stats.computed + stats.skipped) == mask.sparsity() / 100
    # scores of unit size never exceed a row's shift by LAZY_MARGIN: no piece computed twice
    assert stats.redone == 0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_piece_whose_scores_leap_above_the_shift_is_computed_again(rng, dtype):
    # Keys e_0 ... e_63 and queries 400 e_i (scale 1/8): query i scores 50 against key i and 0
    # against every other. A query block's full blocks, its first piece, pass at the shift 0
    # (row sums 16 m); its diagonal block, at that shift, would add exp(50) > e ** 20 =
    # e ** LAZY_MARGIN: that piece is computed again with a new shift, in every query block
    # (4 units of one query block each: 4 heads' worth of blocks are too few to make taller
    # units, see sdpa.tiles.blocks.query_blocks_per_unit).
    T, bs = 64, 16
    k = np.eye(T)[None, None]
    q, v = 400 * k, normal(rng, 1, 1, T, 3)
    mask = create_block_mask(_causal, None, None, T, T, BLOCK_SIZE=bs)
    stats = FlexStats()
    out, lse = flex_attention_tiled(
        *(x.astype(dtype) for x in (q, k, v)), block_mask=mask, return_lse=True, stats=stats
    )
    assert (stats.units, stats.redone) == (T // bs, T // bs)
    want_out, want_lse = explicit(q, k, v, allowed=lambda b, h, i, j: i >= j)
    assert_close(out, want_out, TOL[dtype])
    assert_close(lse, want_lse, TOL[dtype])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("sign", [1, -1])
def test_a_first_piece_too_far_from_zero_is_computed_again(rng, dtype, sign):
    # Keys near one direction u and queries 400 u (or -400 u), scale 1/2: every score about
    # +200 (exp overflows float32) or -200 (every row sum underflows). The unmasked row is one
    # piece, which tries the shift 0 first: it is computed again, with the row maxima.
    u = np.array([0.6, 0.0, 0.8, 0.0])
    k = u + 0.01 * normal(rng, 1, 2, 40, 4)
    q, v = sign * 400 * np.broadcast_to(u, (1, 2, 24, 4)), normal(rng, 1, 2, 40, 3)
    stats = FlexStats()
    out, lse = flex_attention_tiled(
        *(x.astype(dtype) for x in (q, k, v)), return_lse=True, stats=stats
    )
    assert stats.redone == stats.units == 2
    want_out, want_lse = explicit(q, k, v)
    assert_close(out, want_out, TOL[dtype])
    assert_close(lse, want_lse, dict(rtol=1e-6, atol=0))


def test_the_score_mod_does_not_depend_on_the_tiling(rng):
    # A score_mod of position, head and batch entry, and a mask that is all True: the block
    # sizes, the pieces and the path change, the result does not (to rounding).
    B, H, T, S = 2, 2, 21, 30
    q, k, v = normal(rng, B, H, T, 5), normal(rng, B, H, S, 5), normal(rng, B, H, S, 3)

    def score_mod(s, b, h, i, j):
        return s * (1 + 0.1 * h) - 0.05 * np.abs(i - j) + 0.3 * b

    want = flex_attention(q, k, v, score_mod, implementation="reference")
    for block in (1, 4, (3, 8), (21, 30), 64):
        mask = create_block_mask(lambda b, h, i, j: j >= 0, None, None, T, S, BLOCK_SIZE=block)
        for block_k in (1, 7, 30):
            got = flex_attention_tiled(q, k, v, score_mod, mask, block_k=block_k)
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=f"{block}")


def test_thread_counts_and_calling_threads_give_identical_bits(rng):
    q, k, v = normal(rng, 2, 4, 77, 8), normal(rng, 2, 2, 90, 8), normal(rng, 2, 2, 90, 8)
    mask = create_block_mask(_prefix_lm, None, None, 77, 90, BLOCK_SIZE=(8, 16))
    score_mod = SCORE_MODS["soft-capping"][0]

    def run(n):
        return flex_attention_tiled(
            q, k, v, score_mod, mask, enable_gqa=True, return_lse=True, block_k=32, num_threads=n
        )

    one = run(1)
    for got in [run(2), run(3)]:
        for a, b in zip(got, one):
            np.testing.assert_array_equal(a, b)
    with ThreadPoolExecutor(max_workers=2) as pool:
        for got in pool.map(run, [1, 2]):
            for a, b in zip(got, one):
                np.testing.assert_array_equal(a, b)


def test_a_block_mask_keeps_what_mask_mod_gave_for_later_calls(rng):
    q, k, v = normal(rng, 1, 2, 40, 4), normal(rng, 1, 2, 40, 4), normal(rng, 1, 2, 40, 3)
    recorder = Recorder(_window)
    mask = create_block_mask(recorder.mask, None, None, 40, 40, BLOCK_SIZE=8)
    recorder.recording = True
    # one thread where calls are counted (two threads that miss the same plan both make it)
    first = flex_attention_tiled(q, k, v, block_mask=mask, block_k=16, num_threads=1)
    evaluated = len(recorder.mask_calls)
    assert evaluated > 0
    # the same settings: every plan kept, mask_mod not called again, the same bits
    again = flex_attention_tiled(q, k, v, block_mask=mask, block_k=16, num_threads=2)
    assert len(recorder.mask_calls) == evaluated
    np.testing.assert_array_equal(again, first)
    # another dtype: the same plans (masks of bools); another block_k (other pieces): anew
    q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
    flex_attention_tiled(q32, k32, v32, block_mask=mask, block_k=16, num_threads=1)
    assert len(recorder.mask_calls) == evaluated
    flex_attention_tiled(q, k, v, block_mask=mask, block_k=8, num_threads=1)
    assert len(recorder.mask_calls) > evaluated


def test_a_full_plan_cache_starts_over(rng, monkeypatch):
    # A budget of 100 bytes holds one row's mask at most (8 x 8 entries: 64 bytes of bools), so a second call evaluates mask_mod again on at least seven of
    # the eight diagonal blocks; the result is the same as with every plan kept.
    q = normal(rng, 1, 1, 64, 4)
    want = flex_attention_tiled(q, q, q, block_mask=create_block_mask(_causal, 1, 1, 64, 64, 8))
    monkeypatch.setattr(sdpa.flex, "PLAN_CACHE_BYTES", 100)  # the name flex reads
    recorder = Recorder(_causal)
    mask = create_block_mask(recorder.mask, 1, 1, 64, 64, BLOCK_SIZE=8)
    recorder.recording = True
    np.testing.assert_array_equal(flex_attention_tiled(q, q, q, block_mask=mask), want)
    assert len(recorder.mask_calls) == 8  # one call per diagonal block
    np.testing.assert_array_equal(flex_attention_tiled(q, q, q, block_mask=mask), want)
    assert len(recorder.mask_calls) >= 8 + 7


def test_a_new_mask_used_from_two_threads_at_once_gives_the_same_bits(rng):
    q, k, v = normal(rng, 2, 4, 70, 8), normal(rng, 2, 4, 70, 8), normal(rng, 2, 4, 70, 8)
    want = flex_attention_tiled(q, k, v, block_mask=create_block_mask(_window, 2, 4, 70, 70, 8))
    for _ in range(5):  # both threads miss the same plans on a new mask, at the same time
        mask = create_block_mask(_window, 2, 4, 70, 70, BLOCK_SIZE=8)
        with ThreadPoolExecutor(max_workers=2) as pool:
            runs = [pool.submit(flex_attention_tiled, q, k, v, block_mask=mask) for _ in range(2)]
            for run in runs:
                np.testing.assert_array_equal(run.result(), want)


def test_an_error_in_a_mod_reaches_the_caller_from_a_worker_thread(rng):
    q = normal(rng, 1, 4, 64, 4)

    def failing(s, b, h, i, j):
        raise RuntimeError("the user's mod failed")

    with pytest.raises(RuntimeError, match="the user's mod failed"):
        flex_attention_tiled(q, q, q, failing, num_threads=2)


class ShapeSpy:
    def __init__(self):
        self.shapes = []

    def __call__(self, score, b, h, i, j):
        self.shapes.append(score.shape)
        return score


def test_auto_keeps_small_problems_on_the_reference_path(rng):
    spy = ShapeSpy()
    q = normal(rng, 2, 3, 40, 8)
    flex_attention(q, q, q, spy)
    assert spy.shapes == [(2, 3, 40, 40)]  # one call on the whole score matrix


def test_auto_tiles_large_problems(rng):
    spy = ShapeSpy()
    q = normal(rng, 1, 2, 1024, 8, dtype=np.float32)
    mask = create_block_mask(_causal, None, None, 1024, 1024)
    flex_attention(q, q, q, spy, mask)
    # per head and block of 128 query rows m: one product of the m full blocks left of the
    # diagonal, m * 128 keys (none for m = 0), and one of the diagonal block, 128 keys (2
    # heads x 8 blocks: a unit each)
    widths = sorted(shape[-1] for shape in spy.shapes)
    assert widths == sorted(2 * [128 * m for m in range(1, 8)] + 2 * 8 * [128])
    assert {shape[:3] for shape in spy.shapes} == {(1, 1, 128)}


def test_auto_counts_the_units_as_the_tiled_path_cuts_the_work(rng):
    # 32 x 32 heads of 64 x 64 scores, no mask: 2**22 scores. A unit per key head would hold
    # 2**12 scores, too few to pay for itself; the tiled path puts the 32 heads of a batch
    # entry in one unit (2**17 scores), where it is the faster (0.42 of the reference path's
    # time, 2-core Xeon), and auto takes it.
    q = normal(rng, 32, 32, 64, 16, dtype=np.float32)
    spy = ShapeSpy()
    flex_attention(q, q, q, spy)
    assert {shape[:2] for shape in spy.shapes} == {(1, 32)}  # a batch entry's heads at a time
    spy.shapes.clear()
    flex_attention(q, q, q, spy, implementation="reference")
    assert spy.shapes == [(32, 32, 64, 64)]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    B=st.integers(1, 8),
    Hkv=st.integers(1, 8),
    G=st.integers(1, 2),
    T=st.sampled_from([48, 130, 256, 400]),
    masked=st.sampled_from([None, "shared", "per head"]),
)
def test_auto_follows_its_rule_with_the_units_the_tiled_path_makes(B, Hkv, G, T, masked):
    # The rule (sdpa.cost_model.FLEX_MIN_TILED_SCORES, MIN_UNIT_SCORES), with the computed scores counted
    # from the block mask and the units from what the tiled path reports doing; the path
    # auto took, read off the shapes its score_mod received.
    rng = np.random.default_rng(B * 1000 + Hkv * 100 + G * 10 + T)
    q = normal(rng, B, Hkv * G, T, 4, dtype=np.float32)
    k = normal(rng, B, Hkv, T, 4, dtype=np.float32)
    mask = None
    if masked is not None:
        heads = Hkv * G if masked == "per head" else None
        mask = create_block_mask(_causal, None, heads, T, T, BLOCK_SIZE=64)
    stats = FlexStats()
    flex_attention_tiled(q, k, k, block_mask=mask, enable_gqa=G > 1, stats=stats)
    if mask is None:
        computed = B * Hkv * G * T * T
    else:
        kept = np.repeat(np.repeat(mask.to_dense(), 64, axis=2), 64, axis=3)[..., :T, :T]
        computed = int(np.broadcast_to(kept, (B, Hkv * G, T, T)).sum())
    scores = B * Hkv * G * T * T  # far below a quarter of the memory: no memory rule
    tiled = scores >= sdpa.cost_model.FLEX_MIN_TILED_SCORES and (
        computed >= sdpa.cost_model.MIN_UNIT_SCORES * stats.units
    )
    spy = ShapeSpy()
    flex_attention(q, k, k, spy, mask, enable_gqa=G > 1)
    whole = (B, Hkv * G, T, T)
    assert (spy.shapes != [whole]) == tiled, (stats.units, computed, spy.shapes[:2])


@pytest.mark.parametrize("gqa", [False, True])
def test_a_unit_takes_several_heads_when_the_mask_is_the_same_for_all(rng, gqa):
    # 32 query heads (16 key heads under GQA), one query block of 128: 32 (16) units of one
    # key head; sdpa.tuning.MIN_UNITS = 16 lets a unit take 2 key heads (1 under GQA), within
    # the UNIT_SCORES of the row
    Hkv = 16 if gqa else 32
    q = normal(rng, 1, 32, 128, 8, dtype=np.float32)
    k, v = (
        normal(rng, 1, Hkv, 128, 8, dtype=np.float32),
        normal(rng, 1, Hkv, 128, 4, dtype=np.float32),
    )
    shared = create_block_mask(_causal, None, None, 128, 128)
    per_head = create_block_mask(_causal, None, 32, 128, 128)  # the same mask, head by head
    spy, stats = ShapeSpy(), FlexStats()
    folded = flex_attention_tiled(q, k, v, spy, shared, enable_gqa=gqa, stats=stats)
    assert stats.units == 16
    # 2 query heads per unit: of 2 key heads, or (GQA) of the key head they share
    assert {shape[:3] for shape in spy.shapes} == {(1, 2, 128)}
    alone = flex_attention_tiled(q, k, v, spy, per_head, enable_gqa=gqa)
    np.testing.assert_array_equal(folded, alone)
    expected = sdpa.scaled_dot_product_attention(
        q.astype(np.float64), k, v, is_causal=True, enable_gqa=gqa
    )
    np.testing.assert_allclose(folded, expected, rtol=1e-5, atol=1e-5)


def test_auto_keeps_many_small_heads_on_the_reference_path(rng):
    # 2048 batch entries of 8 heads of 8 x 8: 2**20 scores, but a unit holds at most one batch
    # entry's heads, 512 scores (width 8: the tiled path took 5.4 times as long, 2-core Xeon).
    # 4 entries of 4096 such heads: units of 1024 heads, 2**16 scores (width 4: the tiled path
    # took 0.43 of the reference path's time).
    spy = ShapeSpy()
    q = normal(rng, 2048, 8, 8, 8, dtype=np.float32)
    flex_attention(q, q, q, spy)
    assert spy.shapes == [(2048, 8, 8, 8)]
    spy.shapes.clear()
    q = normal(rng, 4, 4096, 8, 4, dtype=np.float32)
    flex_attention(q, q, q, spy)
    assert {shape[:2] for shape in spy.shapes} == {(1, 1024)}


@pytest.mark.parametrize("Hq, S", [(32, 16384), (64, 8192), (64, 16384)])
def test_auto_decodes_grouped_queries_on_the_reference_path(rng, Hq, S):
    # Issue 34: one token, Hq query heads over 8 key heads, at least 2**19 scores (which the
    # earlier rule tiled: units of Hq / 8 rows by S keys). The tiled path took 1.03 to 1.33
    # times as long as the reference path (width 64, float32, 2-core Xeon).
    q = normal(rng, 1, Hq, 1, 64, dtype=np.float32)
    k = normal(rng, 1, 8, S, 64, dtype=np.float32)
    spy = ShapeSpy()
    flex_attention(q, k, k, spy, enable_gqa=True)
    assert spy.shapes == [(1, Hq, 1, S)]  # one call on the whole score matrix
    spy.shapes.clear()
    flex_attention(q, k[:, :1], k[:, :1], spy, enable_gqa=True)  # all over one key head
    assert spy.shapes != [(1, Hq, 1, S)]  # Hq rows per unit: the tiled path


# ---------------------------------------------------------------------------------------------
# The reference and tiled paths, on shapes Hypothesis draws
# ---------------------------------------------------------------------------------------------


@st.composite
def flex_problems(draw):
    B, Hkv, G = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    T, S = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    Dk, Dv = draw(st.integers(1, 6)), draw(st.integers(1, 5))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    Hq = Hkv * G
    dtype = draw(st.sampled_from([np.float32, np.float64]))  # float32: base 2 without a mod
    q, k, v = (
        normal(rng, *shape, dtype=dtype)
        for shape in ((B, Hq, T, Dk), (B, Hkv, S, Dk), (B, Hkv, S, Dv))
    )
    Bm = draw(st.sampled_from([None, B]))
    Hm = draw(st.sampled_from([None, Hq]))
    table = rng.random((Bm or 1, Hm or 1, T, S)) < draw(st.sampled_from([0.1, 0.5, 0.9]))
    offsets = rng.integers(-3, 4, size=(Bm or 1, Hm or 1))
    masks = {
        None: None,
        "causal": _causal,
        "band": lambda b, h, i, j: np.abs(i - j + offsets[b, h]) <= 2,
        "random": lambda b, h, i, j: table[b, h, i, j],
        "prefix": lambda b, h, i, j: (j < T // 3) | (i >= j),
    }
    mask_name = draw(st.sampled_from(list(masks)))
    bias = rng.standard_normal((B, Hq, T, S))
    score_mods = {
        None: None,
        "alibi": lambda s, b, h, i, j: s + 0.1 * (h + 1) * (j - i),
        "softcap": lambda s, b, h, i, j: 2.0 * np.tanh(s / 2.0),
        "table": lambda s, b, h, i, j: s + bias[b, h, i, j],
        "-inf": lambda s, b, h, i, j: np.where(bias[b, h, i, j] > 1.0, -np.inf, s),
    }
    mod_name = draw(st.sampled_from(list(score_mods)))
    block = draw(st.one_of(st.integers(1, 12), st.tuples(st.integers(1, 12), st.integers(1, 12))))
    mask = None
    if masks[mask_name] is not None:
        mask = create_block_mask(masks[mask_name], Bm, Hm, T, S, BLOCK_SIZE=block)
    return dict(
        args=(q, k, v, score_mods[mod_name], mask),
        gqa=G > 1 or draw(st.booleans()),
        block_k=draw(st.integers(1, 48)),
        num_threads=draw(st.integers(1, 3)),
        dtype=dtype,
    )


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=flex_problems())
def test_reference_and_tiled_agree(p):
    want = flex_attention(
        *p["args"], enable_gqa=p["gqa"], return_lse=True, implementation="reference"
    )
    got = flex_attention_tiled(
        *p["args"],
        enable_gqa=p["gqa"],
        return_lse=True,
        block_k=p["block_k"],
        num_threads=p["num_threads"],
    )
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        assert_close(a, b, TOL[p["dtype"]])


# ---------------------------------------------------------------------------------------------
# PyTorch's FlexAttention (eager on CPU: the unfused path, exact in float64)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", PATHS)
def test_against_torch_flex_attention(torch, rng, implementation):
    B, Hq, Hkv, T, S = 2, 4, 2, 48, 64
    q, k, v = normal(rng, B, Hq, T, 8), normal(rng, B, Hkv, S, 8), normal(rng, B, Hkv, S, 4)
    slopes = np.array([0.5, 0.25, 0.125, 0.0625])
    lengths = np.array([40, 64])
    t_slopes, t_lengths = torch.from_numpy(slopes), torch.from_numpy(lengths)

    def t_score(score, b, h, i, j):
        return 5 * torch.tanh((score + t_slopes[h] * (j - i)) / 5)

    def t_mask(b, h, i, j):
        return (j < t_lengths[b]) & (i + 16 >= j)

    def score(score, b, h, i, j):
        return 5 * np.tanh((score + slopes[h] * (j - i)) / 5)

    def mask_mod(b, h, i, j):
        return (j < lengths[b]) & (i + 16 >= j)

    t_out, t_lse, t_mask_blocks = torch_flex(torch, q, k, v, t_score, t_mask, B=B, gqa=True)
    mask = create_block_mask(mask_mod, B, None, T, S, BLOCK_SIZE=16)
    out, lse = flex_attention(
        q, k, v, score, mask, enable_gqa=True, return_lse=True, implementation=implementation
    )
    np.testing.assert_allclose(out, t_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, t_lse, rtol=1e-12, atol=1e-12)
    # the block tables too, T and S being multiples of the block
    np.testing.assert_array_equal(mask.kv_num_blocks, t_mask_blocks.kv_num_blocks.numpy())
    np.testing.assert_array_equal(mask.full_kv_num_blocks, t_mask_blocks.full_kv_num_blocks.numpy())
    np.testing.assert_array_equal(mask.kv_indices, t_mask_blocks.kv_indices.numpy())
    np.testing.assert_array_equal(mask.full_kv_indices, t_mask_blocks.full_kv_indices.numpy())
    np.testing.assert_array_equal(mask.to_dense(), t_mask_blocks.to_dense().numpy() > 0)


@pytest.mark.parametrize("implementation", PATHS)
def test_against_torch_on_fully_masked_rows(torch, rng, implementation):
    q, k, v = normal(rng, 1, 2, 32, 4), normal(rng, 1, 2, 32, 4), normal(rng, 1, 2, 32, 4)
    t_out, t_lse, _ = torch_flex(torch, q, k, v, mask_mod=lambda b, h, i, j: (i < 20) & (j <= i))
    mask = create_block_mask(lambda b, h, i, j: (i < 20) & (j <= i), None, None, 32, 32, 16)
    out, lse = flex_attention(
        q, k, v, block_mask=mask, return_lse=True, implementation=implementation
    )
    np.testing.assert_allclose(out, t_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(lse[:, :, 20:], t_lse[:, :, 20:])  # -inf in both
    np.testing.assert_allclose(lse, t_lse, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Block masks
# ---------------------------------------------------------------------------------------------


def test_a_causal_mask_in_four_by_four_blocks():
    mask = create_block_mask(_causal, None, None, 64, 64, BLOCK_SIZE=16)
    assert mask.shape == (1, 1, 64, 64) and mask.BLOCK_SIZE == (16, 16)
    assert mask.sparsity() == 37.5  # 6 of 16 blocks above the diagonal
    np.testing.assert_array_equal(mask.to_dense()[0, 0], np.tri(4, dtype=bool))
    np.testing.assert_array_equal(
        mask.kinds[0, 0], np.tri(4, dtype=int) + np.tri(4, k=-1, dtype=int)
    )
    np.testing.assert_array_equal(mask.kv_num_blocks[0, 0], [1, 1, 1, 1])  # the diagonal
    np.testing.assert_array_equal(mask.full_kv_num_blocks[0, 0], [0, 1, 2, 3])
    np.testing.assert_array_equal(mask.full_kv_indices[0, 0, 3, :3], [0, 1, 2])
    np.testing.assert_array_equal(mask.kv_indices[0, 0, :, 0], [0, 1, 2, 3])
    assert repr(mask) == "BlockMask(shape=(1, 1, 64, 64), BLOCK_SIZE=(16, 16), sparsity=37.50%)"


def test_blocks_that_do_not_divide_the_lengths():
    # 10 x 7 entries in blocks of (4, 3): 3 x 3 blocks, the last row and column shorter.
    # Allowed: j <= i - 4. Query block 0 (rows 0-3) allows nothing. Block (1, 0) covers rows
    # 4-7, keys 0-2: row 4 allows key 0 only (partial); block (1, 1), keys 3-5: row 7 allows
    # key 3 only (partial). Block (2, 0), rows 8-9: keys 0-2 all allowed (full, though only
    # 2 rows long); (2, 1): row 8 stops at key 4 (partial); (2, 2), key 6: needs i >= 10.
    mask = create_block_mask(lambda b, h, i, j: j <= i - 4, None, None, 10, 7, BLOCK_SIZE=(4, 3))
    want = [[0, 0, 0], [1, 1, 0], [2, 1, 0]]
    np.testing.assert_array_equal(mask.kinds[0, 0], want)
    assert mask.to_dense().shape == (1, 1, 3, 3)
    assert mask.sparsity() == pytest.approx(100 * 5 / 9)


def test_a_mask_per_batch_entry_and_head_has_their_shape():
    lengths = np.array([3, 9])
    mask = create_block_mask(
        lambda b, h, i, j: (j < lengths[b]) & (j <= i + h), 2, 3, 8, 9, BLOCK_SIZE=(4, 3)
    )
    assert mask.shape == (2, 3, 8, 9)
    dense = mask.to_dense()
    assert dense.shape == (2, 3, 2, 3)
    assert not dense[0, :, :, 1:].any()  # keys 3 and up are padding in batch entry 0
    # batch entry 1, head 0: j <= i; query block 0 (rows 0-3) reaches key 3 (block 1)
    np.testing.assert_array_equal(dense[1, 0], [[1, 1, 0], [1, 1, 1]])
    assert mask.sparsity() == pytest.approx(100 * np.mean(~dense))


def test_create_block_mask_evaluates_a_long_mask_in_bands():
    # T = S = 4096 for 8 heads: the mod never sees more than about 2**22 entries at once.
    largest = []

    def causal(b, h, i, j):
        allowed = (i >= j) & (h >= 0)
        largest.append(allowed.size)
        return allowed

    mask = create_block_mask(causal, None, 8, 4096, 4096)
    assert max(largest) <= 2**22
    assert mask.sparsity() == pytest.approx(100 * (32 * 31 / 2) / 32**2)


def test_a_mod_that_ignores_b_and_h_is_evaluated_once_for_all():
    sizes = []

    def causal(b, h, i, j):
        sizes.append(np.broadcast_shapes(i.shape, j.shape))
        return i >= j

    create_block_mask(causal, 4, 8, 64, 64, BLOCK_SIZE=16)
    assert sizes == [(1, 1, 64, 64)]


def test_block_mask_arrays_are_read_only():
    mask = create_block_mask(_causal, None, None, 8, 8, BLOCK_SIZE=4)
    for name in ("kinds", "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        with pytest.raises(ValueError, match="read-only"):
            getattr(mask, name)[...] = 0


def test_the_mask_mod_is_kept():
    mask = create_block_mask(_causal, None, None, 8, 8)
    assert mask.mask_mod is _causal
    assert mask.BLOCK_SIZE == (128, 128)  # the default: here one block holds everything


# ---------------------------------------------------------------------------------------------
# Errors: one test per message
# ---------------------------------------------------------------------------------------------


def qkv(B=1, H=2, T=8, S=8):
    return np.ones((B, H, T, 4)), np.ones((B, H, S, 4)), np.ones((B, H, S, 3))


@pytest.mark.parametrize("name", ["query", "key", "value"])
def test_inputs_must_be_4d(name):
    arrays = dict(zip(("query", "key", "value"), qkv()))
    arrays[name] = arrays[name][0]
    with pytest.raises(ValueError, match=rf"{name} must be 4-D \(B, H, L, D\), as in torch's "):
        flex_attention(**arrays)


def test_query_and_key_must_share_dk():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="query and key must share the last dimension Dk"):
        flex_attention(q, k[..., :3], v)


def test_heads_that_differ_need_enable_gqa():
    q, k, v = np.ones((1, 4, 5, 2)), np.ones((1, 2, 5, 2)), np.ones((1, 2, 5, 2))
    with pytest.raises(ValueError, match=r"must broadcast \(pass enable_gqa=True"):
        flex_attention(q, k, v)


def test_score_mod_must_be_callable():
    with pytest.raises(
        TypeError,
        match=r"score_mod must be a callable score_mod\(score, b, h, q_idx, kv_idx\) -> array; "
        "got ndarray",
    ):
        flex_attention(*qkv(), score_mod=np.zeros(3))


def test_block_mask_must_be_a_block_mask():
    with pytest.raises(
        TypeError,
        match="block_mask must be a BlockMask made by sdpa.create_block_mask, or None; got ndarray",
    ):
        flex_attention(*qkv(), block_mask=np.ones((8, 8), dtype=bool))


@pytest.mark.parametrize(
    "B, H, T, S",
    [(None, None, 8, 9), (None, None, 7, 8), (2, None, 8, 8), (None, 3, 8, 8)],
    ids=["KV_LEN", "Q_LEN", "batch", "heads"],
)
def test_block_mask_must_fit_the_call(B, H, T, S):
    mask = create_block_mask(_causal, B, H, T, S)
    with pytest.raises(
        ValueError,
        match=rf"block_mask must fit the call: its shape \(B, H, Q_LEN, KV_LEN\) = "
        rf"\({B or 1}, {H or 1}, {T}, {S}\) against the call's \(B, Hq, T, S\) = \(1, 2, 8, 8\)",
    ):
        flex_attention(*qkv(), block_mask=mask)


@pytest.mark.parametrize("implementation", ["fast", None, "TILED"])
def test_implementation_must_be_known(implementation):
    with pytest.raises(
        ValueError, match=r"implementation must be 'auto', 'reference' or 'tiled'; got"
    ):
        flex_attention(*qkv(), implementation=implementation)


def test_return_lse_must_be_a_bool():
    with pytest.raises(TypeError, match="return_lse must be a bool; got 1"):
        flex_attention(*qkv(), return_lse=1)


def test_scale_must_be_finite():
    with pytest.raises(ValueError, match="scale must be a finite real number or None; got nan"):
        flex_attention(*qkv(), scale=float("nan"))


@pytest.mark.parametrize("implementation", ["reference", "tiled"])
def test_score_mod_must_return_real_scores(implementation):
    with pytest.raises(
        TypeError, match="score_mod must return real scores \\(a float array\\); got dtype bool"
    ):
        flex_attention(*qkv(), lambda s, b, h, i, j: s > 0, implementation=implementation)


@pytest.mark.parametrize("implementation", ["reference", "tiled"])
def test_score_mod_must_return_the_scores_shape(implementation):
    with pytest.raises(
        ValueError,
        match=r"score_mod must return an array of the shape of its scores \(1, [12], 8, 8\) \(or "
        r"one that broadcasts to it\); got shape \(3,\)",
    ):
        flex_attention(*qkv(), lambda s, b, h, i, j: np.zeros(3), implementation=implementation)


@pytest.mark.parametrize("implementation", ["reference", "tiled"])
def test_score_mod_must_return_something(implementation):
    def forgot_to_return(s, b, h, i, j):
        s + 1

    with pytest.raises(TypeError, match="score_mod's result must be an array; got None"):
        flex_attention(*qkv(), forgot_to_return, implementation=implementation)


def test_score_mod_may_return_a_scalar_or_another_dtype(rng):
    q = normal(rng, 1, 1, 4, 2, dtype=np.float32)
    for implementation in ("reference", "tiled"):
        out = flex_attention(q, q, q, lambda s, b, h, i, j: 0, implementation=implementation)
        np.testing.assert_allclose(out[0, 0], np.broadcast_to(q[0, 0].mean(0), (4, 2)), rtol=1e-6)
        out = flex_attention(q, q, q, lambda s, b, h, i, j: s.astype(np.float64))
        assert out.dtype == np.float32


def test_mask_mod_must_be_callable():
    with pytest.raises(
        TypeError,
        match=r"mask_mod must be a callable mask_mod\(b, h, q_idx, kv_idx\) -> bool array; got int",
    ):
        create_block_mask(3, None, None, 8, 8)


def test_mask_mod_must_return_bools():
    with pytest.raises(
        TypeError, match=r"mask_mod must return a bool array \(True = may attend\); got dtype int64"
    ):
        create_block_mask(lambda b, h, i, j: i - j, None, None, 8, 8)


def test_mask_mod_must_return_something():
    with pytest.raises(TypeError, match="mask_mod's result must be an array; got None"):
        create_block_mask(lambda b, h, i, j: None, None, None, 8, 8)


def test_mask_mod_must_return_the_index_shape():
    with pytest.raises(
        ValueError,
        match=r"mask_mod must return an array that broadcasts to the shape of its index arrays "
        r"\(b, h, q_idx, kv_idx\) = \(1, 1, 8, 8\); got shape \(8, 8, 2\)",
    ):
        create_block_mask(lambda b, h, i, j: np.ones((8, 8, 2), dtype=bool), None, None, 8, 8)


@pytest.mark.parametrize("name", ["B", "H"])
@pytest.mark.parametrize(
    "value, error", [(0, ValueError), (-2, ValueError), (2.0, TypeError), (True, TypeError)]
)
def test_batch_and_heads_must_be_positive_or_none(name, value, error):
    sizes = dict(B=None, H=None)
    sizes[name] = value
    with pytest.raises(error, match=rf"{name} must be a positive integer or None; got {value!r}"):
        create_block_mask(_causal, sizes["B"], sizes["H"], 8, 8)


@pytest.mark.parametrize("name", ["Q_LEN", "KV_LEN"])
@pytest.mark.parametrize("value, error", [(0, ValueError), (8.0, TypeError)])
def test_lengths_must_be_positive(name, value, error):
    sizes = dict(Q_LEN=8, KV_LEN=8)
    sizes[name] = value
    with pytest.raises(error, match=rf"{name} must be a positive integer; got {value!r}"):
        create_block_mask(_causal, None, None, **sizes)


@pytest.mark.parametrize(
    "block, error",
    [
        (0, ValueError),
        ((4, 0), ValueError),
        ((4, 4, 4), ValueError),
        (4.0, TypeError),
        (("4", 4), TypeError),
    ],
)
def test_block_size_must_be_positive_integers(block, error):
    with pytest.raises(
        error,
        match=r"BLOCK_SIZE must be a positive integer or a pair \(q, kv\) of positive "
        r"integers; got",
    ):
        create_block_mask(_causal, None, None, 8, 8, BLOCK_SIZE=block)


def test_block_mask_kinds_must_have_the_blocks_shape():
    with pytest.raises(
        ValueError,
        match=r"kinds must have the shape \(B, H, n_q, n_kv\) = \(1, 1, 2, 2\) of the blocks; "
        r"got kinds.shape=\(1, 1, 2, 3\)",
    ):
        BlockMask(_causal, (1, 1, 8, 8), (4, 4), np.zeros((1, 1, 2, 3), dtype=np.int8))


@pytest.mark.parametrize("name", ["block_k", "num_threads"])
@pytest.mark.parametrize("value, error", [(0, ValueError), (1.5, TypeError)])
def test_tiled_tunables_must_be_positive_integers(name, value, error):
    with pytest.raises(error, match=rf"{name} must be a positive integer; got {value!r}"):
        flex_attention_tiled(*qkv(), **{name: value})


def test_stats_must_be_flex_stats():
    with pytest.raises(TypeError, match="stats must be a FlexStats or None; got dict"):
        flex_attention_tiled(*qkv(), stats={})


@pytest.mark.parametrize("implementation", ["reference", "tiled"])
def test_scores_that_overflow_raise(implementation):
    q = np.full((1, 1, 4, 2), 3e19, dtype=np.float32)  # q . k = 1.8e39 > float32's 3.4e38
    with pytest.raises(ValueError, match="beyond the range of float32"):
        flex_attention(q, q, q, scale=1.0, implementation=implementation)


def test_the_reference_path_refuses_what_memory_cannot_hold():
    # (1, 2, 10**6, 10**6) float64 scores: 48 TB for three arrays. Broadcast views cost nothing.
    q = np.broadcast_to(np.zeros((1, 1, 1, 4)), (1, 2, 10**6, 4))
    with pytest.raises(
        MemoryError,
        match=r"the reference path's scores and weights of shape \(1, 2, 1000000, 1000000\) in "
        r"float64 would take about .* TiB .*; use implementation='tiled'",
    ):
        flex_attention(q, q, q, implementation="reference")


def test_the_public_names():
    for name in ("flex_attention", "create_block_mask", "BlockMask"):
        assert name in sdpa.__all__ and getattr(sdpa, name) is not None


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rows_that_see_no_key_do_not_undo_the_shift_zero(rng, dtype):
    # Query padding: the rows from 40 on see no key at all (out 0, lse -inf). Every unit starts
    # at the shift 0 and checks its rows' sums at the end: rows that meet no allowed key are
    # left out of that check (their sum is 0 by rights), so no unit is walked again.
    T, S = 64, 48

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx < 40) & (kv_idx <= q_idx + 8)

    q, k, v = normal(rng, 1, 2, T, 8), normal(rng, 1, 2, S, 8), normal(rng, 1, 2, S, 3)
    mask = create_block_mask(mask_mod, None, None, T, S, BLOCK_SIZE=16)
    stats = FlexStats()
    out, lse = flex_attention_tiled(
        *(x.astype(dtype) for x in (q, k, v)), block_mask=mask, return_lse=True, stats=stats
    )
    assert stats.redone == 0 and stats.masked > 0
    want_out, want_lse = explicit(q, k, v, allowed=mask_mod)
    assert_close(out, want_out, TOL[dtype])
    assert_close(lse, want_lse, TOL[dtype])
    assert np.all(out[:, :, 40:] == 0) and np.all(np.isneginf(lse[:, :, 40:]))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shift, holes, hkv", [(0, 0, 16), (128, 0, 16), (0, 3, 16), (256, 5, 8)])
def test_a_diagonal_in_squares_agrees_with_strips_and_the_reference(
    rng, monkeypatch, dtype, shift, holes, hkv
):
    # 1024 queries, blocks of 128, 16 query heads: units of four query blocks (two with two
    # query heads to a key head) walk their diagonal in squares of two blocks, pieces of
    # BLOCK_K_DIAGONAL keys each, batched over the squares. The keys may start `shift` before
    # the queries (the diagonal further in), and the mask may disallow every `holes`-th key
    # of a square too (squares that are not triangles).
    T, S, Hq = 1024, 1024 + shift, 16

    def mask_mod(b, h, q_idx, kv_idx):
        allowed = q_idx + shift >= kv_idx
        same_square = (kv_idx - shift) // 256 == q_idx // 256  # holes only there
        return allowed & ~(same_square & (kv_idx % holes == 1)) if holes else allowed

    q = normal(rng, 1, Hq, T, 16, dtype=dtype)
    k, v = (normal(rng, 1, hkv, S, 16, dtype=dtype) for _ in range(2))
    bm = create_block_mask(mask_mod, None, None, T, S)
    kw = dict(block_mask=bm, enable_gqa=hkv < Hq, return_aux=sdpa.AuxRequest(True, True))
    results = {}
    for name in ("squares", "strips"):
        if name == "strips":  # no diagonal pieces: the strips of BLOCK_K_BAND keys
            monkeypatch.setattr(sdpa.flex, "BLOCK_K_DIAGONAL", {})
        stats = FlexStats()
        results[name] = (*flex_attention_tiled(q, k, v, stats=stats, **kw), stats)
    out, aux, stats = results["squares"]
    assert stats.tiles > results["strips"][2].tiles  # the squares' pieces
    want, want_aux = flex_attention(q, k, v, implementation="reference", **kw)
    assert_close(out, want, TOL[dtype])
    assert_close(aux.lse, want_aux.lse, TOL[dtype])
    assert_close(aux.max_scores, want_aux.max_scores, TOL[dtype])
    assert_close(out, results["strips"][0], TOL[dtype])


def test_a_diagonal_in_squares_redoes_rows_far_below_zero(rng):
    # Rows 0:512 have scores about -60, too far below the shift 0 their units start at: they
    # are walked again from the exact step, squares and all.
    q, k, v = (normal(rng, 1, 16, 1024, 4) for _ in range(3))
    k[..., 0] = 1.0
    q[..., :512, 0] = -120.0  # scale 1/2: scores about -60
    bm = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 1024, 1024)
    stats = FlexStats()
    got = flex_attention_tiled(q, k, v, block_mask=bm, stats=stats)
    assert stats.redone > 0
    want, _, _ = attention_loop_2d(q[0, 3], k[0, 3], v[0, 3], np.tril(np.ones((1024, 1024), bool)))
    np.testing.assert_allclose(got[0, 3], want, rtol=2 * np.finfo(float).eps * 60, atol=1e-12)
