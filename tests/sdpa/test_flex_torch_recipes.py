"""The PyTorch code and claims of the page *Programmable attention* ("Taking a mod to
PyTorch"), run with PyTorch 2.13 on CPU (a test-time reference; the book does not need it).

* the page's ``python`` block marked ``% torch-recipe: compiled`` is read from the page and run
  as written (``torch.compile`` included) on the page's sizes, and its ``out`` and ``aux.lse``
  compared with :func:`sdpa.flex_attention` of the same library mods;
* which of the page's own mods run in PyTorch (``causal``, ``sliding_window``, ``prefix_lm``)
  and which fail (``alibi``, ``same_document``, ``softcap``: NumPy tables and ``np.tanh``),
  with the library's versions of the failing ones running unchanged;
* the backward's transposed lists of PyTorch's ``BlockMask`` (``q_num_blocks``,
  ``q_indices``, and the full ones) against the tile kinds of ours with the axes swapped;
* PyTorch's refusal of ``max_scores`` on CPU, as the page says;
* the tree mask of *Tree attention* through PyTorch's eager FlexAttention, for a tree in
  both orders the page uses.

Written for this project (no upstream test is ported).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import pytest
from references import torch_flex

import sdpa
from sdpa import and_masks, flex_mods

PAGE = Path(__file__).resolve().parents[2] / "book" / "modern" / "programmable-attention.md"
T = S = 96
LENGTHS = [30, 41, 25]


def recipe(name: str) -> str:
    """The page's ``python`` block that follows the comment ``% torch-recipe: name``."""
    text = PAGE.read_text(encoding="utf-8")
    found = re.findall(rf"^% torch-recipe: {name}\n```python\n(.*?)^```", text, re.M | re.S)
    assert len(found) == 1, f"the page has {len(found)} recipes named {name!r}"
    return found[0]


def test_the_compiled_recipe_gives_our_results(torch, rng):
    q, k, v = (rng.standard_normal((2, 4, T, 16)).astype(np.float32) for _ in range(3))
    space = {"q": torch.from_numpy(q), "k": torch.from_numpy(k), "v": torch.from_numpy(v)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.compile's own warnings on CPU
        exec(recipe("compiled"), space)
    mask = sdpa.create_block_mask(
        and_masks(flex_mods.document(lengths=LENGTHS), flex_mods.sliding_window(24)),
        None, None, T, S,
    )  # fmt: skip
    out, aux = sdpa.flex_attention(
        q, k, v, score_mod=flex_mods.tanh_softcap(5.0), block_mask=mask,
        return_aux=sdpa.AuxRequest(lse=True),
    )  # fmt: skip
    # float32 on both sides, different orders of summation
    np.testing.assert_allclose(space["out"].numpy(), out, rtol=0, atol=2e-5)
    np.testing.assert_allclose(space["lse"].numpy(), aux.lse, rtol=0, atol=2e-5)
    # the recipe's mask is a window of 24 within documents: a hand-built one
    doc = np.repeat(np.arange(3), LENGTHS)
    i, j = np.indices((T, S))
    hand = (doc[:, None] == doc[None, :]) & (i >= j) & (i - j < 24)
    np.testing.assert_array_equal(
        space["block_mask"].to_dense().numpy()[0, 0],
        sdpa.create_block_mask(lambda b, h, i, j: hand[i, j], None, None, T, S).to_dense()[0, 0],
    )


# The page's own mods, as it writes them (restated here), and what happens to them in torch.
W, PREFIX, CAP, H = 24, 40, 5.0, 4
document = np.repeat([0, 1, 2], LENGTHS)
slopes = sdpa.alibi_slopes(H)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < W)


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx < PREFIX) | (q_idx >= kv_idx)


def same_document(b, h, q_idx, kv_idx):
    return (document[q_idx] == document[kv_idx]) & (q_idx >= kv_idx)


def alibi(score, b, h, q_idx, kv_idx):
    return score + slopes[h] * (kv_idx - q_idx)


def softcap(score, b, h, q_idx, kv_idx):
    return CAP * np.tanh(score / CAP)


def test_which_of_the_pages_mods_run_in_torch(torch, rng):
    from torch.nn.attention.flex_attention import create_mask as t_create_mask

    for mod in (causal, sliding_window, prefix_lm):
        np.testing.assert_array_equal(
            t_create_mask(mod, None, None, T, S, device="cpu").numpy(),
            sdpa.create_mask(mod, None, None, T, S),
        )
    for mod in (same_document, alibi, softcap):
        with pytest.raises(Exception):  # noqa: B017 - whichever error torch's tracing raises
            t_create_mask(mod, 1, H, 8, 8, device="cpu")
    # the library's versions of the three run unchanged, and agree with ours
    q, k, v = (rng.standard_normal((1, H, T, 8)) for _ in range(3))
    library = [
        (None, and_masks(flex_mods.document(lengths=LENGTHS), flex_mods.causal())),
        (flex_mods.alibi(H), flex_mods.causal()),
        (flex_mods.tanh_softcap(CAP), None),
    ]
    for score_mod, mask_mod in library:
        t_out, _, _ = torch_flex(torch, q, k, v, score_mod=score_mod, mask_mod=mask_mod)
        mask = None if mask_mod is None else sdpa.create_block_mask(mask_mod, None, None, T, S)
        out = sdpa.flex_attention(q, k, v, score_mod=score_mod, block_mask=mask)
        np.testing.assert_allclose(out, t_out, rtol=1e-12, atol=1e-12)


def test_transposed_lists_are_the_kinds_swapped(torch):
    from torch.nn.attention.flex_attention import create_block_mask as t_create_block_mask

    documents = and_masks(flex_mods.document(lengths=LENGTHS), causal)  # the page's, in torch
    mods = [documents, sliding_window, prefix_lm, flex_mods.tree([-1, -1, 0, 0, 1, 2], 90)]
    for mod in mods:
        theirs = t_create_block_mask(mod, None, None, T, S, device="cpu", BLOCK_SIZE=12)
        ours = sdpa.create_block_mask(mod, None, None, T, S, BLOCK_SIZE=12)
        by_key = ours.kinds.swapaxes(-1, -2)  # as the page computes them
        for kind, num, indices in [
            (1, theirs.q_num_blocks, theirs.q_indices),
            (2, theirs.full_q_num_blocks, theirs.full_q_indices),
        ]:
            counts = (by_key == kind).sum(-1)
            np.testing.assert_array_equal(num.numpy(), counts)
            for n_kv in range(by_key.shape[-2]):  # the listed query tiles, as sets
                listed = indices.numpy()[0, 0, n_kv, : counts[0, 0, n_kv]]
                np.testing.assert_array_equal(
                    np.sort(listed), np.flatnonzero(by_key[0, 0, n_kv] == kind)
                )


def test_the_compiler_rejects_a_table_made_inside_the_mod(torch):
    # the page: the library's table-reading mods run eagerly but not compiled on a CPU
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mod = flex_mods.document(lengths=[4, 4])
    x = torch.zeros(1, 1, 8, 4)
    mask = create_block_mask(mod, None, None, 8, 8, device="cpu")  # eager: fine
    with warnings.catch_warnings(), pytest.raises(Exception, match="get_dtype"):
        warnings.simplefilter("ignore")
        torch.compile(flex_attention)(x, x, x, block_mask=mask)


def test_torch_cpu_refuses_what_the_page_says(torch):
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    x = torch.zeros(1, 1, 8, 4)
    with warnings.catch_warnings(), pytest.raises(NotImplementedError):
        warnings.simplefilter("ignore")
        flex_attention(x, x, x, return_aux=AuxRequest(lse=True, max_scores=True))
    # compiled on a CPU: inference only, no lse
    with warnings.catch_warnings(), pytest.raises(Exception, match="return_lse"):
        warnings.simplefilter("ignore")
        torch.compile(flex_attention)(x, x, x, return_aux=AuxRequest(lse=True))
    text = PAGE.read_text(encoding="utf-8")
    assert "refuses `max_scores`" in text and "returns no `lse`" in text


@pytest.mark.parametrize("order", ["by depth", "depth first"])
def test_tree_pages_masks_in_torch(torch, rng, order):
    from sdpa_book.pages.draft_tree import best_choices, depth_first, tree_from_choices

    _, parents = tree_from_choices(best_choices([0.6, 0.15, 0.07, 0.04], 24, max_depth=12))
    if order == "depth first":
        parents = depth_first(parents)[0]
    prefix = 40
    mod = flex_mods.tree(parents, prefix, query_offset=prefix)
    n = len(parents)
    q = rng.standard_normal((1, 2, n, 8))
    k, v = (rng.standard_normal((1, 2, prefix + n, 8)) for _ in range(2))
    t_out, t_lse, t_mask = torch_flex(torch, q, k, v, mask_mod=mod, block=8)
    mask = sdpa.create_block_mask(mod, None, None, n, prefix + n, BLOCK_SIZE=8)
    np.testing.assert_array_equal(t_mask.to_dense().numpy(), mask.to_dense())
    out, lse = sdpa.flex_attention(q, k, v, block_mask=mask, return_lse=True)
    np.testing.assert_allclose(out, t_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, t_lse, rtol=1e-12, atol=1e-12)
