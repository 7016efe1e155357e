"""Block masks drawn as grids of tiles: full, partial (the mask drawn inside) and empty.

A :class:`sdpa.BlockMask` cuts the ``(T, S)`` score matrix into tiles of ``BLOCK_SIZE``. The
tiled path of :func:`sdpa.flex_attention` treats a tile by what the mask leaves in it: a *full*
tile (every entry allowed) needs no mask, a *partial* one is masked entry by entry, an *empty*
one (no entry allowed) is never computed. :func:`block_kinds` sorts the tiles from the mask's
own ``mask_mod``, entry by entry, independently of how the package stores them, and
:func:`block_grid` draws one batch entry and head of a block mask: every entry coloured by what
its tile is and whether it is allowed, with lines between the tiles.
"""

from __future__ import annotations

import numpy as np

from sdpa import BlockMask

from ..figures import ALLOWED_COLOR, COLORS, MASKED_COLOR

__all__ = [
    "EMPTY",
    "ENTRY_COLORS",
    "ENTRY_LABELS",
    "FULL",
    "PARTIAL",
    "block_grid",
    "block_kinds",
    "block_legend_handles",
]

EMPTY, PARTIAL, FULL = 0, 1, 2  # what a tile holds

# One colour per entry's state, in the order of the codes block_grid draws (0 to 3):
# an entry of an empty tile, a masked and an allowed entry of a partial tile, a full tile's.
# Okabe-Ito blue (the book's "may attend") and orange for the allowed entries, white and the
# book's grey for the others: distinct in lightness as well as hue.
ENTRY_COLORS = ("#ffffff", MASKED_COLOR, COLORS[1], ALLOWED_COLOR)
ENTRY_LABELS = ("empty tile: skipped", "partial tile: masked", "partial tile: allowed", "full tile")
GRID_COLOR = "#555555"


def _check(block_mask, b: int, h: int) -> None:
    if not isinstance(block_mask, BlockMask):
        raise TypeError(
            "block_mask must be a BlockMask from sdpa.create_block_mask; "
            f"got {type(block_mask).__name__}"
        )
    for name, index, count in (("b", b, block_mask.shape[0]), ("h", h, block_mask.shape[1])):
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"{name} must be an int; got {index!r}")
        if not 0 <= index < count:
            raise ValueError(
                f"{name} must be in [0, {count}) for a block mask of shape {block_mask.shape}; "
                f"got {index}"
            )


def block_kinds(block_mask: BlockMask, b: int = 0, h: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The entries a block mask allows and what each of its tiles holds, from its ``mask_mod``.

    Parameters
    ----------
    block_mask : sdpa.BlockMask
        From :func:`sdpa.create_block_mask`.
    b, h : int, default 0
        The batch entry and head (0 for a mask created with ``B`` or ``H`` None).

    Returns
    -------
    allowed : (T, S) np.ndarray of bool
        ``mask_mod`` entry by entry: True where the query may attend the key.
    kinds : (n_q, n_kv) np.ndarray of int
        ``EMPTY`` (0), ``PARTIAL`` (1) or ``FULL`` (2) per tile; a last, shorter tile counts
        only the entries inside the matrix.

    Raises
    ------
    TypeError
        If ``block_mask`` is not a BlockMask or ``b``, ``h`` are not ints.
    ValueError
        If ``b`` or ``h`` is outside the mask's batch or heads.

    Examples
    --------
    >>> from sdpa import create_block_mask
    >>> from sdpa_book.pages.block_grid import block_kinds
    >>> mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, 6, 6, BLOCK_SIZE=3)
    >>> allowed, kinds = block_kinds(mask)
    >>> kinds  # the diagonal tiles partial, the one below full, the one above empty
    array([[1, 0],
           [2, 1]])
    """
    _check(block_mask, b, h)
    _, _, T, S = block_mask.shape
    index = [np.array([b]), np.array([h]), np.arange(T), np.arange(S)]
    b_idx, h_idx, q_idx, kv_idx = (
        x.reshape([-1 if a == i else 1 for a in range(4)]) for i, x in enumerate(index)
    )
    allowed = np.broadcast_to(block_mask.mask_mod(b_idx, h_idx, q_idx, kv_idx), (1, 1, T, S))
    allowed = np.array(allowed[0, 0], dtype=bool)
    block_q, block_kv = block_mask.BLOCK_SIZE
    q_starts, kv_starts = np.arange(0, T, block_q), np.arange(0, S, block_kv)
    counts = np.add.reduceat(np.add.reduceat(allowed.astype(int), kv_starts, axis=1), q_starts)
    sizes = np.outer(np.diff(np.append(q_starts, T)), np.diff(np.append(kv_starts, S)))
    kinds = np.where(counts == 0, EMPTY, np.where(counts == sizes, FULL, PARTIAL))
    return allowed, kinds


def block_grid(
    ax,
    block_mask: BlockMask,
    *,
    b: int = 0,
    h: int = 0,
    xlabel: str = "key j",
    ylabel: str = "query i",
):
    """Draw a block mask's tiles, full, partial and empty, with the mask inside the partial ones.

    Parameters
    ----------
    ax : matplotlib Axes
        Where to draw.
    block_mask : sdpa.BlockMask
        From :func:`sdpa.create_block_mask`.
    b, h : int, default 0
        The batch entry and head to draw.
    xlabel, ylabel : str
        Axis labels.

    Returns
    -------
    matplotlib.image.AxesImage
        The image: one pixel per score, coloured by ``ENTRY_COLORS`` (codes 0 to 3: an entry
        of an empty tile, a masked or allowed entry of a partial tile, an entry of a full one).

    Raises
    ------
    TypeError
        If ``ax`` is not a matplotlib Axes, or as :func:`block_kinds`.
    ValueError
        As :func:`block_kinds`.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa import create_block_mask
    >>> from sdpa.plotting import new_figure
    >>> from sdpa_book.pages.block_grid import block_grid
    >>> mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, 6, 6, BLOCK_SIZE=3)
    >>> fig, ax = new_figure()
    >>> image = block_grid(ax, mask)
    >>> np.asarray(image.get_array())  # 3: full tile, 2 and 1: partial, 0: empty
    array([[2, 1, 1, 0, 0, 0],
           [2, 2, 1, 0, 0, 0],
           [2, 2, 2, 0, 0, 0],
           [3, 3, 3, 2, 1, 1],
           [3, 3, 3, 2, 2, 1],
           [3, 3, 3, 2, 2, 2]])
    """
    from matplotlib.axes import Axes
    from matplotlib.colors import ListedColormap

    if not isinstance(ax, Axes):
        raise TypeError(f"ax must be a matplotlib Axes; got {type(ax).__name__}")
    allowed, kinds = block_kinds(block_mask, b, h)
    block_q, block_kv = block_mask.BLOCK_SIZE
    tile = np.repeat(np.repeat(kinds, block_q, axis=0), block_kv, axis=1)[: len(allowed)]
    tile = tile[:, : allowed.shape[1]]  # (T, S): the kind of each entry's tile
    codes = np.where(tile == FULL, 3, np.where(tile == PARTIAL, 1 + allowed, 0))
    image = ax.imshow(
        codes,
        cmap=ListedColormap(ENTRY_COLORS),
        vmin=0,
        vmax=3,
        interpolation="nearest",
        aspect="equal",
    )
    T, S = allowed.shape
    for edge in np.arange(block_q, T, block_q):
        ax.axhline(edge - 0.5, color=GRID_COLOR, linewidth=0.6)
    for edge in np.arange(block_kv, S, block_kv):
        ax.axvline(edge - 0.5, color=GRID_COLOR, linewidth=0.6)
    for axis, n, block in ((ax.yaxis, T, block_q), (ax.xaxis, S, block_kv)):
        n_blocks = -(-n // block)
        step = block * -(-n_blocks // 4)  # tile edges, at most 4 labelled
        axis.set_ticks(np.arange(0, n, step) - 0.5, labels=[str(t) for t in range(0, n, step)])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return image


def block_legend_handles() -> list:
    """Legend patches for :func:`block_grid`, from the full tiles to the empty ones.

    Returns
    -------
    list of matplotlib.patches.Patch
        One per entry colour, with its label; the empty tile's with an outline.

    Examples
    --------
    >>> from sdpa_book.pages.block_grid import block_legend_handles
    >>> [p.get_label() for p in block_legend_handles()]
    ['full tile', 'partial tile: allowed', 'partial tile: masked', 'empty tile: skipped']
    """
    from matplotlib.patches import Patch

    return [
        Patch(facecolor=color, edgecolor=GRID_COLOR, linewidth=0.6, label=label)
        for color, label in reversed(list(zip(ENTRY_COLORS, ENTRY_LABELS)))
    ]
