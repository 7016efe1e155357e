"""One token's embedding becoming its query, key and value: :func:`token_qkv_diagram`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..figures import KEY, QUERY, VALUE
from .draw import draw_arrow, draw_box, new_canvas
from .matrix import draw_matrix
from .primitives import (
    MARGIN,
    MATH_PT,
    MAX_CELLS,
    NEUTRAL,
    PHONE_WIDTH,
    TEXT_PT,
    Rect,
    _at_most,
    _fit_unit,
    _integer_valued,
    _label_lines,
    _pack,
    _real_array,
    _stack_size,
    text_size,
)

_NAME_PT = 12  # names, with their scripts: W_Q, q = x W_Q
_GAP = 0.2  # between two of the three branches
_LINK = 0.22  # the arrow from a projection's labels down to its output
_FAN = 0.32  # the drop of the arrows from x to the projections
_TOKEN_ARROW = 0.25  # from the token to x


@dataclass(frozen=True)
class _Branch:
    """One of the three projections: output ``q``, ``k`` or ``v`` of ``x @ W``."""

    out: str  # "q", "k" or "v"
    role: str  # "Q", "K" or "V": the subscript of W
    W: np.ndarray  # (E, D)
    dims: tuple[str, str]  # of W
    color: str
    out_dims: tuple[str]  # of the output

    @property
    def name(self) -> str:
        return f"$W_{self.role}$"

    @property
    def out_name(self) -> str:
        return f"${self.out} = x\\,W_{self.role}$"


@dataclass(frozen=True)
class _Plan:
    """Where things go, for one cell side: x on top, the three branches side by side below it."""

    token_w: float
    x_vec: float  # left of the embedding x
    y_x: float  # bottom of x
    x_W: list[float]  # left of each projection (the outputs have its width, below it)
    y_W: float  # bottom of the projections
    y_out: float  # bottom of the outputs
    row_h: float  # height of a vector's row


def token_qkv_diagram(x, W_q, W_k, W_v, *, token: str = "cat"):
    r"""One token's embedding ``x`` becoming its query, key and value: ``q = x W_Q``, ...

    The embedding row ``x (E,)`` sits on top; the three projection matrices stand side by side
    below it, each above its output ``x W``, whose entries line up with its columns. Matrices
    and vectors are grids labelled with their shapes and, when every entry of a grid fits its
    cell, its entries: whole numbers when all entries are whole (a hand-made example), else
    two decimals. The drawing is narrow enough to stay legible on a phone.

    Parameters
    ----------
    x : (E,) array_like
        The token's embedding.
    W_q, W_k : (E, Dk) array_like
        Query and key projections.
    W_v : (E, Dv) array_like
        Value projection.
    token : str, default "cat"
        The word the embedding stands for.

    Returns
    -------
    matplotlib.figure.Figure
        The diagram: white, at most 3.7 in wide (it reads on a phone), not registered with
        pyplot.

    Raises
    ------
    TypeError
        If an array is not real, or ``token`` is not a str.
    ValueError
        If an array has the wrong number of dimensions, the projections do not have ``E``
        rows, ``W_q`` and ``W_k`` differ in ``Dk``, or a size is too large to draw (more
        than 48).

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa_book.diagrams import token_qkv_diagram, figure_texts
    >>> E, Dk, Dv = 4, 3, 2
    >>> x = np.array([1.0, 0.0, 2.0, 0.0])
    >>> fig = token_qkv_diagram(x, np.ones((E, Dk)), np.eye(E, Dk), np.eye(E, Dv))
    >>> [t for t in figure_texts(fig) if t.startswith("(")]  # x, then W_Q, q, W_K, k, W_V, v
    ['(4,)', '(4, 3)', '(3,)', '(4, 3)', '(3,)', '(4, 2)', '(2,)']
    >>> figure_texts(fig)[:5]  # the token, then x's entries: whole numbers
    ['“cat”', '1', '0', '2', '0']
    """
    x, W_q, W_k, W_v = _checked_arrays(x, W_q, W_k, W_v, token)
    branches = [
        _Branch("q", "Q", W_q, ("E", "D_k"), QUERY, ("D_k",)),
        _Branch("k", "K", W_k, ("E", "D_k"), KEY, ("D_k",)),
        _Branch("v", "V", W_v, ("E", "D_v"), VALUE, ("D_v",)),
    ]
    outs = [x @ b.W for b in branches]  # (E,) @ (E, D) -> (D,)
    decimals = 0 if _integer_valued(x, W_q, W_k, W_v, *outs) else None
    token_text = f"\u201c{token}\u201d"
    unit, width, height, plan = _fit_unit(
        lambda unit: _layout(unit, token_text, x.shape[0], branches),
        0.2,
        PHONE_WIDTH,
        5.0,
    )
    fig, ax = new_canvas(width, height)
    x_rect = _draw_token_and_embedding(ax, plan, unit, token_text, x, decimals)
    for k, (branch, out) in enumerate(zip(branches, outs)):
        _draw_branch(ax, plan, unit, k, branch, out, x_rect, decimals)
    return fig


def _checked_arrays(x, W_q, W_k, W_v, token):
    """The four arrays as float64, once their shapes agree and are small enough to draw."""
    if not isinstance(token, str):
        raise TypeError(f"token must be a str; got {type(token).__name__}")
    x = _real_array(x, "x", 1)
    W_q, W_k, W_v = (_real_array(W, n, 2) for W, n in ((W_q, "W_q"), (W_k, "W_k"), (W_v, "W_v")))
    E = x.shape[0]
    for W, n in ((W_q, "W_q"), (W_k, "W_k"), (W_v, "W_v")):
        if W.shape[0] != E:
            raise ValueError(
                f"{n} must have E = {E} rows, one per entry of x; "
                f"got x.shape={x.shape}, {n}.shape={W.shape}"
            )
    if W_q.shape[1] != W_k.shape[1]:
        raise ValueError(
            f"W_q and W_k must share the width Dk; got W_q.shape={W_q.shape}, W_k.shape={W_k.shape}"
        )
    for n, v in (("E", E), ("Dk", W_q.shape[1]), ("Dv", W_v.shape[1])):
        _at_most(v, MAX_CELLS, n)
    return x, W_q, W_k, W_v


def _labels(name: str, dims, shape) -> tuple[float, float]:
    """Width and height of a grid's label stack: its name, its symbolic and numeric shapes."""
    return _stack_size(_label_lines(name, dims, shape, "s", "s", _NAME_PT, MATH_PT)["s"])


def _layout(unit: float, token_text: str, E: int, branches) -> tuple[float, float, _Plan]:
    """``(width, height, plan)`` for cells of side ``unit``: the token and x on top, then the
    three projections side by side, each above its output."""
    row_h = max(unit, 0.12)  # a vector's row stays visible
    token_w = text_size(token_text, _NAME_PT)[0] + 0.2
    x_label = _labels("embedding $x$", ("E",), (E,))
    top_w = token_w + _TOKEN_ARROW + max(E * unit, row_h) + 0.07 + x_label[0]
    W_labels = [_labels(b.name, b.dims, b.W.shape) for b in branches]
    out_labels = [_labels(b.out_name, b.out_dims, b.W.shape[1:]) for b in branches]
    slots = [
        max(b.W.shape[1] * unit, wl[0], ol[0]) for b, wl, ol in zip(branches, W_labels, out_labels)
    ]
    width = max(top_w, sum(slots) + _GAP * (len(slots) - 1)) + 2 * MARGIN
    starts = _pack(slots, _GAP, start=(width - sum(slots) - _GAP * (len(slots) - 1)) / 2)
    x_W = [s + (slot - b.W.shape[1] * unit) / 2 for s, slot, b in zip(starts, slots, branches)]

    top_h = max(0.4, row_h, x_label[1])  # the token's box, x, x's labels
    W_h = max(E * unit, 0.1)
    W_lab_h = max(h for _, h in W_labels)
    out_lab_h = max(h for _, h in out_labels)
    y_out = MARGIN + out_lab_h + 0.05
    y_W = y_out + row_h + _LINK + W_lab_h + 0.05
    y_x = y_W + W_h + _FAN + (top_h - row_h) / 2
    height = y_x + row_h + (top_h - row_h) / 2 + MARGIN
    x_vec = (width - top_w) / 2 + token_w + _TOKEN_ARROW
    return width, height, _Plan(token_w, x_vec, y_x, x_W, y_W, y_out, row_h)


def _draw_token_and_embedding(ax, plan: _Plan, unit: float, token_text: str, x, decimals) -> Rect:
    """The token, an arrow, and its embedding x labelled on its right; x's rectangle."""
    yc = plan.y_x + plan.row_h / 2
    tok = draw_box(
        ax,
        plan.x_vec - _TOKEN_ARROW - plan.token_w,
        yc - 0.2,
        plan.token_w,
        0.4,
        token_text,
        color=NEUTRAL,
        fill=0.08,
        fontsize=_NAME_PT,
    )
    x_rect = draw_matrix(
        ax,
        plan.x_vec,
        plan.y_x,
        x.shape,
        unit=unit,
        min_size=plan.row_h,
        color=NEUTRAL,
        fill=0.12,
        name="embedding $x$",
        dims=("E",),
        name_at="right",
        shape_at="right",
        values=x,
        decimals=decimals,
        name_pt=_NAME_PT,
        label_pt=MATH_PT,
        value_pt=TEXT_PT,
        tag="x",
    )
    draw_arrow(ax, (tok.x1 + 0.03, yc), (x_rect.x0 - 0.03, yc))
    return x_rect


def _draw_branch(ax, plan: _Plan, unit: float, k: int, b: _Branch, out, x_rect: Rect, decimals):
    """Branch ``k``: an arrow from x to W, W labelled below, an arrow down to ``x @ W``."""
    fonts = {"name_pt": _NAME_PT, "label_pt": MATH_PT, "value_pt": TEXT_PT}
    w_rect = draw_matrix(
        ax,
        plan.x_W[k],
        plan.y_W,
        b.W.shape,
        unit=unit,
        color=b.color,
        fill=0.3,
        name=b.name,
        dims=b.dims,
        name_at="below",
        shape_at="below",
        values=b.W,
        decimals=decimals,
        tag=f"W_{b.role}",
        **fonts,
    )
    start = (x_rect.cx + (k - 1) * min(0.12, x_rect.width / 3), x_rect.y0 - 0.04)
    draw_arrow(ax, start, (w_rect.cx, w_rect.y1 + 0.03))
    o_rect = draw_matrix(
        ax,
        plan.x_W[k],
        plan.y_out,
        out.shape,
        unit=unit,
        min_size=plan.row_h,
        color=b.color,
        fill=0.35,
        name=b.out_name,
        dims=b.out_dims,
        name_at="below",
        shape_at="below",
        values=out,
        decimals=decimals,
        tag=b.out,
        **fonts,
    )
    draw_arrow(ax, (o_rect.cx, o_rect.y1 + _LINK - 0.02), (o_rect.cx, o_rect.y1 + 0.03))
