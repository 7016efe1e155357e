"""Tests of sdpa.flex_mods, the library of named mods (issue 35, item 2).

* every mask_mod against a scalar rule written here, entry by entry (and attention-gym's
  conventions, restated here, against ours: its sliding window of ``n`` is ours of ``n + 1``);
* every mod, the same object, through PyTorch 2.13's eager FlexAttention and ours: masks
  equal (torch's ``create_mask``) and outputs and lse to rounding, in float64;
* the draft tree: verification of every branch in one pass equals per-path causal attention
  over the prefix and the path; the tiles its block mask skips;
* names, the checks of the settings, and that a mod keeps no reference to a caller's array.

The catalogue follows attention-gym (github.com/pytorch-labs/attention-gym, attn_gym/masks
and attn_gym/mods); its tests are not ported: the rules here are written anew.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from references import torch_flex

from sdpa import (
    alibi_slopes,
    and_masks,
    create_block_mask,
    create_mask,
    flex_attention,
    scaled_dot_product_attention,
)
from sdpa.flex_mods import (
    alibi,
    causal,
    chunked_local,
    dilated_sliding_window,
    document,
    prefix_lm,
    relative_bias,
    sliding_window,
    tanh_softcap,
    tree,
)

PATHS = ["reference", "tiled"]


def by_rule(rule, B, H, T, S):
    """``(B, H, T, S)`` bool from a scalar ``rule(b, h, i, j)``."""
    out = np.zeros((B, H, T, S), bool)
    for b, h, i, j in np.ndindex(B, H, T, S):
        out[b, h, i, j] = bool(rule(b, h, i, j))
    return out


def ancestors_by_walk(parents, i, j):
    """Whether tree token ``j`` is ``i`` or an ancestor of it: walk up from ``i``."""
    while i >= 0:
        if i == j:
            return True
        i = parents[i]
    return False


PARENTS = [-1, -1, 0, 0, 1, 2, 2, 4, -1]  # 3 roots; depths up to 3


def tree_rule(parents, P, offset):
    n = len(parents)

    def rule(b, h, i, j):
        qp = i + offset
        if qp < P:
            return j <= qp
        if qp >= P + n:
            return False
        return j < P or (j < P + n and ancestors_by_walk(parents, qp - P, j - P))

    return rule


# (mod, rule, B, H, T, S): the mask_mods against their scalar rules
DOCS = [3, 1, 5, 4, 2]
STARTS = np.concatenate([[0], np.cumsum(DOCS)])


def doc_of(p):
    return int(np.searchsorted(STARTS, p, side="right") - 1)


MASKS = [
    (causal(), lambda b, h, i, j: j <= i, 1, 1, 13, 15),
    (sliding_window(4), lambda b, h, i, j: i - 3 <= j <= i, 1, 1, 15, 15),
    (sliding_window(1), lambda b, h, i, j: i == j, 1, 1, 6, 6),
    (dilated_sliding_window(3, 2), lambda b, h, i, j: i - j in (0, 2, 4), 1, 1, 15, 15),
    (
        dilated_sliding_window(2, 3, causal=False),
        lambda b, h, i, j: abs(i - j) in (0, 3),
        1,
        1,
        12,
        14,
    ),
    (chunked_local(4), lambda b, h, i, j: j <= i and i // 4 == j // 4, 1, 1, 15, 15),
    (prefix_lm(5), lambda b, h, i, j: j < 5 or j <= i, 1, 1, 12, 12),
    (prefix_lm([2, 7]), lambda b, h, i, j: j < [2, 7][b] or j <= i, 2, 1, 10, 10),
    (document(lengths=DOCS), lambda b, h, i, j: doc_of(i) == doc_of(j), 1, 1, 15, 15),
    (
        document(offsets=STARTS.tolist(), inner=prefix_lm(2)),
        lambda b, h, i, j: doc_of(i) == doc_of(j) and (j - STARTS[doc_of(j)] < 2 or j <= i),
        1,
        1,
        15,
        15,
    ),
    (tree(PARENTS), tree_rule(PARENTS, 0, 0), 1, 1, 9, 9),
    (tree(PARENTS, 4), tree_rule(PARENTS, 4, 0), 1, 1, 13, 13),
    (tree(PARENTS, 4, query_offset=4), tree_rule(PARENTS, 4, 4), 1, 1, 9, 13),
    (tree(PARENTS, 4, query_offset=2), tree_rule(PARENTS, 4, 2), 1, 1, 11, 13),
]
MASK_IDS = [m[0].__name__ for m in MASKS]


@pytest.mark.parametrize("mod, rule, B, H, T, S", MASKS, ids=MASK_IDS)
def test_mask_mods_against_their_rules(mod, rule, B, H, T, S):
    np.testing.assert_array_equal(create_mask(mod, B, H, T, S), by_rule(rule, B, H, T, S))


def test_attention_gym_conventions_against_ours():
    # attention-gym's sliding window of n: q - kv <= n, causal; its dilated window: |q - kv|
    # <= n and a multiple of d (both restated here as scalar rules)
    for n in (0, 3, 5):
        gym = by_rule(lambda b, h, i, j, n=n: 0 <= i - j <= n, 1, 1, 12, 12)
        np.testing.assert_array_equal(create_mask(sliding_window(n + 1), None, None, 12, 12), gym)
    n, d = 6, 2
    gym = by_rule(lambda b, h, i, j: abs(i - j) <= n and abs(i - j) % d == 0, 1, 1, 14, 14)
    ours = dilated_sliding_window(n // d + 1, d, causal=False)
    np.testing.assert_array_equal(create_mask(ours, None, None, 14, 14), gym)


def test_score_mods_against_formulas():
    i, j = np.arange(6).reshape(6, 1), np.arange(7)
    h = np.arange(4).reshape(4, 1, 1)
    z = np.random.default_rng(3).standard_normal((4, 6, 7)) * 10
    slopes = [2 ** (-8 * (k + 1) / 4) for k in range(4)]  # ALiBi's slopes for 4 heads
    expected = np.array([[[z[k, a, c] + slopes[k] * (c - a) for c in range(7)] for a in range(6)]
                         for k in range(4)])  # fmt: skip
    np.testing.assert_allclose(alibi(4)(z, 0, h, i, j), expected, rtol=1e-15)
    np.testing.assert_allclose(tanh_softcap(3.0)(z, 0, h, i, j), 3 * np.tanh(z / 3), rtol=1e-15)
    table = np.random.default_rng(4).standard_normal((4, 5))  # R = 2, per head
    expected = np.array(
        [[[z[k, a, c] + table[k, min(max(c - a, -2), 2) + 2] for c in range(7)] for a in range(6)]
         for k in range(4)]
    )  # fmt: skip
    np.testing.assert_allclose(relative_bias(table)(z, 0, h, i, j), expected, rtol=1e-15)
    shared = table[1]  # one table for every head
    expected = np.array(
        [[[z[k, a, c] + shared[min(max(c - a, -2), 2) + 2] for c in range(7)] for a in range(6)]
         for k in range(4)]
    )  # fmt: skip
    np.testing.assert_allclose(relative_bias(shared)(z, 0, h, i, j), expected, rtol=1e-15)


def test_alibi_takes_the_package_slopes_for_any_head_count():
    h = np.arange(6).reshape(6, 1, 1)
    got = alibi(6)(np.zeros((6, 1, 2)), 0, h, np.zeros((1, 1), int), np.arange(2))
    np.testing.assert_allclose(got[:, 0, 1], alibi_slopes(6))


# ---------------------------------------------------------------------------------------------
# PyTorch's FlexAttention runs the same mod objects
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mod, rule, B, H, T, S", MASKS, ids=MASK_IDS)
def test_mask_mods_in_torch(torch, rng, mod, rule, B, H, T, S):
    from torch.nn.attention.flex_attention import create_mask as t_create_mask

    torch_mask = t_create_mask(mod, B, H, T, S, device="cpu").numpy()
    np.testing.assert_array_equal(torch_mask, create_mask(mod, B, H, T, S))
    q, k, v = (
        rng.standard_normal((B, 2, T, 4)),
        rng.standard_normal((B, 2, S, 4)),
        rng.standard_normal((B, 2, S, 3)),
    )
    t_out, t_lse, _ = torch_flex(torch, q, k, v, mask_mod=mod, B=B, block=4)
    bm = create_block_mask(mod, B, None, T, S, BLOCK_SIZE=4)
    for implementation in PATHS:
        out, lse = flex_attention(
            q, k, v, block_mask=bm, return_lse=True, implementation=implementation
        )
        np.testing.assert_allclose(out, t_out, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse, t_lse, rtol=1e-12, atol=1e-12)


SCORE_MODS = [alibi(4), tanh_softcap(2.5), relative_bias(np.linspace(-1, 1, 7)),
              relative_bias(np.random.default_rng(5).standard_normal((4, 5)))]  # fmt: skip


@pytest.mark.parametrize("mod", SCORE_MODS, ids=[m.__name__ for m in SCORE_MODS])
def test_score_mods_in_torch(torch, rng, mod):
    from torch.nn.attention.flex_attention import create_mask as t_create_mask

    B, H, T, S = 2, 4, 19, 23
    q, k, v = (
        rng.standard_normal((B, H, T, 8)) * 3,
        rng.standard_normal((B, H, S, 8)),
        rng.standard_normal((B, H, S, 5)),
    )
    window = chunked_local(8)
    t_out, t_lse, _ = torch_flex(torch, q, k, v, score_mod=mod, mask_mod=window, block=8)
    bm = create_block_mask(window, None, None, T, S, BLOCK_SIZE=8)
    for implementation in PATHS:
        out, lse = flex_attention(q, k, v, mod, bm, return_lse=True, implementation=implementation)
        np.testing.assert_allclose(out, t_out, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse, t_lse, rtol=1e-12, atol=1e-12)
    # the score_mod's mask (nowhere -inf) as torch reads it
    np.testing.assert_array_equal(
        t_create_mask(mod, 1, H, 3, 4, device="cpu").numpy(), create_mask(mod, 1, H, 3, 4)
    )


def test_combined_library_masks_in_torch(torch, rng):
    mod = and_masks(document(lengths=[6, 10]), sliding_window(3))
    q = rng.standard_normal((1, 1, 16, 4))
    t_out, _, _ = torch_flex(torch, q, q, q, mask_mod=mod, block=4)
    out = flex_attention(
        q, q, q, block_mask=create_block_mask(mod, None, None, 16, 16, BLOCK_SIZE=4)
    )
    np.testing.assert_allclose(out, t_out, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# The draft tree
# ---------------------------------------------------------------------------------------------


def leaf_paths(parents):
    """Every root-to-leaf path of tree indices."""
    children = {i: [c for c, p in enumerate(parents) if p == i] for i in range(len(parents))}
    paths = []
    for leaf in (i for i in range(len(parents)) if not children[i]):
        path, i = [], leaf
        while i >= 0:
            path.append(i)
            i = parents[i]
        paths.append(path[::-1])
    return paths


@pytest.mark.parametrize("implementation", PATHS)
def test_tree_verification_equals_per_path_causal_attention(rng, implementation):
    P, n, D = 11, len(PARENTS), 8
    prefix_k, prefix_v = rng.standard_normal((P, D)), rng.standard_normal((P, D))
    tree_q, tree_k, tree_v = (rng.standard_normal((n, D)) for _ in range(3))
    keys = np.concatenate([prefix_k, tree_k])[None, None]
    values = np.concatenate([prefix_v, tree_v])[None, None]
    mask = create_block_mask(tree(PARENTS, P, query_offset=P), None, None, n, P + n, BLOCK_SIZE=4)
    out = flex_attention(
        tree_q[None, None], keys, values, block_mask=mask, implementation=implementation
    )
    for path in leaf_paths(PARENTS):
        # the path alone: its tokens after the prefix, causal, the queries at the end
        k = np.concatenate([prefix_k, tree_k[path]])[None]
        v = np.concatenate([prefix_v, tree_v[path]])[None]
        alone = scaled_dot_product_attention(
            tree_q[path][None], k, v, is_causal=True, causal_alignment="bottom_right"
        )
        np.testing.assert_allclose(out[0, 0, path], alone[0], rtol=1e-12, atol=1e-12)


def test_tree_block_mask_skips_tiles():
    # A 64-token prefix and a wide tree of 64 tokens (8 chains of 8): the tree's key blocks
    # of other chains are never computed.
    parents = [-1 if i % 8 == 0 else i - 1 for i in range(64)]
    mask = create_block_mask(tree(parents, 64, query_offset=64), None, None, 64, 128, BLOCK_SIZE=8)
    dense = mask.to_dense()[0, 0]
    assert dense[:, :8].all()  # the prefix: every query block
    np.testing.assert_array_equal(dense[:, 8:], np.eye(8, dtype=bool))  # its own chain only
    assert mask.sparsity() == pytest.approx(100 * 56 / 128)


# ---------------------------------------------------------------------------------------------
# Names and checks
# ---------------------------------------------------------------------------------------------


def test_names():
    names = [m[0].__name__ for m in MASKS] + [m.__name__ for m in SCORE_MODS]
    assert names[:4] == [
        "causal",
        "sliding_window(4)",
        "sliding_window(1)",
        "dilated_sliding_window(3, 2)",
    ]
    assert "dilated_sliding_window(2, 3, causal=False)" in names
    assert "prefix_lm([2, 7])" in names and "document([3, 1, 5, 4, 2], inner=prefix_lm(2))" in names
    assert "tree(9, 4)" in names and "alibi(4)" in names and "tanh_softcap(2.5)" in names
    assert "relative_bias(3)" in names and "relative_bias(4, 2)" in names


def test_mods_copy_their_tables():
    lengths = [2, 2]
    mod = document(lengths=lengths)
    lengths[0] = 3
    np.testing.assert_array_equal(create_mask(mod, None, None, 4, 4)[0, 0, 0], [1, 1, 0, 0])
    table = np.zeros(3)
    bias = relative_bias(table)
    table[:] = 5
    assert (bias(np.zeros(2), 0, 0, np.arange(2), 0) == 0).all()


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: sliding_window(0), ValueError, "w must be a positive integer; got 0"),
        (lambda: sliding_window(2.0), TypeError, "w must be a positive integer"),
        (lambda: dilated_sliding_window(2, 0), ValueError, "dilation must be a positive"),
        (lambda: chunked_local(-1), ValueError, "chunk must be a positive integer"),
        (lambda: prefix_lm(-1), ValueError, "prefix must be a non-negative integer"),
        (lambda: prefix_lm([1.5]), TypeError, "prefix must be a non-empty 1-D sequence"),
        (lambda: document(), TypeError, "exactly one of lengths= and offsets="),
        (lambda: document(lengths=[1], offsets=[0, 1]), TypeError, "exactly one"),
        (lambda: document(lengths=[2, 0]), ValueError, "lengths must hold integers >= 1"),
        (lambda: document(offsets=[0, 3, 3]), ValueError, "offsets must start at 0 and increase"),
        (lambda: document(offsets=[1, 3]), ValueError, "offsets must start at 0"),
        (lambda: document(lengths=[2], inner=3), TypeError, "inner must be a mask_mod"),
        (lambda: tree([0]), ValueError, r"parents\[i\] must be -1"),
        (lambda: tree([-1, 2, 0]), ValueError, r"parents\[i\] must be -1"),
        (lambda: tree([-2]), ValueError, "parents must hold integers >= -1"),
        (lambda: tree([]), TypeError, "parents must be a non-empty 1-D sequence"),
        (lambda: tree([-1], prefix=-1), ValueError, "prefix must be a non-negative"),
        (lambda: alibi(0), ValueError, "H must be a positive integer"),
        (lambda: tanh_softcap(0), ValueError, "cap must be a positive, finite real number"),
        (lambda: tanh_softcap(math.inf), ValueError, "cap must be a positive, finite"),
        (lambda: tanh_softcap("1"), TypeError, "cap must be a positive, finite"),
        (lambda: relative_bias([0.0, 1.0]), TypeError, "odd count of distances"),
        (lambda: relative_bias(np.zeros((2, 2, 3))), TypeError, r"\(2R \+ 1,\) or \(H, 2R \+ 1\)"),
        (lambda: relative_bias([0, np.nan, 0]), ValueError, "table must be finite"),
    ],
)
def test_bad_settings(call, error, match):
    with pytest.raises(error, match=match):
        call()
