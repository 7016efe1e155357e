"""A transformer block: sublayers reading from and adding to the residual stream,
:func:`transformer_block_diagram`."""

from __future__ import annotations

from dataclasses import dataclass

from ..figures import OUTPUT, QUERY, VALUE
from .draw import _add, _segment, draw_arrow, draw_box, new_canvas
from .phone import PHONE_CANVAS, _lines_size, _write, _write_lines
from .primitives import (
    INK,
    MARGIN,
    NEUTRAL,
    TEXT_PT,
    _flag,
    _mix,
    _numeric_shape,
    _positive_int,
    text_size,
)

_R = 0.1  # radius of the ⊕
_BRANCH = 0.22  # from the stream to the first box of a branch
_BOX_GAP = 0.2  # between two boxes of a branch
_RETURN = 0.26  # from a sublayer's box down to the ⊕ its output goes to
_SUB_GAP = 0.22  # between a sublayer's ⊕ (or post-norm box) and the next branch
_NAME_H = 0.22  # the line "residual stream"


@dataclass(frozen=True)
class _Block:
    """Where things go down the residual stream, and the sizes of the boxes."""

    width: float
    height: float
    norm: str  # "pre" or "post"
    x_s: float  # the stream
    y_start: float  # where it starts (top) and ends (bottom)
    y_end: float
    rows: list[float]  # the top of each sublayer's row of boxes
    box_h: float
    ln_w: float  # a LayerNorm box
    ln_h: float  # its height on the stream (post-norm)
    sub_w: dict[str, float]  # each sublayer's box


def _plus(ax, x: float, y: float, r: float = _R, tag: str | None = None):
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

    The residual stream (thick line) carries ``(T, E)`` from the top down, narrow enough for
    a phone; each sublayer branches off to the right and its output comes back to the stream.
    Pre-norm (``norm="pre"``, GPT-2 and most models since): each sublayer normalises a copy of
    the stream, transforms it (causal multi-head attention, then the MLP) and adds the result
    back (⊕); the stream itself is never normalised inside the block. Post-norm
    (``norm="post"``, the original Transformer): the sublayer reads the stream directly and the
    sum is normalised, on the stream.

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
        The diagram: white, at most 3.7 in wide (a phone's column), not registered with
        pyplot.

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
    ends = (["input $X$", "$(T, E)$", *shape], ["out", "$(T, E)$", *shape])
    block = _block_layout(norm, sub, ends)
    fig, ax = new_canvas(block.width, block.height)
    _write(ax, MARGIN, block.height - MARGIN, _title(norm), ha="left", va="top")
    for n, (key, text, color) in enumerate(sub):
        _draw_sublayer(ax, block, n, key, text, color)
    _draw_stream(ax, block, ends)
    return fig


def _title(norm: str) -> str:
    return "pre-norm block" if norm == "pre" else "post-norm block (original Transformer)"


def _block_layout(norm: str, sub, ends) -> _Block:
    """From the top: the title; the stream's start, with the input's labels right of it; per
    sublayer a row of boxes right of the stream, the ⊕ under it (and the LayerNorm on the
    stream under that, post-norm); the stream's end, with the output's labels and the name
    "residual stream" right of it."""
    ln_w = text_size("LayerNorm", TEXT_PT)[0] + 0.2
    ln_h = _lines_size(["LayerNorm"])[1] + 0.1
    sub_w = {k: max(text_size(t, TEXT_PT)[0] for _, t, _ in sub) + 0.24 for k, _, _ in sub}
    box_h = _lines_size(["causal multi-head", "attention"])[1] + 0.12
    ends_w, ends_h = (max(v) for v in zip(*(_lines_size(e) for e in ends)))
    x_s = MARGIN + (ln_w / 2 if norm == "post" else 0.12)
    branch_w = _BRANCH + (ln_w + _BOX_GAP if norm == "pre" else 0.0) + max(sub_w.values())
    title_w = text_size(_title(norm), TEXT_PT)[0]
    width = min(PHONE_CANVAS, max(x_s + max(branch_w, 0.12 + ends_w), MARGIN + title_w) + MARGIN)
    title_h = _lines_size(["post-norm"])[1] + 0.12
    per_sub = box_h + _RETURN + _R + (0.1 + ln_h if norm == "post" else 0.0)
    y_end = MARGIN + 0.02
    bottom = y_end + ends_h + 0.08 + _NAME_H  # the output's labels and the stream's name
    height = bottom + len(sub) * (per_sub + _SUB_GAP) + ends_h + 0.08 + title_h + MARGIN
    y_start = height - MARGIN - title_h
    rows = [y_start - ends_h - 0.08 - n * (per_sub + _SUB_GAP) for n in range(len(sub))]
    return _Block(
        width=width,
        height=height,
        norm=norm,
        x_s=x_s,
        y_start=y_start,
        y_end=y_end,
        rows=rows,
        box_h=box_h,
        ln_w=ln_w,
        ln_h=ln_h,
        sub_w=sub_w,
    )


def _draw_sublayer(ax, block: _Block, n: int, key: str, text: str, color) -> None:
    """Sublayer ``n``: a branch off the stream into its boxes, and its output added back."""
    x_s, top, box_h = block.x_s, block.rows[n], block.box_h
    y_mid = top - box_h / 2
    x = x_s + _BRANCH
    if block.norm == "pre":
        ln = draw_box(
            ax,
            x,
            top - box_h,
            block.ln_w,
            box_h,
            "LayerNorm",
            color=NEUTRAL,
            fill=0.1,
            fontsize=TEXT_PT,
            tag=f"norm {n + 1}",
        )
        draw_arrow(ax, (x_s, y_mid), ln.left)  # the branch: a copy of the stream
        x = ln.x1 + _BOX_GAP
    box = draw_box(
        ax,
        x,
        top - box_h,
        block.sub_w[key],
        box_h,
        text,
        color=color,
        fill=0.25,
        fontsize=TEXT_PT,
        tag=key,
    )
    draw_arrow(ax, (box.x0 - _BOX_GAP if block.norm == "pre" else x_s, y_mid), box.left)
    y_add = box.y0 - _RETURN
    _segment(ax, [box.cx, box.cx], [box.y0, y_add], color=INK, linewidth=1.3)
    draw_arrow(ax, (box.cx, y_add), (x_s + _R, y_add))
    _plus(ax, x_s, y_add, tag=key)
    if block.norm == "post":
        draw_box(
            ax,
            x_s - block.ln_w / 2,
            y_add - _R - 0.1 - block.ln_h,
            block.ln_w,
            block.ln_h,
            "LayerNorm",
            color=NEUTRAL,
            fill=0.1,
            fontsize=TEXT_PT,
            tag=f"norm {n + 1}",
        )


def _draw_stream(ax, block: _Block, ends) -> None:
    """The thick residual stream from start to end, its arrow, the labels of its ends and its
    name."""
    x_s, y0, y1 = block.x_s, block.y_start, block.y_end
    stream_color = _mix(OUTPUT, 0.8, "black")
    _segment(
        ax,
        [x_s, x_s],
        [y0, y1],
        color=stream_color,
        linewidth=3.0,
        zorder=0.5,
        solid_capstyle="butt",
    )
    draw_arrow(ax, (x_s, y1 + 0.2), (x_s, y1), color=stream_color, linewidth=1.5)
    _write_lines(ax, x_s + 0.12, y0, ends[0], ha="left")
    out_h = _lines_size(ends[1])[1]
    _write_lines(ax, x_s + 0.12, y1 + out_h, ends[1], ha="left")
    _write(ax, x_s + 0.12, y1 + out_h + 0.08, "residual stream", ha="left", va="bottom")
