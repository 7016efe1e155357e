"""Tests of sdpa_book.pages.draft_tree, the helpers of the page *Tree attention*.

* trees from Medusa-style choices against hand-written parent lists;
* the most probable paths against a brute-force enumeration;
* the expected accepted tokens against a hand sum and a simulation;
* the depth-first order: subtrees contiguous, the same ancestor relation.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from sdpa import create_mask
from sdpa.flex_mods import tree
from sdpa_book.pages.draft_tree import (
    best_choices,
    cartesian_choices,
    depth_first,
    draw_tree,
    expected_accepted,
    leaf_paths,
    simulate_accepted,
    tree_from_choices,
)


def test_tree_from_choices_by_hand():
    nodes, parents = tree_from_choices([(0, 1), (1,), (0,), (0, 0), (0, 0, 0)])
    assert nodes == [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]
    assert parents == [-1, -1, 0, 0, 2]
    assert leaf_paths(parents) == [[1], [0, 3], [0, 2, 4]]


def test_cartesian_choices_count_and_shape():
    choices = cartesian_choices([3, 2, 2])
    assert len(choices) == 3 + 6 + 12
    assert set(choices) == {c for d in (1, 2, 3) for c in itertools.product(
        *[range(k) for k in (3, 2, 2)[:d]])}  # fmt: skip


def test_best_choices_against_brute_force():
    p = [0.5, 0.2, 0.1]
    every = [c for d in range(1, 5) for c in itertools.product(range(3), repeat=d)]
    prob = {c: np.prod([p[r] for r in c]) for c in every}
    for n in (1, 4, 9, 20):
        got = best_choices(p, n, 4)
        assert len(got) == n
        worst_in = min(prob[c] for c in got)
        best_out = max(prob[c] for c in every if c not in got)
        assert worst_in >= best_out  # no path left out is more probable
        tree_from_choices(got)  # a tree: every parent is in


def test_expected_accepted_by_hand_and_by_simulation():
    p = [0.6, 0.2]
    choices = [(0,), (1,), (0, 0)]
    assert expected_accepted(choices, p) == pytest.approx(0.6 + 0.2 + 0.36, abs=1e-15)
    draws = simulate_accepted(choices, p, 40_000, np.random.default_rng(0))
    # the standard error of the mean is below 0.005: 5 of them
    assert abs(draws.mean() - 1.16) < 0.025
    assert set(np.unique(draws)) == {0, 1, 2}


def test_depth_first_keeps_the_tree():
    _, parents = tree_from_choices(cartesian_choices([2, 2, 2]))
    new_parents, order = depth_first(parents)
    # the same tree: the old parent of each node, renamed
    assert [order[u] if u >= 0 else -1 for u in new_parents] == [parents[o] for o in order]
    # every subtree contiguous: a node's descendants directly follow it
    n = len(new_parents)
    for i in range(n):
        below = [j for j in range(n) if j != i and i in _ancestors(new_parents, j)]
        assert below == list(range(i + 1, i + 1 + len(below)))
    # the mask is the old one with rows and columns reordered
    old = create_mask(tree(parents), None, None, n, n)[0, 0]
    new = create_mask(tree(new_parents), None, None, n, n)[0, 0]
    np.testing.assert_array_equal(new, old[np.ix_(order, order)])


def _ancestors(parents, j):
    out = []
    while parents[j] >= 0:
        j = parents[j]
        out.append(j)
    return out


def test_bad_choices():
    with pytest.raises(ValueError, match="has none"):
        tree_from_choices([(0, 1)])
    with pytest.raises(ValueError, match="distinct non-empty"):
        tree_from_choices([(0,), (0,)])


def test_draw_tree_runs():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    draw_tree(ax, [-1, -1, 0, 0, 2], list("abcde"))
    assert len(ax.texts) == 6  # five nodes and the prefix
    plt.close(fig)
