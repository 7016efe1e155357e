"""Decoding with a key-value cache: the prefill, then one token at a time against a growing
cache, :func:`kv_cache_diagram`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..figures import ALLOWED_COLOR, FULL_WIDTH, MASKED_COLOR
from .draw import _outline, draw_bracket, new_canvas, role_legend
from .matrix import draw_matrix
from .primitives import (
    INK,
    LABEL_PT,
    MARGIN,
    _at_most,
    _block_rect,
    _line_height,
    _positive_int,
    text_size,
)

_LEGEND_W = 4.4  # the three entries of the legend
_PREFILL_GAP = 0.22  # between the prefill and the first decoding step


@dataclass(frozen=True)
class _Texts:
    left: list[str]  # left of the prefill
    steps: list[str]  # left of each decoding step
    right: list[str]  # right of the prefill and of each step: the cache's size


@dataclass(frozen=True)
class _CacheLayout:
    width: float
    height: float
    x0: float  # left of key 0
    cell: float
    pitch: float  # from one decoding row to the next
    bracket_h: float


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def kv_cache_diagram(prompt_len: int, new_tokens: int):
    r"""Decoding with a KV cache: the prefill, then one token at a time against a growing cache.

    Each row is a query, each column a key position ``j``. The prefill runs the
    ``prompt_len`` prompt queries at once under a causal mask and writes all their keys and
    values into the cache; each later step runs one new query, writes one key and value
    (outlined) and attends every key cached so far. The rows grow by one key per step: the
    cache growing.

    Parameters
    ----------
    prompt_len : int
        Tokens of the prompt, processed together (``T = prompt_len`` queries).
    new_tokens : int
        Tokens decoded one at a time after it (``T = 1`` each). ``prompt_len + new_tokens``
        is at most 32.

    Returns
    -------
    matplotlib.figure.Figure
        The diagram: white, at most ``sdpa_book.figures.FULL_WIDTH`` wide, not registered
        with pyplot.

    Raises
    ------
    TypeError
        If a count is not an integer.
    ValueError
        If a count is not positive, or the total exceeds 32.

    Examples
    --------
    >>> from sdpa_book.diagrams import kv_cache_diagram, figure_texts
    >>> texts = figure_texts(kv_cache_diagram(prompt_len=4, new_tokens=2))
    >>> [t for t in texts if t.startswith("cache")]
    ['cache: 4 keys, 4 values', 'cache: 5 keys, 5 values', 'cache: 6 keys, 6 values']
    """
    P = _positive_int(prompt_len, "prompt_len")
    N = _positive_int(new_tokens, "new_tokens")
    n = _at_most(P + N, 32, "prompt_len + new_tokens")
    texts = _Texts(
        left=[f"prefill: {P} queries" if P > 1 else "prefill: 1 query", "at once, causal"],
        steps=[f"step {k + 1}: query {P + k}" for k in range(N)],
        right=[f"cache: {_count(P + k, 'key')}, {_count(P + k, 'value')}" for k in range(N + 1)],
    )
    layout = _cache_layout(P, N, texts)
    fig, ax = new_canvas(layout.width, layout.height)
    pre = _draw_prefill(ax, layout, P, texts)
    y = _draw_decoding(ax, layout, pre, P, N, texts)
    _draw_key_positions(ax, layout, y, n)
    role_legend(
        ax,
        [
            ("may attend", ALLOWED_COLOR),
            ("masked (future key)", MASKED_COLOR),
            ("written this step", "white", {"edgecolor": INK, "linewidth": 2.0}),
        ],
    )
    return fig


def _cache_layout(P: int, N: int, texts: _Texts) -> _CacheLayout:
    """From the top: the bracket over the prefill, the prefill (P rows), the decoding steps (N
    rows), the key positions, the legend; texts left and right of the rows."""
    n = P + N
    left_w = max(text_size(t)[0] for t in texts.left + texts.steps) + 0.2
    right_w = max(text_size(t)[0] for t in texts.right) + 0.2
    cell = min(0.26, (FULL_WIDTH - 2 * MARGIN - left_w - right_w) / n)
    pitch = max(cell, _line_height(LABEL_PT) + 0.02)  # a decode row holds one line of text
    bracket_h = 0.34
    axis_h = 2 * _line_height(LABEL_PT) + 0.08
    legend_h = 0.32
    height = MARGIN + bracket_h + P * cell + _PREFILL_GAP + N * pitch + axis_h + legend_h + MARGIN
    width = MARGIN + left_w + n * cell + right_w + MARGIN
    x0 = MARGIN + left_w + max(0.0, (_LEGEND_W - width) / 2)
    return _CacheLayout(min(FULL_WIDTH, max(width, _LEGEND_W)), height, x0, cell, pitch, bracket_h)


def _draw_prefill(ax, layout: _CacheLayout, P: int, texts: _Texts):
    """P queries against the P keys they write; key j > i is still in the future."""
    cell = layout.cell
    y_pre = layout.height - MARGIN - layout.bracket_h - P * cell
    future = np.triu(np.ones((P, P), dtype=bool), k=1)
    pre = draw_matrix(
        ax,
        layout.x0,
        y_pre,
        (P, P),
        unit=cell,
        color=ALLOWED_COLOR,
        fill=1.0,
        masked=future,
        name_at=None,
        shape_at=None,
        min_size=cell,
        tag="prefill",
    )
    draw_bracket(
        ax,
        pre.x0,
        pre.x1,
        pre.y1 + 0.04,
        f"{_count(P, 'key')} and {'values' if P > 1 else 'value'} written at once",
        depth=0.05,
    )
    ax.text(
        pre.x0 - 0.1,
        pre.cy,
        "\n".join(texts.left),
        ha="right",
        va="center",
        fontsize=LABEL_PT,
        color=INK,
        linespacing=1.3,
    )
    ax.text(
        pre.x1 + 0.1, pre.cy, texts.right[0], ha="left", va="center", fontsize=LABEL_PT, color=INK
    )
    return pre


def _draw_decoding(ax, layout: _CacheLayout, pre, P: int, N: int, texts: _Texts) -> float:
    """One query per step, which sees every cached key, its own new one (outlined) included;
    returns the bottom of the last step's row."""
    cell, pitch = layout.cell, layout.pitch
    y = pre.y0 - _PREFILL_GAP
    for k in range(N):
        y -= pitch
        S = P + k + 1
        row = draw_matrix(
            ax,
            layout.x0,
            y + (pitch - cell) / 2,
            (1, S),
            unit=cell,
            color=ALLOWED_COLOR,
            fill=1.0,
            name_at=None,
            shape_at=None,
            min_size=cell,
            tag=f"step {k + 1}",
        )
        _outline(ax, _block_rect(row, (1, S), (0, 1), (S - 1, S)), INK, linewidth=2.0)
        ax.text(
            row.x0 - 0.1,
            row.cy,
            texts.steps[k],
            ha="right",
            va="center",
            fontsize=LABEL_PT,
            color=INK,
        )
        ax.text(
            row.x1 + 0.1,
            row.cy,
            texts.right[k + 1],
            ha="left",
            va="center",
            fontsize=LABEL_PT,
            color=INK,
        )
    return y


def _draw_key_positions(ax, layout: _CacheLayout, y: float, n: int) -> None:
    """Key positions under the columns (every one if they fit, else every fifth)."""
    cell = layout.cell
    every = 1 if cell >= 0.17 else 5
    for j in range(0, n, every):
        ax.text(
            layout.x0 + (j + 0.5) * cell,
            y - 0.05,
            str(j),
            ha="center",
            va="top",
            fontsize=LABEL_PT,
            color=INK,
        )
    ax.text(
        layout.x0 + n * cell / 2,
        y - 0.05 - _line_height(LABEL_PT),
        "key position $j$",
        ha="center",
        va="top",
        fontsize=LABEL_PT,
        color=INK,
    )
