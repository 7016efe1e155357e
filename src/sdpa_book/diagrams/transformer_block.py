"""A transformer block: sublayers reading from and adding to the residual stream,
:func:`transformer_block_diagram`."""

from __future__ import annotations

from dataclasses import dataclass

from ..figures import FULL_WIDTH, OUTPUT, QUERY, VALUE
from .draw import _add, _segment, draw_arrow, draw_box, new_canvas
from .primitives import (
    INK,
    LABEL_PT,
    MARGIN,
    NAME_PT,
    NEUTRAL,
    _flag,
    _line_height,
    _mix,
    _numeric_shape,
    _pack,
    _positive_int,
    _stack_size,
    text_size,
)

_END_W = 0.1  # the stream starts this far in; the labels of its ends sit under it
_R = 0.1  # radius of the ⊕


@dataclass(frozen=True)
class _Block:
    """Where things go along the residual stream, and the sizes of the boxes."""

    width: float
    height: float
    norm: str  # "pre" or "post"
    at: dict[str, float]  # left edge of each piece along the stream (see _stream_places)
    y_s: float  # the stream
    y_box: float  # bottom of the sublayer boxes
    box_h: float
    ln_w: float  # a LayerNorm box
    sub_w: dict[str, float]  # each sublayer's box


def _plus(ax, x: float, y: float, r: float = 0.1, tag: str | None = None):
    """The ⊕ where a sublayer's output is added back to the residual stream."""
    from matplotlib.patches import Circle

    _add(
        ax,
        Circle(
            (x, y),
            r,
            facecolor="white",
            edgecolor=INK,
            linewidth=1.3,
            zorder=3,
            label=f"_add {tag}" if tag else None,
        ),
    )
    _segment(ax, [x - r * 0.6, x + r * 0.6], [y, y], color=INK, linewidth=1.3, zorder=4)
    _segment(ax, [x, x], [y - r * 0.6, y + r * 0.6], color=INK, linewidth=1.3, zorder=4)


def transformer_block_diagram(
    *, norm: str = "pre", attention_only: bool = False, T: int | None = None, E: int | None = None
):
    r"""A transformer block as sublayers reading from and adding to the residual stream.

    The residual stream (thick line) carries ``(T, E)`` from left to right. Pre-norm
    (``norm="pre"``, GPT-2 and most models since): each sublayer normalises a copy of the
    stream, transforms it (causal multi-head attention, then the MLP) and adds the result back
    (⊕); the stream itself is never normalised inside the block. Post-norm (``norm="post"``,
    the original Transformer): the sublayer reads the stream directly and the sum is
    normalised, on the stream.

    Parameters
    ----------
    norm : {"pre", "post"}, default "pre"
    attention_only : bool, default False
        Draw only the attention sublayer (no MLP).
    T, E : int, optional
        Sizes of the stream: when given (both), its shape labels show the numbers.

    Returns
    -------
    matplotlib.figure.Figure
        The diagram: white, at most ``sdpa_book.figures.FULL_WIDTH`` wide, not registered
        with pyplot.

    Raises
    ------
    TypeError
        If ``attention_only`` is not a bool, or a size not an integer.
    ValueError
        If ``norm`` is neither "pre" nor "post", a size is not positive, or only one of
        ``T``, ``E`` is given.

    Examples
    --------
    >>> from sdpa_book.diagrams import transformer_block_diagram, figure_texts
    >>> texts = figure_texts(transformer_block_diagram(norm="pre", T=5, E=16))
    >>> [t for t in texts if t in ("LayerNorm", "MLP")]  # norm -> attention; norm -> MLP
    ['LayerNorm', 'LayerNorm', 'MLP']
    >>> texts.count("(5, 16)")  # the stream's shape, in and out
    2
    """
    if norm not in ("pre", "post"):
        raise ValueError(f"norm must be 'pre' or 'post'; got {norm!r}")
    attention_only = _flag(attention_only, "attention_only")
    if (T is None) != (E is None):
        raise ValueError(f"give both sizes T and E or neither; got T={T!r}, E={E!r}")
    shape = [] if T is None else [_numeric_shape((_positive_int(T, "T"), _positive_int(E, "E")))]
    sub = [("attention", "causal multi-head\nattention", QUERY)]
    if not attention_only:
        sub.append(("mlp", "MLP", VALUE))
    end_lines = ["input $X$", "$(T, E)$", *shape]
    block = _block_layout(norm, sub, end_lines)
    fig, ax = new_canvas(block.width, block.height)
    title = (
        "pre-norm: each sublayer normalises a copy of the stream"
        if norm == "pre"
        else "post-norm (original Transformer): the stream itself is normalised"
    )
    ax.text(MARGIN, block.height - MARGIN, title, ha="left", va="top", fontsize=NAME_PT, color=INK)
    _write_under(ax, MARGIN + _END_W, block.y_s, end_lines, "left")  # under the stream's start
    for n, (key, text, color) in enumerate(sub):
        _draw_sublayer(ax, block, n, key, text, color)
    _draw_stream(ax, block, ["out", "$(T, E)$", *shape])
    return fig


def _stream_places(norm: str, sub, stretch: float, ln_w: float, sub_w) -> dict[str, float]:
    """Left edge of each piece along the stream, from its start to its end: per sublayer, the
    branch off the stream, the boxes (LayerNorm first under pre-norm) and the ⊕ (then the
    LayerNorm, under post-norm); the gaps around each sublayer widened by ``stretch``."""
    names, sizes, gaps = ["start"], [0.0], []

    def piece(name: str, size: float, gap: float) -> None:
        names.append(name)
        sizes.append(size)
        gaps.append(gap)

    for key, _, _ in sub:
        piece(f"{key} branch", 0.0, 0.25 + stretch)
        if norm == "pre":
            piece(f"{key} norm", ln_w, 0.15)
        piece(key, sub_w[key], 0.15 + stretch / 2 if norm == "pre" else 0.15)
        piece(f"{key} add", 2 * _R, 0.15)
        if norm == "post":
            piece(f"{key} norm", ln_w, 0.2 + stretch / 2)
    piece("end", 0.0, 0.3 + stretch)
    return dict(zip(names, _pack(sizes, gaps, start=MARGIN + _END_W)))


def _block_layout(norm: str, sub, end_lines: list[str]) -> _Block:
    """The stream's gaps widen (or narrow, a little) evenly to fill the column. From the top:
    the title, the sublayer boxes, the stream 0.45 in below them, the labels of its ends."""
    ln_w = text_size("LayerNorm", NAME_PT)[0] + 0.22
    sub_w = {k: text_size(t, NAME_PT)[0] + 0.26 for k, t, _ in sub}
    # the stream's end moves by 1.5 n + 1 times the stretch (n sublayers)
    spare = FULL_WIDTH - MARGIN - _stream_places(norm, sub, 0.0, ln_w, sub_w)["end"]
    stretch = min(0.5, max(-0.14, spare / (1.5 * len(sub) + 1)))
    at = _stream_places(norm, sub, stretch, ln_w, sub_w)
    title_h = _line_height(NAME_PT) + 0.1
    box_h = 2 * _line_height(NAME_PT) + 0.14
    height = MARGIN + title_h + box_h + 0.45 + 0.25 + len(end_lines) * _line_height(LABEL_PT)
    y_s = MARGIN + _stack_size([(t, NAME_PT) for t in end_lines])[1] + 0.2
    return _Block(
        width=min(FULL_WIDTH, at["end"] + MARGIN),
        height=height + MARGIN,
        norm=norm,
        at=at,
        y_s=y_s,
        y_box=y_s + 0.45,
        box_h=box_h,
        ln_w=ln_w,
        sub_w=sub_w,
    )


def _write_under(ax, x: float, y_s: float, lines: list[str], ha: str) -> None:
    """A name and its shape under the stream, at ``x``."""
    for i, t in enumerate(lines):
        ax.text(
            x,
            y_s - 0.1 - i * _line_height(NAME_PT),
            t,
            ha=ha,
            va="top",
            fontsize=LABEL_PT if i else NAME_PT,
            color=INK,
        )


def _draw_sublayer(ax, block: _Block, n: int, key: str, text: str, color) -> None:
    """Sublayer ``n``: a branch off the stream into its boxes, and its output added back."""
    at, y_s, box_h = block.at, block.y_s, block.box_h
    branch = at[f"{key} branch"]
    x_box = branch + 0.15
    _segment(ax, [branch, branch], [y_s, block.y_box + box_h / 2], color=INK, linewidth=1.3)
    _segment(ax, [branch, x_box], [block.y_box + box_h / 2] * 2, color=INK, linewidth=1.3)
    if block.norm == "pre":
        ln = draw_box(
            ax,
            at[f"{key} norm"],
            block.y_box,
            block.ln_w,
            box_h,
            "LayerNorm",
            color=NEUTRAL,
            fill=0.1,
            tag=f"norm {n + 1}",
        )
        draw_arrow(ax, ln.right, (at[key], ln.cy))
    box = draw_box(
        ax, at[key], block.y_box, block.sub_w[key], box_h, text, color=color, fill=0.25, tag=key
    )
    x_add = at[f"{key} add"] + _R
    _segment(ax, [box.x1, x_add], [box.cy] * 2, color=INK, linewidth=1.3)
    draw_arrow(ax, (x_add, box.cy), (x_add, y_s + _R))
    _plus(ax, x_add, y_s, _R, tag=key)
    if block.norm == "post":
        draw_box(
            ax,
            at[f"{key} norm"],
            y_s - box_h / 4,
            block.ln_w,
            box_h / 2,
            "LayerNorm",
            color=NEUTRAL,
            fill=0.1,
            tag=f"norm {n + 1}",
        )


def _draw_stream(ax, block: _Block, out_lines: list[str]) -> None:
    """The thick residual stream from start to end, its arrow, and the labels of its end."""
    x_start, x_end, y_s = MARGIN + _END_W, block.at["end"], block.y_s
    stream_color = _mix(OUTPUT, 0.8, "black")
    _segment(
        ax,
        [x_start, x_end],
        [y_s, y_s],
        color=stream_color,
        linewidth=3.0,
        zorder=0.5,
        solid_capstyle="butt",
    )
    draw_arrow(ax, (x_end - 0.2, y_s), (x_end, y_s), color=stream_color, linewidth=1.5)
    _write_under(ax, x_end, y_s, out_lines, "right")
    ax.text(
        (x_start + x_end) / 2,
        y_s - 0.22,
        "residual stream",
        ha="center",
        va="top",
        fontsize=LABEL_PT,
        color=INK,
    )
