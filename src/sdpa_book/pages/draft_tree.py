"""Helpers of the page *Tree attention*: draft trees for speculative decoding, their paths,
the tokens a verification pass accepts under a stated model, and a drawing of a tree.

A draft tree is given as Medusa gives it, by its *choices*: each node is the tuple of the
ranks taken at each depth from its root (``(0,)`` the draft's best first token, ``(0, 1)``
the second-best continuation of it). :func:`tree_from_choices` orders the nodes by depth
(a parent always before its children) and returns the ``parents`` list that
:func:`sdpa.flex_mods.tree` takes. :func:`depth_first` reorders a tree so that every subtree
is contiguous, which lets a block mask skip more tiles.

**The acceptance model.** At each depth, independently, the target model's token is the
draft's candidate of rank ``r`` with probability ``p[r]`` (and none of them with probability
``1 - sum(p)``). A pass accepts the longest path of the tree whose every node's rank matches;
the expected number accepted is the sum over nodes of the product of ``p`` along the node's
path (:func:`expected_accepted`), which :func:`simulate_accepted` checks by drawing passes.
The best tree of ``n`` nodes under this model is the ``n`` most probable paths
(:func:`best_choices`), Medusa's sparse tree and EAGLE-2's reranking.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

__all__ = [
    "best_choices",
    "cartesian_choices",
    "depth_first",
    "draw_tree",
    "expected_accepted",
    "leaf_paths",
    "simulate_accepted",
    "tree_from_choices",
]


def _check_choices(choices) -> list[tuple[int, ...]]:
    out = [tuple(int(r) for r in c) for c in choices]
    if not out or any(len(c) == 0 or min(c) < 0 for c in out) or len(set(out)) != len(out):
        raise ValueError(
            f"choices must be distinct non-empty tuples of ranks >= 0; got {list(choices)!r}"
        )
    missing = [c for c in out if len(c) > 1 and c[:-1] not in set(out)]
    if missing:
        raise ValueError(f"choices must hold every node's parent; {missing[0]} has none")
    return out


def tree_from_choices(choices: Sequence[Sequence[int]]) -> tuple[list[tuple[int, ...]], list[int]]:
    """The nodes in order of depth (then of ranks), and each one's parent index (-1: a root).

    Examples
    --------
    >>> tree_from_choices([(1,), (0, 0), (0,)])
    ([(0,), (1,), (0, 0)], [-1, -1, 0])
    """
    nodes = sorted(_check_choices(choices), key=lambda c: (len(c), c))
    index = {c: i for i, c in enumerate(nodes)}
    return nodes, [index[c[:-1]] if len(c) > 1 else -1 for c in nodes]


def cartesian_choices(ks: Sequence[int]) -> list[tuple[int, ...]]:
    """Medusa's first tree: the top ``ks[d]`` candidates at depth ``d``, every combination.

    Examples
    --------
    >>> cartesian_choices([2, 1])
    [(0,), (1,), (0, 0), (1, 0)]
    """
    levels = [()]
    out = []
    for k in ks:
        levels = [c + (r,) for c in levels for r in range(k)]
        out += levels
    return out


def best_choices(p: Sequence[float], n: int, max_depth: int) -> list[tuple[int, ...]]:
    """The ``n`` most probable paths (ties by ranks), at most ``max_depth`` deep: a tree,
    since a path is never more probable than its parent.

    Examples
    --------
    >>> best_choices([0.5, 0.3], 3, 4)  # 0.5, 0.3, then 0.5 * 0.5
    [(0,), (1,), (0, 0)]
    """
    heap = [(-p[r], (r,)) for r in range(len(p))]
    heapq.heapify(heap)
    out = []
    while heap and len(out) < n:
        negative, c = heapq.heappop(heap)
        out.append(c)
        if len(c) < max_depth:
            for r in range(len(p)):
                heapq.heappush(heap, (negative * p[r], c + (r,)))
    return out


def expected_accepted(choices, p: Sequence[float]) -> float:
    """Expected tokens a pass accepts from the tree: the sum of the paths' probabilities."""
    return float(sum(np.prod([p[r] for r in c]) for c in _check_choices(choices)))


def simulate_accepted(choices, p: Sequence[float], passes: int, rng) -> np.ndarray:
    """Tokens accepted in each of ``passes`` draws of the acceptance model, ``(passes,)``."""
    nodes = set(_check_choices(choices))
    depth = max(len(c) for c in nodes)
    tail = 1.0 - float(np.sum(p))  # rank len(p): none of the draft's candidates
    ranks = rng.choice(len(p) + 1, size=(passes, depth), p=[*p, tail])
    accepted = np.zeros(passes, dtype=int)
    for t in range(passes):
        path: tuple[int, ...] = ()
        while len(path) < depth and path + (int(ranks[t, len(path)]),) in nodes:
            path += (int(ranks[t, len(path)]),)
        accepted[t] = len(path)
    return accepted


def leaf_paths(parents: Sequence[int]) -> list[list[int]]:
    """Every root-to-leaf path, as lists of node indices (leaves in increasing order)."""
    has_child = set(parents)
    paths = []
    for leaf in (i for i in range(len(parents)) if i not in has_child):
        path, i = [], leaf
        while i >= 0:
            path.append(i)
            i = parents[i]
        paths.append(path[::-1])
    return paths


def depth_first(parents: Sequence[int]) -> tuple[list[int], np.ndarray]:
    """The tree reordered depth first (children in their order): its ``parents`` and
    ``order``, the old index of each new position. Every subtree becomes contiguous.

    Examples
    --------
    >>> depth_first([-1, -1, 0, 0])  # 0's children 2 and 3 come right after it
    ([-1, 0, 0, -1], array([0, 2, 3, 1]))
    """
    children: dict[int, list[int]] = {i: [] for i in range(-1, len(parents))}
    for i, up in enumerate(parents):
        children[up].append(i)
    order: list[int] = []
    stack = children[-1][::-1]
    while stack:
        i = stack.pop()
        order.append(i)
        stack += children[i][::-1]
    new = {old: k for k, old in enumerate(order)}
    return [new[parents[old]] if parents[old] >= 0 else -1 for old in order], np.array(order)


def draw_tree(ax, parents: Sequence[int], labels: Sequence[str], *, color="#0072b2") -> None:
    """Draw a tree from the left (the prefix) to the right (depth), one node per row of its
    leaves, each node labelled (its token index), edges to its children."""
    n = len(parents)
    depth = np.zeros(n, int)
    for i, up in enumerate(parents):
        depth[i] = 0 if up < 0 else depth[up] + 1
    # y: leaves in depth-first order one row apart, a parent centred on its children
    _, order = depth_first(parents)
    y = np.full(n, np.nan)
    row = 0
    for i in order:
        if i not in set(parents):
            y[i], row = row, row + 1
    for i in sorted(range(n), key=lambda i: -depth[i]):
        kids = [c for c in range(n) if parents[c] == i]
        if kids:
            y[i] = np.mean(y[kids])
    roots = [i for i in range(n) if parents[i] < 0]
    y_prefix = float(np.mean(y[roots]))
    for i in range(n):
        y0, x0 = (y_prefix, -1) if parents[i] < 0 else (y[parents[i]], depth[parents[i]])
        ax.plot([x0, depth[i]], [y0, y[i]], color="0.55", linewidth=1, zorder=1)
    ax.scatter(depth, y, s=260, color=color, zorder=2, edgecolors="none")
    for i in range(n):
        ax.text(depth[i], y[i], labels[i], ha="center", va="center", color="white",
                fontsize=9, zorder=3)  # fmt: skip
    ax.scatter([-1], [y_prefix], s=260, marker="s", color="0.35", zorder=2)
    ax.text(-1, y_prefix, "P", ha="center", va="center", color="white", fontsize=9, zorder=3)
    ax.set_xticks(range(-1, int(depth.max()) + 1))
    ax.set_xticklabels(["prefix", *[str(d + 1) for d in range(int(depth.max()) + 1)]])
    ax.set_xlabel("depth (draft position)")
    ax.margins(x=0.08, y=0.18)  # room for the markers at the edges
    ax.set_yticks([])
    ax.invert_yaxis()
    ax.spines["left"].set_visible(False)
