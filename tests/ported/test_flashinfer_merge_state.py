"""FlashInfer's merge-state and cascade tests, ported anew to sdpa.merge_attention_states.

Follows flashinfer-ai/flashinfer (commit fb28d72): ``tests/utils/test_triton_cascade.py``
(``merge_state``, ``merge_state_in_place``, ``merge_states``, ``variable_length_merge_states``),
``tests/trace/test_merge_state*_reference_correctness.py`` (their grids) and
``tests/attention/test_shared_prefix_kernels.py`` (``test_merge_state_in_place_with_mask``
and the shared-prefix cascade). Written anew in NumPy; what was kept and changed:

* **Base 2.** FlashInfer's states are ``(v, s)`` with ``s`` the log-sum-exp in BASE 2
  (``s = log2 sum_j 2^(x_j log2 e)``), while sdpa's ``lse`` is natural: the tests convert,
  ``lse = s * ln 2`` going in and ``s = lse / ln 2`` coming out, and their float64 reference
  is written in base 2 (``np.logaddexp2``, powers of 2), so a wrong conversion cannot cancel.
* **Layout.** FlashInfer's ``v`` is ``(seq_len, num_heads, head_dim)`` and ``s``
  ``(seq_len, num_heads)``: exactly sdpa's ``(..., Dv)`` and ``(...)``, used as they are;
  ``merge_states``' ``(seq_len, num_states, ...)`` is cut into a list along axis 1.
* **No in-place merge, no mask argument** in sdpa: ``merge_state_in_place(v, s, ...,
  mask=...)`` is ported as a merge that leaves its inputs untouched, and a row left out by
  the mask as a row whose other state is empty (``s = -inf``), which must return the row's
  own state exactly. (``+inf`` states are left to the vLLM port.)
* **Kept**: float16 ``v`` with float32 ``s``, their shapes where a CPU allows (the trace
  grids; 2048 rows -> 512, 100 states kept with fewer rows and heads; the cascade's sizes
  picked from its grid, not all combined), their tolerance
  (1e-3) for ``v``; tighter for ``s`` (1e-5), which sdpa computes in float32. The cascade:
  decode and append stages, shared prefix then unique keys, ``causal=False``, pages of 1
  and 16 tokens (through ``sdpa.PagedKVCache``, each request's whole sequence a fork of the
  prefix). Upstream compares two of FlashInfer's cascade kernels with each other; here the
  merge is compared with one attention call over the prefix and the request's keys.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from sdpa import PagedKVCache, merge_attention_states, scaled_dot_product_attention

LN2 = math.log(2.0)
V_TOL = dict(rtol=1e-3, atol=1e-3)  # FlashInfer's, for float16 v
S_TOL = dict(rtol=1e-5, atol=1e-5)  # s is float32 in and out
# A row merged with an empty state keeps its own: v exactly, s up to the two float32 roundings
# of the conversion to natural and back (s * ln 2 / ln 2).
KEPT_V = dict(rtol=0, atol=0)
KEPT_S = dict(rtol=2.5e-7, atol=0)


def merge_base2(vs, ss):
    """The reference: FlashInfer's states merged in float64, in base 2 throughout."""
    ss = [x.astype(np.float64) for x in ss]
    s = np.logaddexp2.reduce(ss, axis=0)  # log2 of the sum of the parts' 2^s
    v = sum(np.exp2(s_p - s)[..., None] * v_p.astype(np.float64) for v_p, s_p in zip(vs, ss))
    return v, s


def merge_state(vs, ss):
    """FlashInfer's call, through sdpa: base-2 states in, base-2 state out."""
    v, lse = merge_attention_states(list(vs), [s * LN2 for s in ss])
    return v, lse / LN2


def random_states(rng, P, seq_len, num_heads, head_dim):
    vs = [rng.standard_normal((seq_len, num_heads, head_dim)).astype(np.float16) for _ in range(P)]
    ss = [rng.standard_normal((seq_len, num_heads)).astype(np.float32) for _ in range(P)]
    return vs, ss


SHAPES = [(16, 4, 64), (7, 2, 64), (512, 32, 128)]  # the trace grids, and upstream's, cut


@pytest.mark.parametrize("seq_len,num_heads,head_dim", SHAPES)
def test_merge_state_of_two(rng, seq_len, num_heads, head_dim):
    vs, ss = random_states(rng, 2, seq_len, num_heads, head_dim)
    v, s = merge_state(vs, ss)
    v_ref, s_ref = merge_base2(vs, ss)
    assert v.dtype == np.float16 and s.dtype == np.float32
    np.testing.assert_allclose(v.astype(np.float64), v_ref, **V_TOL)
    np.testing.assert_allclose(s, s_ref, **S_TOL)


def test_the_states_are_base_two(rng):
    # Attention over keys a and b, each part's lse turned into FlashInfer's base-2 s: merging
    # the s's gives the base-2 s of the whole; feeding them to sdpa unconverted does not.
    q, k, v = (rng.standard_normal((3, 5, 8)) for _ in range(3))  # (H, T or S, D)
    parts = [
        scaled_dot_product_attention(q, k[:, c], v[:, c], return_lse=True)
        for c in (slice(0, 2), slice(2, 5))
    ]
    whole, whole_lse = scaled_dot_product_attention(q, k, v, return_lse=True)
    vs, ss = [o for o, _ in parts], [lse / LN2 for _, lse in parts]
    v_merged, s_merged = merge_state(vs, ss)
    np.testing.assert_allclose(v_merged, whole, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(s_merged, whole_lse / LN2, rtol=1e-12, atol=1e-12)
    unconverted, _ = merge_attention_states(vs, ss)
    assert not np.allclose(unconverted, whole, rtol=1e-3, atol=1e-3)


# ---------------------------------------------------------------------------------------------
# merge_state_in_place, with and without its mask
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seq_len,num_heads,head_dim", [(128, 32, 128), (17, 8, 64)])
def test_merge_state_in_place_leaves_the_inputs_and_matches_the_reference(
    rng, seq_len, num_heads, head_dim
):
    (v, v_other), (s, s_other) = random_states(rng, 2, seq_len, num_heads, head_dim)
    kept = [x.copy() for x in (v, s, v_other, s_other)]
    v_merged, s_merged = merge_state([v, v_other], [s, s_other])
    for before, after in zip(kept, (v, s, v_other, s_other)):
        np.testing.assert_array_equal(after, before)  # sdpa merges into new arrays
    v_ref, s_ref = merge_base2([v, v_other], [s, s_other])
    np.testing.assert_allclose(v_merged.astype(np.float64), v_ref, **V_TOL)
    np.testing.assert_allclose(s_merged, s_ref, **S_TOL)


def masked_merge(va, sa, vb, sb, mask):
    """``merge_state_in_place(va, sa, vb, sb, mask)`` through sdpa: a row the mask leaves out
    merges with an empty state (``s = -inf``), so it keeps its own."""
    sb_masked = np.where(mask[:, None], sb, -np.inf).astype(np.float32)
    return merge_state([va, vb], [sa, sb_masked])


def test_merge_state_in_place_with_mask(rng):
    seq_len, num_heads, head_dim, num_tries = 512, 8, 64, 10
    (va, vb), (sa, sb) = random_states(rng, 2, seq_len, num_heads, head_dim)
    v_all, s_all = merge_state([va, vb], [sa, sb])
    assert not np.allclose(v_all, va) and not np.allclose(s_all, sa)
    v_ones, s_ones = masked_merge(va, sa, vb, sb, np.ones(seq_len, bool))
    np.testing.assert_allclose(v_ones.astype(np.float64), v_all.astype(np.float64), **V_TOL)
    np.testing.assert_allclose(s_ones, s_all, **S_TOL)
    v_none, s_none = masked_merge(va, sa, vb, sb, np.zeros(seq_len, bool))
    np.testing.assert_allclose(v_none, va, **KEPT_V)  # the first state
    np.testing.assert_allclose(s_none, sa, **KEPT_S)
    for _ in range(num_tries):
        mask = rng.random(seq_len) > 0.5
        v, s = masked_merge(va, sa, vb, sb, mask)
        np.testing.assert_allclose(v[~mask], va[~mask], **KEPT_V)
        np.testing.assert_allclose(s[~mask], sa[~mask], **KEPT_S)
        np.testing.assert_allclose(v[mask].astype(np.float64), v_all[mask], **V_TOL)
        np.testing.assert_allclose(s[mask], s_all[mask], **S_TOL)


# ---------------------------------------------------------------------------------------------
# merge_states (many states) and variable_length_merge_states
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "seq_len,num_states,num_heads,head_dim", [(16, 3, 4, 64), (7, 2, 2, 64), (64, 100, 4, 32)]
)
def test_merge_states_of_many(rng, seq_len, num_states, num_heads, head_dim):
    v = rng.standard_normal((seq_len, num_states, num_heads, head_dim)).astype(np.float16)
    s = rng.standard_normal((seq_len, num_states, num_heads)).astype(np.float32)
    vs, ss = list(np.moveaxis(v, 1, 0)), list(np.moveaxis(s, 1, 0))  # a list of states
    v_merged, s_merged = merge_state(vs, ss)
    v_ref, s_ref = merge_base2(vs, ss)
    assert v_merged.shape == (seq_len, num_heads, head_dim)
    np.testing.assert_allclose(v_merged.astype(np.float64), v_ref, **V_TOL)
    np.testing.assert_allclose(s_merged, s_ref, **S_TOL)


def test_variable_length_merge_states(rng):
    # Row i merges its own number of states, indptr[i]:indptr[i + 1] of a flat list. With
    # sdpa: pad every row to the longest with empty states (s = -inf, v = NaN: never read).
    seq_len, max_index_sets, num_heads, head_dim = 32, 40, 4, 16
    lengths = rng.integers(1, max_index_sets, size=seq_len)
    indptr = np.concatenate([[0], np.cumsum(lengths)])
    v = rng.standard_normal((indptr[-1], num_heads, head_dim)).astype(np.float16)
    s = rng.standard_normal((indptr[-1], num_heads)).astype(np.float32)
    P = lengths.max()
    v_pad = np.full((P, seq_len, num_heads, head_dim), np.nan, np.float16)
    s_pad = np.full((P, seq_len, num_heads), -np.inf, np.float32)
    for i in range(seq_len):
        v_pad[: lengths[i], i] = v[indptr[i] : indptr[i + 1]]
        s_pad[: lengths[i], i] = s[indptr[i] : indptr[i + 1]]
    v_merged, s_merged = merge_state(v_pad, s_pad)
    for i in range(seq_len):
        rows = slice(indptr[i], indptr[i + 1])
        v_row, s_row = merge_state(v[rows], s[rows])  # this row's states alone
        np.testing.assert_allclose(v_merged[i], v_row, rtol=0, atol=1e-3)
        np.testing.assert_allclose(s_merged[i], s_row, **S_TOL)
        v_ref, s_ref = merge_base2(list(v[rows]), list(s[rows]))
        np.testing.assert_allclose(v_merged[i].astype(np.float64), v_ref, **V_TOL)
        np.testing.assert_allclose(s_merged[i], s_ref, **S_TOL)


# ---------------------------------------------------------------------------------------------
# Shared-prefix cascade: the prefix attended once by every query, merged with each request's
# own keys (test_batch_attention_with_shared_prefix_paged_kv_cache, without the paged cache)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", ["decode", "append"])
@pytest.mark.parametrize(
    "batch_size,unique_kv_len,shared_kv_len,num_heads,head_dim",
    [(12, 37, 128, 8, 128), (17, 17, 512, 8, 64), (5, 37, 2048, 2, 256)],
)
def test_shared_prefix_cascade_equals_attention_over_the_whole(
    rng, stage, batch_size, unique_kv_len, shared_kv_len, num_heads, head_dim
):
    T = 1 if stage == "decode" else unique_kv_len  # queries per request
    half = dict(dtype=np.float16)
    q = rng.standard_normal((batch_size, num_heads, T, head_dim)).astype(**half)
    k_shared, v_shared = (
        rng.standard_normal((1, num_heads, shared_kv_len, head_dim)).astype(**half)
        for _ in range(2)
    )
    k_unique, v_unique = (
        rng.standard_normal((batch_size, num_heads, unique_kv_len, head_dim)).astype(**half)
        for _ in range(2)
    )
    # The two levels: the prefix once for every request's queries, then each request's keys.
    o_shared, lse_shared = scaled_dot_product_attention(q, k_shared, v_shared, return_lse=True)
    o_unique, lse_unique = scaled_dot_product_attention(q, k_unique, v_unique, return_lse=True)
    # FlashInfer's states are base 2: convert to theirs and back, as its merge_state would see.
    s_shared, s_unique = lse_shared / LN2, lse_unique / LN2
    o, s = merge_state([o_shared, o_unique], [s_shared, s_unique])
    k_all = np.concatenate(
        [np.broadcast_to(k_shared, (batch_size, *k_shared.shape[1:])), k_unique], axis=-2
    )
    v_all = np.concatenate(
        [np.broadcast_to(v_shared, (batch_size, *v_shared.shape[1:])), v_unique], axis=-2
    )
    whole, whole_lse = scaled_dot_product_attention(q, k_all, v_all, return_lse=True)
    np.testing.assert_allclose(o.astype(np.float64), whole.astype(np.float64), **V_TOL)
    np.testing.assert_allclose(s * LN2, whole_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("stage", ["decode", "append"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_shared_prefix_cascade_through_a_paged_cache(rng, stage, page_size):
    # Upstream's paged layout: the prefix stored once, each request's keys in pages of its own;
    # a request's whole sequence is a fork of the prefix (its pages shared, not copied).
    batch_size, unique_kv_len, shared_kv_len, num_heads, head_dim = 12, 37, 128, 8, 64
    assert shared_kv_len % page_size == 0
    T = 1 if stage == "decode" else unique_kv_len
    pages = shared_kv_len // page_size + 2 * batch_size * -(-unique_kv_len // page_size)
    cache = PagedKVCache(pages, page_size, num_heads, head_dim, dtype=np.float16)
    shared = cache.new_sequence()
    cache.append(shared, *rng.standard_normal((2, num_heads, shared_kv_len, head_dim)))
    for _ in range(batch_size):
        k_unique, v_unique = rng.standard_normal((2, num_heads, unique_kv_len, head_dim))
        unique, whole = cache.new_sequence(), cache.fork(shared)
        cache.append(unique, k_unique, v_unique)
        cache.append(whole, k_unique, v_unique)
        n_shared = shared_kv_len // page_size
        assert cache.block_table(whole)[:n_shared] == cache.block_table(shared)
        q = rng.standard_normal((num_heads, T, head_dim)).astype(np.float16)
        o_shared, lse_shared = cache.attend(shared, q, return_lse=True)
        o_unique, lse_unique = cache.attend(unique, q, return_lse=True)
        o, s = merge_state([o_shared, o_unique], [lse_shared / LN2, lse_unique / LN2])
        o_whole, lse_whole = cache.attend(whole, q, return_lse=True)
        np.testing.assert_allclose(o.astype(np.float64), o_whole.astype(np.float64), **V_TOL)
        np.testing.assert_allclose(s * LN2, lse_whole, rtol=1e-5, atol=1e-5)
