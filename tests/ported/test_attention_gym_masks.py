"""attention-gym's mask tests, ported anew: the masks of tests/mods.py, their block masks and
flex_attention with each.

Follows meta-pytorch/attention-gym (commit 7fdb85d): the mask generators of
``attn_gym/masks/`` (causal, sliding_window, prefix_lm, document_mask, dilated_sliding_window,
global_sliding_window) and score mods of ``attn_gym/mods/`` (alibi, softcapping), re-written
in NumPy in ``tests/mods.py``, and the tests ``test/test_causal_block_mask.py``,
``test/test_document_mask.py`` and ``test/test_global_sliding_window.py``. Written anew;
what was kept and changed:

* kept: their grids (causal block masks for lengths 128, 256, 512, 232, blocks 64 and 128,
  batch 1 and 2, heads 1 and 4; document lengths [3, 2, 5], [1, 4, 1, 7], [6]; global
  windows 1, 3, 8 with global tokens none, [0], [0, 7, 15]; flex against plain attention
  at length 256, window 16, global tokens 0 and 100, tolerance 2e-3) and the edge cases
  (keys longer than queries, a sequence shorter than a block);
* changed: attention-gym compares its fast causal block mask with PyTorch's
  ``create_block_mask``; here ``sdpa.create_block_mask`` is compared with the block kinds
  counted by hand (loops over a mask built from the definitions, or the causal closed
  form). sdpa may mark a shorter last block full, where PyTorch never does (documented),
  so the counts follow sdpa's rule. No backward (flex_attention has none in sdpa), no GPU.
* added: every mask (chunked causal too, which attention-gym lacks) against a mask built
  with loops, its ``__name__``, the hand-made ``and_masks``/``or_masks`` (sdpa has none),
  block counts for each mask, and ``sdpa.flex_attention`` on both paths (reference and
  tiled) against the float64 loop of tests/references.py with the dense boolean mask.
"""

from __future__ import annotations

import math

import mods
import numpy as np
import pytest
from references import attention_loop_2d

from sdpa import create_block_mask, flex_attention, scaled_dot_product_attention

# ---------------------------------------------------------------------------------------------
# The masks by hand: one (i, j) at a time, from the definitions
# ---------------------------------------------------------------------------------------------


def by_loop(rule, T, S):
    allowed = np.zeros((T, S), dtype=bool)
    for i in range(T):
        for j in range(S):
            allowed[i, j] = rule(i, j)
    return allowed


def doc_of(lengths, position):
    """The document holding ``position``, and where it starts, by walking the lengths."""
    start = 0
    for d, n in enumerate(lengths):
        if position < start + n:
            return d, start
        start += n
    raise AssertionError(f"position {position} is beyond the documents {lengths}")


def same_doc_rule(lengths, inner):
    def rule(i, j):
        (di, si), (dj, sj) = doc_of(lengths, i), doc_of(lengths, j)
        return di == dj and inner(i - si, j - sj)

    return rule


LENGTHS = [5, 1, 9, 3, 12]  # 30 positions in 5 documents
GLOBAL = [0, 13, 29]


def global_rule(w, positions):
    return lambda i, j: abs(i - j) <= w or i in positions or j in positions


# (mask_mod, the same rule by hand, T, S): rectangular where the mask allows it.
CASES = {
    "causal": (mods.causal_mask, lambda i, j: j <= i, 11, 17),
    "sliding_window_3": (mods.generate_sliding_window(3), lambda i, j: 0 <= i - j <= 3, 23, 19),
    "prefix_lm_4": (mods.generate_prefix_lm_mask(4), lambda i, j: j < 4 or j <= i, 13, 21),
    "dilated_4_2": (
        mods.generate_dilated_sliding_window(4, 2),
        lambda i, j: abs(i - j) <= 4 and abs(i - j) % 2 == 0,
        24,
        24,
    ),
    "chunked_causal_4": (
        mods.generate_chunked_causal(4),
        lambda i, j: i // 4 == j // 4 and j <= i,
        22,
        22,
    ),
    "document_causal": (
        mods.generate_doc_mask_mod(mods.causal_mask, mods.length_to_offsets(LENGTHS)),
        same_doc_rule(LENGTHS, lambda i, j: j <= i),
        30,
        30,
    ),
    "document_sliding_window_2": (
        mods.generate_doc_mask_mod(
            mods.generate_sliding_window(2), mods.length_to_offsets(LENGTHS)
        ),
        same_doc_rule(LENGTHS, lambda i, j: 0 <= i - j <= 2),
        30,
        30,
    ),
    "packed_causal_document": (
        mods.generate_packed_causal_doc_mask_mod(mods.length_to_offsets(LENGTHS)),
        same_doc_rule(LENGTHS, lambda i, j: j <= i),
        30,
        30,
    ),
    "global_sliding_window_2": (
        mods.generate_global_sliding_window(2, np.isin(np.arange(30), GLOBAL)),
        global_rule(2, GLOBAL),
        30,
        30,
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_each_mask_equals_its_definition_by_loops(case):
    mask_mod, rule, T, S = CASES[case]
    np.testing.assert_array_equal(mods.dense_mask(mask_mod, 2, 3, T, S)[1, 2], by_loop(rule, T, S))


def test_each_generated_mod_is_named_for_what_it_is():
    names = {
        mods.generate_sliding_window(3): "sliding_window_3",
        mods.generate_prefix_lm_mask(4): "prefix_lm_causal_mask_4",
        mods.generate_dilated_sliding_window(4, 2): "dilated_sliding_window_4_dilation_2",
        mods.generate_chunked_causal(8): "chunked_causal_8",
        mods.generate_global_sliding_window(3, [True, False]): "global_sliding_window_3",
        mods.generate_doc_mask_mod(mods.causal_mask, [0, 2]): "document_causal_mask",
        mods.generate_alibi_bias(4): "alibi_4_heads",
        mods.generate_tanh_softcap(30.0): "tanh_softcap_30",
    }
    assert [mod.__name__ for mod in names] == list(names.values())


# ---------------------------------------------------------------------------------------------
# Upstream's mask tests
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lengths", [[3, 2, 5], [1, 4, 1, 7], [6]])
def test_packed_causal_document_mask_equals_the_generic_one(lengths):
    offsets = mods.length_to_offsets(lengths)
    n = int(offsets[-1])
    packed = mods.dense_mask(mods.generate_packed_causal_doc_mask_mod(offsets), 1, 1, n, n)
    generic = mods.dense_mask(mods.generate_doc_mask_mod(mods.causal_mask, offsets), 1, 1, n, n)
    np.testing.assert_array_equal(packed, generic)
    np.testing.assert_array_equal(
        packed[0, 0], by_loop(same_doc_rule(lengths, lambda i, j: j <= i), n, n)
    )


@pytest.mark.parametrize("window_size", [1, 3, 8])
@pytest.mark.parametrize("global_positions", [[], [0], [0, 7, 15]])
def test_global_sliding_window_equals_its_definition(window_size, global_positions):
    is_global = np.zeros(16, dtype=bool)
    is_global[global_positions] = True
    mask_mod = mods.generate_global_sliding_window(window_size, is_global)
    expected = by_loop(global_rule(window_size, global_positions), 16, 16)
    np.testing.assert_array_equal(mods.dense_mask(mask_mod, 1, 1, 16, 16)[0, 0], expected)


def causal_kinds_closed_form(T, S, bq, bkv):
    """Causal block kinds from the block corners: empty when its first key is after its last
    query, full when its last key is at or before its first query (sdpa's rule, which counts
    a shorter last block as full when all its entries are allowed)."""
    kinds = np.ones((-(-T // bq), -(-S // bkv)), dtype=int)
    for m in range(kinds.shape[0]):
        first_q, last_q = m * bq, min(T, (m + 1) * bq) - 1
        for n in range(kinds.shape[1]):
            first_k, last_k = n * bkv, min(S, (n + 1) * bkv) - 1
            if first_k > last_q:
                kinds[m, n] = 0
            elif last_k <= first_q:
                kinds[m, n] = 2
    return kinds


@pytest.mark.parametrize("seq_len", [128, 256, 512, 232])
@pytest.mark.parametrize("block_size", [64, 128])
@pytest.mark.parametrize("batch_size", [1, 2])
@pytest.mark.parametrize("num_heads", [1, 4])
def test_causal_block_mask_correctness(seq_len, block_size, batch_size, num_heads):
    mask = create_block_mask(
        mods.causal_mask, batch_size, num_heads, seq_len, seq_len, BLOCK_SIZE=block_size
    )
    kinds = causal_kinds_closed_form(seq_len, seq_len, block_size, block_size)
    assert mask.shape == (batch_size, num_heads, seq_len, seq_len)
    expected = np.broadcast_to(kinds, (batch_size, num_heads, *kinds.shape))
    np.testing.assert_array_equal(mask.kinds, expected)
    np.testing.assert_array_equal(mask.to_dense(), expected > 0)
    np.testing.assert_allclose(mask.sparsity(), 100 * np.mean(kinds == 0), rtol=1e-12)


def test_causal_block_mask_edge_cases():
    mask = create_block_mask(mods.causal_mask, 1, 1, 100, 150, BLOCK_SIZE=64)
    assert mask.shape == (1, 1, 100, 150)
    np.testing.assert_array_equal(mask.kinds[0, 0], causal_kinds_closed_form(100, 150, 64, 64))
    short = create_block_mask(mods.causal_mask, 1, 1, 32, 32, BLOCK_SIZE=64)
    assert short.shape == (1, 1, 32, 32)
    np.testing.assert_array_equal(short.kinds, [[[[1]]]])  # one block, partly allowed


# ---------------------------------------------------------------------------------------------
# and_masks / or_masks, composed by hand in tests/mods.py
# ---------------------------------------------------------------------------------------------


def test_and_masks_and_or_masks_combine_entry_by_entry():
    chunked = mods.generate_chunked_causal(5)
    window = mods.generate_dilated_sliding_window(6, 3)
    a, b = (mods.dense_mask(m, 1, 1, 20, 20) for m in (chunked, window))
    both = mods.dense_mask(mods.and_masks(chunked, window), 1, 1, 20, 20)
    either = mods.dense_mask(mods.or_masks(chunked, window), 1, 1, 20, 20)
    np.testing.assert_array_equal(both, a & b)
    np.testing.assert_array_equal(either, a | b)
    assert both.sum() < a.sum() and either.sum() > b.sum()  # neither is one of the parts
    with pytest.raises(ValueError, match="at least one mask_mod"):
        mods.and_masks()
    with pytest.raises(ValueError, match="at least one mask_mod"):
        mods.or_masks()


# ---------------------------------------------------------------------------------------------
# Block masks of every mask: kinds and counts by hand
# ---------------------------------------------------------------------------------------------


def kinds_by_hand(allowed, bq, bkv):
    """Count each block's allowed entries: none -> empty 0, all -> full 2, else partial 1."""
    T, S = allowed.shape
    kinds = np.zeros((-(-T // bq), -(-S // bkv)), dtype=int)
    for m in range(kinds.shape[0]):
        for n in range(kinds.shape[1]):
            block = allowed[m * bq : (m + 1) * bq, n * bkv : (n + 1) * bkv]
            count = sum(bool(x) for x in block.flat)
            kinds[m, n] = 0 if count == 0 else 2 if count == block.size else 1
    return kinds


@pytest.mark.parametrize("block", [(4, 4), (8, 3), (5, 8)], ids=str)
@pytest.mark.parametrize("case", CASES)
def test_block_mask_of_each_mask_counts_its_blocks(case, block):
    mask_mod, rule, T, S = CASES[case]
    kinds = kinds_by_hand(by_loop(rule, T, S), *block)
    mask = create_block_mask(mask_mod, None, None, T, S, BLOCK_SIZE=block)
    np.testing.assert_array_equal(mask.kinds[0, 0], kinds)
    np.testing.assert_array_equal(mask.kv_num_blocks[0, 0], (kinds == 1).sum(axis=1))
    np.testing.assert_array_equal(mask.full_kv_num_blocks[0, 0], (kinds == 2).sum(axis=1))
    for m, row in enumerate(kinds):
        partial, full = np.flatnonzero(row == 1), np.flatnonzero(row == 2)
        np.testing.assert_array_equal(mask.kv_indices[0, 0, m, : len(partial)], partial)
        np.testing.assert_array_equal(mask.full_kv_indices[0, 0, m, : len(full)], full)
    np.testing.assert_allclose(mask.sparsity(), 100 * np.mean(kinds == 0), rtol=1e-12)


# ---------------------------------------------------------------------------------------------
# flex_attention with each mask, both paths, against the float64 loop
# ---------------------------------------------------------------------------------------------


def loop_reference(q, k, v, allowed, bias=None):
    """``attention_loop_2d`` on every (b, h) slice; ``bias`` (H, T, S) per head if given."""
    out = np.zeros((*q.shape[:-1], v.shape[-1]))
    lse = np.zeros(q.shape[:-1])
    for b, h in np.ndindex(*q.shape[:2]):
        bias_h = None if bias is None else bias[h]
        out[b, h], _, lse[b, h] = attention_loop_2d(q[b, h], k[b, h], v[b, h], allowed, bias_h)
    return out, lse


@pytest.mark.parametrize("implementation", ["reference", "tiled"])
@pytest.mark.parametrize("case", CASES)
def test_flex_attention_with_each_mask_equals_the_loop(rng, case, implementation):
    mask_mod, rule, T, S = CASES[case]
    q = rng.standard_normal((2, 2, T, 8))
    k, v = rng.standard_normal((2, 2, S, 8)), rng.standard_normal((2, 2, S, 5))
    block_mask = create_block_mask(mask_mod, None, None, T, S, BLOCK_SIZE=4)
    out, lse = flex_attention(
        q, k, v, block_mask=block_mask, return_lse=True, implementation=implementation
    )
    out_ref, lse_ref = loop_reference(q, k, v, by_loop(rule, T, S))
    np.testing.assert_allclose(out, out_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("implementation", ["reference", "tiled"])
@pytest.mark.parametrize("score", ["alibi", "softcap"])
def test_flex_attention_with_a_score_mod_and_a_mask_equals_the_loop(rng, score, implementation):
    H, T, Dk, cap = 4, 21, 8, 0.7
    q, k, v = (rng.standard_normal((1, H, T, Dk)) for _ in range(3))
    mask_mod = mods.generate_prefix_lm_mask(5)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    if score == "alibi":
        score_mod = mods.generate_alibi_bias(H)
        bias = np.stack([2.0 ** (-8 * (h + 1) / H) * (j - i) for h in range(H)])
    else:  # the capped score minus the plain one, in float64: a bias the loop adds
        score_mod = mods.generate_tanh_softcap(cap)
        s = np.einsum("htd,hsd->hts", q[0], k[0]) / math.sqrt(Dk)
        bias = cap * np.tanh(s / cap) - s
    block_mask = create_block_mask(mask_mod, None, None, T, T, BLOCK_SIZE=4)
    out, lse = flex_attention(
        q, k, v, score_mod, block_mask, return_lse=True, implementation=implementation
    )
    allowed = by_loop(lambda a, b: b < 5 or b <= a, T, T)
    out_ref, lse_ref = loop_reference(q, k, v, allowed, np.broadcast_to(bias, (H, T, T)))
    np.testing.assert_allclose(out, out_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-12, atol=1e-12)


def global_window_problem(rng):
    seq_len, window_size = 256, 16
    is_global = np.zeros(seq_len, dtype=bool)
    is_global[[0, 100]] = True
    mask_mod = mods.generate_global_sliding_window(window_size, is_global)
    q, k, v = (rng.standard_normal((1, 4, seq_len, 64)).astype(np.float32) for _ in range(3))
    allowed = by_loop(global_rule(window_size, [0, 100]), seq_len, seq_len)
    return mask_mod, q, k, v, allowed


@pytest.mark.parametrize("implementation", ["reference", "tiled"])
def test_global_sliding_window_flex_equals_plain_attention_with_its_mask(rng, implementation):
    mask_mod, q, k, v, allowed = global_window_problem(rng)
    block_mask = create_block_mask(mask_mod, None, None, 256, 256)
    out = flex_attention(q, k, v, block_mask=block_mask, implementation=implementation)
    ref = scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    np.testing.assert_allclose(out, ref, rtol=2e-3, atol=2e-3)


def test_global_sliding_window_flex_equals_torch_attention_with_its_mask(rng, torch):
    mask_mod, q, k, v, allowed = global_window_problem(rng)
    block_mask = create_block_mask(mask_mod, None, None, 256, 256)
    out = flex_attention(q, k, v, block_mask=block_mask)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(x) for x in (q, k, v)), attn_mask=torch.from_numpy(allowed)
    )
    np.testing.assert_allclose(out, ref.numpy(), rtol=2e-3, atol=2e-3)
