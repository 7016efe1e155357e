"""sdpa.block_mask: what ``create_block_mask`` records, block by block, against a loop written
here, and ``BlockMask`` as a value that pickles and copies before and after use.

* the kind of every block (empty, partial, full) against a loop over the blocks of the mask
  evaluated entry by entry, for masks that depend on the batch entry and the head or on
  neither, with blocks that do and do not divide the lengths (a shorter last block is full
  when all of its entries are allowed, unlike PyTorch's);
* FlexAttention's layout from those kinds: per query block the partial (``kv_*``) and full
  (``full_kv_*``) key blocks counted, their indices first in increasing order, then the other
  key blocks in increasing order; ``to_dense`` and ``sparsity`` from the same loop;
* a mask pickled or deep-copied, before and after the tiled path of ``flex_attention`` used it,
  is the same mask (its arrays, shape, block size) and gives the same attention, bit for bit.

The hand-counted masks, the comparison with PyTorch's ``BlockMask`` and every error of
``create_block_mask`` are in test_flex.py.
"""

from __future__ import annotations

import copy
import functools
import pickle

import numpy as np
import pytest
from mods import causal_mask, generate_prefix_lm_mask, generate_sliding_window

from sdpa import create_block_mask, flex_attention

B, H, T, S = 2, 3, 37, 29
EMPTY, PARTIAL, FULL = 0, 1, 2


def table_mask(table, b, h, q_idx, kv_idx):
    """A mask read from a stored (B, H, T, S) bool table: it depends on everything."""
    return table[b, h, q_idx, kv_idx]


def random_table(p: float) -> np.ndarray:
    return np.random.default_rng(20261207).random((B, H, T, S)) < p


MASKS = {
    "causal": (causal_mask, None, None),
    "window": (generate_sliding_window(5), None, None),
    "prefix": (generate_prefix_lm_mask(9), None, None),
    # Mostly allowed, so that some blocks are full and some partial in every batch entry and head.
    "table": (functools.partial(table_mask, random_table(0.97)), B, H),
    "table-sparse": (functools.partial(table_mask, random_table(0.01)), B, H),
}
BLOCKS = [(8, 4), (5, 7), 16, (1, 1), (64, 64)]


def kinds_by_loop(mask_mod, b_count, h_count, block):
    """Each block's kind from the mask evaluated at every entry, one block at a time."""
    bq, bk = (block, block) if isinstance(block, int) else block
    nb, nh = b_count or 1, h_count or 1
    idx = np.ix_(np.arange(nb), np.arange(nh), np.arange(T), np.arange(S))
    allowed = np.broadcast_to(mask_mod(*idx), (nb, nh, T, S))
    n_q, n_kv = -(-T // bq), -(-S // bk)
    kinds = np.zeros((nb, nh, n_q, n_kv), dtype=int)
    for b in range(nb):
        for h in range(nh):
            for m in range(n_q):
                for n in range(n_kv):
                    tile = allowed[b, h, m * bq : (m + 1) * bq, n * bk : (n + 1) * bk]
                    kinds[b, h, m, n] = FULL if tile.all() else PARTIAL if tile.any() else EMPTY
    return kinds


@pytest.mark.parametrize("block", BLOCKS, ids=str)
@pytest.mark.parametrize("name", list(MASKS))
def test_the_kinds_of_blocks_match_a_loop_over_them(name, block):
    mask_mod, b_count, h_count = MASKS[name]
    mask = create_block_mask(mask_mod, b_count, h_count, T, S, BLOCK_SIZE=block)
    want = kinds_by_loop(mask_mod, b_count, h_count, block)
    assert mask.shape == (b_count or 1, h_count or 1, T, S)
    assert mask.BLOCK_SIZE == ((block, block) if isinstance(block, int) else block)
    np.testing.assert_array_equal(mask.kinds, want)
    np.testing.assert_array_equal(mask.to_dense(), want != EMPTY)
    assert mask.sparsity() == pytest.approx(100 * np.mean(want == EMPTY), rel=1e-12)


@pytest.mark.parametrize("block", BLOCKS, ids=str)
@pytest.mark.parametrize("name", list(MASKS))
def test_the_layout_lists_partial_and_full_blocks_first(name, block):
    mask_mod, b_count, h_count = MASKS[name]
    mask = create_block_mask(mask_mod, b_count, h_count, T, S, BLOCK_SIZE=block)
    kinds = kinds_by_loop(mask_mod, b_count, h_count, block)
    layouts = (
        (PARTIAL, mask.kv_num_blocks, mask.kv_indices),
        (FULL, mask.full_kv_num_blocks, mask.full_kv_indices),
    )
    for kind, counts, indices in layouts:
        assert counts.dtype == indices.dtype == np.int32
        for row in np.ndindex(*kinds.shape[:3]):
            chosen = np.flatnonzero(kinds[row] == kind)
            others = np.flatnonzero(kinds[row] != kind)
            assert counts[row] == len(chosen)
            np.testing.assert_array_equal(indices[row], np.concatenate([chosen, others]))


def attention_with(mask):
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((1, 2, n, 8)).astype(np.float32) for n in (T, S, S))
    return flex_attention(q, k, v, block_mask=mask, implementation="tiled")


@pytest.mark.parametrize("used", [False, True], ids=["fresh", "after-a-call"])
@pytest.mark.parametrize("duplicate", ["pickle", "deepcopy"])
def test_a_mask_pickles_and_copies_before_and_after_use(used, duplicate):
    # causal_mask is importable (tests/mods.py), as a mask_mod must be to pickle.
    mask = create_block_mask(causal_mask, None, None, T, S, BLOCK_SIZE=(8, 4))
    want = attention_with(mask) if used else None
    if duplicate == "pickle":
        twin = pickle.loads(pickle.dumps(mask))
    else:
        twin = copy.deepcopy(mask)
    assert twin.shape == mask.shape and twin.BLOCK_SIZE == mask.BLOCK_SIZE
    for name in ("kinds", "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        np.testing.assert_array_equal(getattr(twin, name), getattr(mask, name), err_msg=name)
    np.testing.assert_array_equal(attention_with(twin), attention_with(mask))
    if used:
        np.testing.assert_array_equal(attention_with(mask), want)
