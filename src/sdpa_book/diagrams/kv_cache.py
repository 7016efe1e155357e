"""Decoding with a key-value cache: the prefill, then one token at a time against a growing
cache, :func:`kv_cache_diagram`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..figures import ALLOWED_COLOR, MASKED_COLOR
from .draw import _outline, draw_bracket, new_canvas
from .matrix import draw_matrix
from .phone import LEGEND_ROW, PHONE_CANVAS, _legend, _lines_size, _write, _write_lines
from .primitives import (
    INK,
    MARGIN,
    TEXT_PT,
    _at_most,
    _block_rect,
    _positive_int,
    text_size,
)

_PREFILL_GAP = 0.16  # between the prefill and the first decoding step
_LABEL_GAP = 0.1  # between a row and the texts left and right of it


@dataclass(frozen=True)
class _Texts:
    left: list[str]  # left of the prefill (one line each)
    steps: list[str]  # left of each decoding step
    right: list[str]  # right of the prefill and of each step: the cache's size
    written: str  # over the prefill


@dataclass(frozen=True)
class _CacheLayout:
    height: float
    x0: float  # left of key 0
    cell: float
    pitch: float  # from one decoding row to the next
    prefill_h: float  # the prefill's rows, or its two lines of text if they are taller
    top: float  # of the prefill's room


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def kv_cache_diagram(prompt_len: int, new_tokens: int):
    r"""Decoding with a KV cache: the prefill, then one token at a time against a growing cache.

    Each row is a query, each column a key position ``j``, narrow enough for a phone. The
    prefill runs the ``prompt_len`` prompt queries at once under a causal mask and writes all
    their keys and values into the cache; each later step runs one new query, writes one key
    and value (outlined) and attends every key cached so far. The rows grow by one key per
    step, the cache with them: right of each row, the keys it holds.

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
        The diagram: white, at most 3.7 in wide (a phone's column), not registered with
        pyplot.

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
    >>> [t for t in texts if t.startswith("cache")]  # keys (and values) cached
    ['cache: 4', 'cache: 5', 'cache: 6']
    >>> [t for t in texts if t.startswith("query")]  # one query per step, at positions 4 and 5
    ['query 4', 'query 5']
    """
    P = _positive_int(prompt_len, "prompt_len")
    N = _positive_int(new_tokens, "new_tokens")
    n = _at_most(P + N, 32, "prompt_len + new_tokens")
    texts = _Texts(
        left=["prefill:", f"queries 0\N{EN DASH}{P - 1}" if P > 1 else "query 0"],
        steps=[f"query {P + k}" for k in range(N)],
        right=[f"cache: {P + k}" for k in range(N + 1)],
        written=f"{_count(P, 'key')} and {'values' if P > 1 else 'value'} written at once",
    )
    layout = _cache_layout(P, N, texts)
    fig, ax = new_canvas(PHONE_CANVAS, layout.height)
    pre = _draw_prefill(ax, layout, P, texts)
    y = _draw_decoding(ax, layout, pre, P, N, texts)
    _draw_key_positions(ax, layout, y, n)
    _legend(
        ax,
        [
            ("may attend", ALLOWED_COLOR),
            ("written this step", "white", {"edgecolor": INK, "linewidth": 2.0}),
            ("masked (future key)", MASKED_COLOR),
        ],
        ncols=2,
    )
    return fig


def _cache_layout(P: int, N: int, texts: _Texts) -> _CacheLayout:
    """From the top: what the prefill writes, over a bracket; the prefill (P rows); "decode:"
    and the decoding steps (N rows); the key positions and their name; the legend (two rows). Texts left and
    right of the rows; the cells as large as the canvas allows."""
    n = P + N
    left_w = max(text_size(t, TEXT_PT)[0] for t in [*texts.left, *texts.steps, "decode:"])
    right_w = max(text_size(t, TEXT_PT)[0] for t in texts.right)
    grid_w = PHONE_CANVAS - 2 * MARGIN - left_w - right_w - 2 * _LABEL_GAP
    cell = min(0.24, grid_w / n)
    line = _lines_size(["0"])[1]
    pitch = max(cell + 0.04, line + 0.02)  # a decoding row holds one line of text, rows apart
    prefill_h = max(P * cell, _lines_size(texts.left)[1])
    written_h = line + 0.14  # the text and the bracket under it
    axis_h = 2 * line + 0.06
    legend_h = 2 * LEGEND_ROW + 0.06
    decode_h = line  # "decode:" over the steps
    height = (
        MARGIN
        + written_h
        + prefill_h
        + _PREFILL_GAP
        + decode_h
        + N * pitch
        + axis_h
        + legend_h
        + MARGIN
    )
    x0 = MARGIN + left_w + _LABEL_GAP
    return _CacheLayout(height, x0, cell, pitch, prefill_h, height - MARGIN - written_h)


def _draw_prefill(ax, layout: _CacheLayout, P: int, texts: _Texts):
    """P queries against the P keys they write; key j > i is still in the future."""
    cell = layout.cell
    y_pre = layout.top - layout.prefill_h / 2 - P * cell / 2
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
    draw_bracket(ax, pre.x0, pre.x1, pre.y1 + 0.04, None, depth=0.05)
    _write(ax, pre.x0, pre.y1 + 0.14, texts.written, ha="left", va="bottom")
    left_top = pre.cy + _lines_size(texts.left)[1] / 2
    _write_lines(ax, pre.x0 - _LABEL_GAP, left_top, texts.left, ha="right")
    _write(ax, pre.x1 + _LABEL_GAP, pre.cy, texts.right[0], ha="left")
    return pre


def _draw_decoding(ax, layout: _CacheLayout, pre, P: int, N: int, texts: _Texts) -> float:
    """One query per step, which sees every cached key, its own new one (outlined) included;
    returns the bottom of the last step's row."""
    cell, pitch = layout.cell, layout.pitch
    y = layout.top - layout.prefill_h - _PREFILL_GAP
    _write(ax, layout.x0 - _LABEL_GAP, y, "decode:", ha="right", va="top")
    y -= _lines_size(["decode:"])[1]
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
        _write(ax, row.x0 - _LABEL_GAP, row.cy, texts.steps[k], ha="right")
        _write(ax, row.x1 + _LABEL_GAP, row.cy, texts.right[k + 1], ha="left")
    return y


def _draw_key_positions(ax, layout: _CacheLayout, y: float, n: int) -> None:
    """Key positions under the columns: every one if they fit, else every second, fifth or
    tenth."""
    cell = layout.cell
    widest = text_size(str(n - 1), TEXT_PT)[0] + 0.03
    every = next(e for e in (1, 2, 5, 10) if e * cell >= widest)
    for j in range(0, n, every):
        _write(ax, layout.x0 + (j + 0.5) * cell, y - 0.05, str(j), va="top")
    line = _lines_size(["0"])[1]
    _write(ax, layout.x0 + n * cell / 2, y - 0.08 - line, "key position $j$", va="top")
