"""One token's embedding becoming its query, key and value: :func:`token_qkv_diagram`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..figures import FULL_WIDTH, KEY, QUERY, VALUE
from .draw import draw_arrow, draw_box, new_canvas
from .matrix import draw_matrix
from .primitives import (
    LABEL_PT,
    MARGIN,
    MAX_CELLS,
    NAME_PT,
    NEUTRAL,
    Rect,
    _at_most,
    _line_height,
    _mathtext_shape,
    _pack,
    _real_array,
    text_size,
)

# From left to right: the token, the embedding x, the projections W, the outputs; the arrows
# between them are these long.
_ARROWS = (0.3, 0.45, 0.45)


@dataclass(frozen=True)
class _Branch:
    """One of the three projections: output ``q``, ``k`` or ``v`` of ``x @ W``."""

    out: str  # "q", "k" or "v"
    role: str  # "Q", "K" or "V": the subscript of W
    W: np.ndarray  # (E, D)
    dims: tuple[str, str]  # of W
    color: str
    out_dims: tuple[str]  # of the output


@dataclass(frozen=True)
class _TokenLayout:
    width: float
    height: float
    token_w: float
    cell: float  # side of a vector's cell
    vec_h: float  # height of a vector's row
    unit: float  # side of a projection's cell
    x_vec: float  # left of the embedding x
    x_W: float  # left of the projections
    x_out: float  # left of the outputs
    centres: list[float]  # heights of the three branches' middles
    rows_h: list[float]  # heights of the projections


def token_qkv_diagram(x, W_q, W_k, W_v, *, token: str = "cat"):
    r"""One token's embedding ``x`` becoming its query, key and value: ``q = x W_Q``, ...

    The embedding row ``x (E,)`` is multiplied by the three projection matrices; the vectors
    are drawn as rows of cells (with their values when they fit), the matrices as grids
    labelled with their shapes.

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
        The diagram: white, at most ``sdpa_book.figures.FULL_WIDTH`` wide, not registered
        with pyplot.

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
    >>> rng = np.random.default_rng(0)
    >>> E, Dk, Dv = 4, 3, 2
    >>> fig = token_qkv_diagram(rng.standard_normal(E), rng.standard_normal((E, Dk)),
    ...                         rng.standard_normal((E, Dk)), rng.standard_normal((E, Dv)))
    >>> [t for t in figure_texts(fig) if t.startswith("(")]  # x, W_Q, q, W_K, k, W_V, v
    ['(4,)', '(4, 3)', '(3,)', '(4, 3)', '(3,)', '(4, 2)', '(2,)']
    """
    x, W_q, W_k, W_v = _checked_arrays(x, W_q, W_k, W_v, token)
    branches = [
        _Branch("q", "Q", W_q, ("E", "D_k"), QUERY, ("D_k",)),
        _Branch("k", "K", W_k, ("E", "D_k"), KEY, ("D_k",)),
        _Branch("v", "V", W_v, ("E", "D_v"), VALUE, ("D_v",)),
    ]
    token_text = f"\u201c{token}\u201d"
    layout = _layout(token_text, x.shape[0], W_q.shape[1], W_v.shape[1], branches)
    fig, ax = new_canvas(layout.width, layout.height)
    x_rect = _draw_token_and_embedding(ax, layout, token_text, x)
    for branch, yc, h in zip(branches, layout.centres, layout.rows_h):
        _draw_branch(ax, layout, branch, x, x_rect, yc, h)
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


def _layout(token_text: str, E: int, Dk: int, Dv: int, branches) -> _TokenLayout:
    """Sizes and places: the token and x in the middle row, one row per branch."""
    token_w = text_size(token_text, NAME_PT)[0] + 0.2
    widest = max(Dk, Dv)
    out_names = [f"${b.out} = x\\,W_{b.role}$" for b in branches]
    name_w = max(text_size(n, NAME_PT)[0] for n in out_names)
    # Vector cells: wide enough for two decimals when the row fits, else narrower and blank.
    fixed = 2 * MARGIN + token_w + sum(_ARROWS) + 0.1
    unit = min(0.17, 1.2 / widest, 0.85 / E)  # projection grids: at most 0.85 in high
    room = FULL_WIDTH - fixed - widest * unit
    cell = max(min(0.5, room / (E + widest)), 0.05)
    vec_h = max(min(cell, 0.24), 0.12)

    rows_h = [max(E * unit, 0.1) for _ in branches]
    label_above = _line_height(NAME_PT) + 0.07
    label_below = 2 * _line_height(LABEL_PT) + 0.07
    branch_h = [h + label_above + label_below + 0.12 for h in rows_h]
    height = sum(branch_h) + 2 * MARGIN
    tops = _pack(branch_h, start=height - MARGIN, down=True)
    centres = [top - label_above - 0.06 - h / 2 for top, h in zip(tops, rows_h)]

    row = [token_w, E * cell, widest * unit, widest * cell]  # token, x, W, x @ W
    _, x_vec, x_W, x_out = _pack(row, _ARROWS, start=MARGIN)
    width = max(x_out + widest * cell, x_out + name_w) + MARGIN
    W_name_w = max(text_size("$W_Q$", NAME_PT)[0], text_size(_mathtext_shape(("E", "D_k")))[0])
    width = min(FULL_WIDTH, max(width, x_W + W_name_w + MARGIN))
    return _TokenLayout(
        width, height, token_w, cell, vec_h, unit, x_vec, x_W, x_out, centres, rows_h
    )


def _draw_token_and_embedding(ax, layout: _TokenLayout, token_text: str, x) -> Rect:
    """The token and its embedding x, at the height of the middle branch; x's rectangle."""
    y_mid = layout.centres[1]
    tok = draw_box(
        ax, MARGIN, y_mid - 0.2, layout.token_w, 0.4, token_text, color=NEUTRAL, fill=0.08
    )
    x_rect = draw_matrix(
        ax,
        layout.x_vec,
        y_mid - layout.vec_h / 2,
        x.shape,
        unit=layout.cell,
        min_size=layout.vec_h,
        color=NEUTRAL,
        fill=0.12,
        name="embedding $x$",
        dims=("E",),
        values=x,
        tag="x",
    )
    draw_arrow(ax, tok.right, x_rect.left)
    return x_rect


def _draw_branch(ax, layout: _TokenLayout, b: _Branch, x, x_rect: Rect, yc: float, h: float):
    """x -> W -> x @ W, centred at height ``yc`` (``h``: the height of W's grid)."""
    w_rect = draw_matrix(
        ax,
        layout.x_W,
        yc - h / 2,
        b.W.shape,
        unit=layout.unit,
        color=b.color,
        fill=0.3,
        name=f"$W_{b.role}$",
        dims=b.dims,
        tag=f"W_{b.role}",
    )
    draw_arrow(ax, (x_rect.x1 + 0.04, x_rect.cy), (w_rect.x0 - 0.02, yc))
    out = x @ b.W  # (E,) @ (E, D) -> (D,)
    o_rect = draw_matrix(
        ax,
        layout.x_out,
        yc - layout.vec_h / 2,
        out.shape,
        unit=layout.cell,
        min_size=layout.vec_h,
        color=b.color,
        fill=0.35,
        name=f"${b.out} = x\\,W_{b.role}$",
        dims=b.out_dims,
        values=out,
        tag=b.out,
    )
    draw_arrow(ax, (w_rect.x1 + 0.04, yc), (o_rect.x0 - 0.02, yc))
