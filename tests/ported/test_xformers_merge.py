"""xformers' split-K merge tests, ported anew to sdpa.merge_attention_states.

Follows facebookresearch/xformers ``tests/test_fmha_merge_attentions.py`` (commit ca6d2aa),
which tests ``merge_attentions`` of ``xformers/ops/fmha/__init__.py``: attention over chunks
of the keys (``memory_efficient_attention_partial``, an output and an lse per chunk), merged,
equals attention over all the keys. Written anew in NumPy; what was kept and changed:

* kept: the four checks (a part merged with itself; split-K decoding with ten random chunks,
  padded keys per sequence and a causal last chunk; a cascade of a shared prefix and each
  sequence's own keys; 16 random parts against the merge formula), their number of parts,
  their query counts, the optional group axis ``G``, keys shared by the heads, and their
  tolerances (1e-3; 1e-2 / 2e-3 for the cascade's out; 1e-4 against the formula);
* changed: bfloat16 (NumPy has none) becomes float16 and float32; the sizes are cut for a
  CPU (``B`` 128 -> 8, ``MAX_T`` 8192 -> 512, ``D`` 128/192 -> 32/64, 100000 keys -> 2000;
  ``D`` 128 -> 32 for the 16 random parts);
  sdpa's layout is ``(..., T, Dv)`` with lse ``(..., T)``, so xformers' ``(B, M, G, H, K)``
  outputs are moved to ``(B, G, H, M, K)`` before merging; sdpa's merge takes a list of
  parts (a stacked array is refused: the ``stack_inputs`` case checks that) and always
  returns the lse (no ``write_lse``), has no ``output_dtype``, no in-place or ``out=``
  variant, and no backward (``merge_attentions_autograd`` is not ported). A part with no
  key (lse ``-inf``, the cascade's third sequence in the shared part) contributes nothing.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from sdpa import merge_attention_states, scaled_dot_product_attention

TOL = dict(rtol=1e-3, atol=1e-3)  # xformers' tolerance for out and lse


def attend(q, k, v, mask=None):
    return scaled_dot_product_attention(q, k, v, mask, return_lse=True)


# ---------------------------------------------------------------------------------------------
# test_merge_attentions_nobias: merging the same attention twice changes nothing
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("M", [5, 2000])
@pytest.mark.parametrize("G,H", [(1, 11), (7, 1), (1, 1), (7, 11), (None, 11)])
def test_a_part_merged_with_itself_keeps_out_and_adds_log_two_to_lse(rng, dtype, M, G, H):
    B, Mq, K = 3, 3, 64
    heads = (H,) if G is None else (G, H)
    one = (1,) if G is None else (G, 1)  # keys and values shared by the H heads
    q = (3 * rng.random((B, *heads, Mq, K))).astype(dtype)
    k = (3 * rng.random((B, *one, M, K))).astype(dtype)
    v = (3 * rng.random((B, *one, M, K))).astype(dtype)
    out1, lse1 = attend(q, k, v)
    assert out1.shape == q.shape and lse1.shape == q.shape[:-1]
    out, lse = merge_attention_states([out1, out1], [lse1, lse1])
    assert out.shape == out1.shape and out.dtype == out1.dtype
    np.testing.assert_allclose(out.astype(np.float64), out1.astype(np.float64), **TOL)
    np.testing.assert_allclose(lse, lse1.astype(np.float64) + math.log(2), **TOL)


def test_stacked_parts_are_refused_and_their_list_is_merged(rng):
    # xformers also takes the parts stacked on a new first axis; sdpa takes a list only.
    out1 = rng.standard_normal((2, 3, 4))
    lse1 = rng.standard_normal((2, 3))
    with pytest.raises(TypeError, match=r"outputs must be a list or tuple of arrays"):
        merge_attention_states(np.stack([out1, out1]), [lse1, lse1])
    out, lse = merge_attention_states(list(np.stack([out1, out1])), list(np.stack([lse1, lse1])))
    np.testing.assert_allclose(out, out1, rtol=1e-15, atol=1e-15)
    np.testing.assert_allclose(lse, lse1 + math.log(2), rtol=1e-15, atol=1e-15)


# ---------------------------------------------------------------------------------------------
# test_merge_attentions_decoding: ten random chunks of a padded, causal key sequence
# ---------------------------------------------------------------------------------------------


def decoding_mask(k_lens, num_queries, lo, hi):
    """(B, 1, 1, Mq, hi - lo): key ``lo + j`` is in sequence ``b`` (``< k_lens[b]``) and at or
    before the query (query ``i`` sits at position ``k_lens[b] - num_queries + i``)."""
    j = np.arange(lo, hi)
    i = np.arange(num_queries)
    lens = np.asarray(k_lens)[:, None, None]
    allowed = (j[None, None, :] < lens) & (j[None, None, :] <= lens - num_queries + i[:, None])
    return allowed[:, None, None]


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("num_queries", [1, 2])
@pytest.mark.parametrize("bmghk", [True, False], ids=["bmghk", "bmhk"])
def test_split_k_decoding_equals_one_call_over_all_keys(dtype, num_queries, bmghk):
    MAX_T, B, N_H_L, D_H, num_chunks = 512, 8, 4, 32, 10
    G = 2 if bmghk else 1
    rng = np.random.default_rng(1)
    starts = sorted(rng.integers(1, MAX_T // 2, size=num_chunks).tolist())
    starts[0] = 0
    starts.append(MAX_T)
    # Every sequence reaches into the last chunk by at least num_queries keys, as upstream.
    k_lens = rng.integers(starts[-2] + num_queries, MAX_T, size=B)
    q = rng.standard_normal((B, G, N_H_L, num_queries, D_H)).astype(dtype)
    k = rng.standard_normal((B, G, 1, MAX_T, D_H)).astype(dtype)  # one head of keys (MQA)
    v = rng.standard_normal((B, G, 1, MAX_T, D_H)).astype(dtype)
    if not bmghk:
        q, k, v = q[:, 0], k[:, 0], v[:, 0]
    outs, lses = [], []
    for lo, hi in zip(starts[:-1], starts[1:]):
        mask = decoding_mask(k_lens, num_queries, lo, hi)
        out, lse = attend(q, k[..., lo:hi, :], v[..., lo:hi, :], mask if bmghk else mask[:, 0])
        assert out.shape == q.shape and lse.shape == q.shape[:-1]
        outs.append(out)
        lses.append(lse)
    out, lse = merge_attention_states(outs, lses)
    mask = decoding_mask(k_lens, num_queries, 0, MAX_T)
    whole, whole_lse = attend(q, k, v, mask if bmghk else mask[:, 0])
    np.testing.assert_allclose(lse, whole_lse, **TOL)
    np.testing.assert_allclose(out.astype(np.float64), whole.astype(np.float64), **TOL)


# ---------------------------------------------------------------------------------------------
# test_merge_attentions_sharedinput: a shared prefix attended once, then each sequence's rest
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
def test_a_shared_prefix_and_each_sequences_rest_merge_to_the_whole(rng, dtype, gqa):
    MAX_T, N_H_L, D_H, G = 64, 16, 64, 2
    shared_length, full_lengths = 20, [30, 35, 40]
    q = rng.standard_normal((3, G, N_H_L, 1, D_H)).astype(dtype)  # one query per sequence
    k = rng.standard_normal((3, G, 1 if gqa else N_H_L, MAX_T, D_H)).astype(dtype)
    v = rng.standard_normal(k.shape).astype(dtype)
    # Sequences 0 and 1 share their first 20 keys; sequence 2 shares nothing.
    k[1, ..., :shared_length, :] = k[0, ..., :shared_length, :]
    v[1, ..., :shared_length, :] = v[0, ..., :shared_length, :]
    pre = slice(0, shared_length)
    in_prefix = np.array([True, True, False])[:, None, None, None, None]
    out1, lse1 = attend(q, k[:1, ..., pre, :], v[:1, ..., pre, :], in_prefix)
    assert np.all(lse1[2] == -np.inf)  # sequence 2 has no key in the shared part
    # The second part: each sequence's keys after the prefix (all of sequence 2's), padded.
    first = [shared_length, shared_length, 0]
    rest = max(n - a for n, a in zip(full_lengths, first))
    k2 = np.stack([k[b, ..., first[b] : first[b] + rest, :] for b in range(3)])
    v2 = np.stack([v[b, ..., first[b] : first[b] + rest, :] for b in range(3)])
    lengths = np.array([n - a for n, a in zip(full_lengths, first)])
    in_rest = (np.arange(rest) < lengths[:, None])[:, None, None, None, :]
    out2, lse2 = attend(q, k2, v2, in_rest)
    out, lse = merge_attention_states([out1, out2], [lse1, lse2])
    in_full = (np.arange(MAX_T) < np.array(full_lengths)[:, None])[:, None, None, None, :]
    whole, whole_lse = attend(q, k, v, in_full)
    np.testing.assert_allclose(
        out.astype(np.float64), whole.astype(np.float64), rtol=1e-2, atol=2e-3
    )
    np.testing.assert_allclose(lse, whole_lse, **TOL)


# ---------------------------------------------------------------------------------------------
# test_merge_attentions_against_ref: random parts against the formula, in float64
# ---------------------------------------------------------------------------------------------


def merge_formula(attn_split, lse_split):
    """The merge from its definition in float64: parts on axis 0, lse of shape out[..., 0]."""
    attn = attn_split.astype(np.float64)
    lse = lse_split.astype(np.float64)
    m = lse.max(axis=0)
    e = np.exp(lse - m)
    total = e.sum(axis=0)
    return (e[..., None] * attn).sum(axis=0) / total[..., None], m + np.log(total)


@pytest.mark.parametrize("bmghk", [True, False], ids=["bmghk", "bmhk"])
def test_sixteen_random_parts_against_the_formula(rng, bmghk):
    split_k, B, M, N_H_L, D_H = 16, 12, 137, 8, 32  # D_H 128 -> 32: 215 MB -> 54 MB
    G = 2 if bmghk else 1
    # xformers' layout: outputs (split_k, B, M, G, H, K), lses (split_k, B, G, H, M).
    attn_split = rng.standard_normal((split_k, B, M, G, N_H_L, D_H)).astype(np.float32)
    lse_split = rng.standard_normal((split_k, B, G, N_H_L, M)).astype(np.float32)
    if not bmghk:
        attn_split, lse_split = attn_split[:, :, :, 0], lse_split[:, :, 0]
    # sdpa's: the query axis M next to the last, (B, G, H, M, K) and (B, G, H, M).
    attn_parts = np.moveaxis(attn_split, 2, -2)
    out, lse = merge_attention_states(list(attn_parts), list(lse_split))
    out_ref, lse_ref = merge_formula(attn_parts, lse_split)
    assert out.dtype == np.float32 and lse.dtype == np.float32
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out, out_ref, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# test_merge_attention_with_compile: one part merges to itself
# ---------------------------------------------------------------------------------------------


def test_one_part_merges_to_itself_as_a_new_array(rng):
    q, k, v = (rng.standard_normal((2, 3, n, 8)) for n in (4, 7, 7))
    out1, lse1 = attend(q, k, v)
    out, lse = merge_attention_states([out1], [lse1])
    np.testing.assert_allclose(out, out1, rtol=0, atol=0)
    np.testing.assert_allclose(lse, lse1, rtol=0, atol=0)
    assert not np.shares_memory(out, out1) and not np.shares_memory(lse, lse1)
