"""Figures for attention: heatmaps with fixed colour ranges, masks, labelled axes (needs matplotlib).

matplotlib is an optional dependency (``pip install sdpa[docs]``); it is imported only when a
function here is called. Figures get an opaque white background so that they read the same on
light and dark pages, and are at most ``MAX_WIDTH`` (7.0) inches wide.

Three kinds of array get three kinds of colour map:

* ``kind="weights"``: attention weights, in ``[0, 1]``, a sequential map (viridis);
* ``kind="signed"``: scores, values, biases, gradients, a diverging map centred on 0;
* boolean masks: two colours and a legend (:func:`mask_plot`), never a continuous colour bar.

Cells that are masked out are drawn in a neutral grey, apart from small weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["ALLOWED_COLOR", "MASKED_COLOR", "MAX_WIDTH", "heatmap", "mask_plot", "new_figure"]

#: Inches: the book's content column at 1280 px, so figures are never shrunk.
MAX_WIDTH = 7.0
#: Masked cells: a neutral grey that no colour map here contains.
MASKED_COLOR = "#c8c8c8"
#: Boolean masks: Okabe-Ito blue for "may attend".
ALLOWED_COLOR = "#0072b2"
CMAPS = {"weights": "viridis", "signed": "RdBu_r"}


def new_figure(
    ncols: int = 1,
    nrows: int = 1,
    *,
    width: float = 4.2,
    height: float = 3.4,
    max_width: float = MAX_WIDTH,
    **kwargs,
):
    """A matplotlib ``(fig, axes)`` pair in the book's style: white background, constrained layout.

    Parameters
    ----------
    ncols, nrows : int
        Grid of axes.
    width, height : float
        Size of *one* panel in inches. When the grid would be wider than ``max_width``, the
        whole figure is scaled down to ``max_width``, keeping its proportions.
    max_width : float, default MAX_WIDTH
        Widest figure allowed, in inches (7.0: the book's content column).
    **kwargs
        Passed to ``matplotlib.pyplot.subplots``.

    Returns
    -------
    fig, axes
        As from ``plt.subplots``.

    Raises
    ------
    TypeError
        If ``ncols`` or ``nrows`` is not an int.
    ValueError
        If a count or size is not positive.

    Examples
    --------
    >>> from sdpa.plotting import new_figure
    >>> fig, axes = new_figure(3, width=3.0, height=2.0)
    >>> fig.get_facecolor()
    (1.0, 1.0, 1.0, 1.0)
    >>> [round(float(x), 2) for x in fig.get_size_inches()]  # 9 x 2 scaled to 7 wide
    [7.0, 1.56]
    """
    import matplotlib.pyplot as plt

    for name, count in (("ncols", ncols), ("nrows", nrows)):
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)):
            raise TypeError(f"{name} must be an int; got {count!r}")
        if count < 1:
            raise ValueError(f"{name} must be at least 1; got {count}")
    for name, size in (("width", width), ("height", height), ("max_width", max_width)):
        if not (isinstance(size, (int, float, np.number)) and np.isfinite(size) and size > 0):
            raise ValueError(f"{name} must be a positive number of inches; got {size!r}")
    total_w, total_h = width * ncols, height * nrows
    shrink = min(1.0, max_width / total_w)
    fig, axes = plt.subplots(
        nrows,
        ncols,
        figsize=(total_w * shrink, total_h * shrink),
        layout="constrained",
        facecolor="white",
        **kwargs,
    )
    return fig, axes


def _check_axes(ax) -> None:
    """``ax`` must be one matplotlib Axes; an array of them (from ``new_figure(2)``) gets a hint."""
    from matplotlib.axes import Axes

    if isinstance(ax, Axes):
        return
    kind = type(ax)
    got = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"
    if isinstance(ax, np.ndarray) and ax.size and all(isinstance(a, Axes) for a in ax.flat):
        first = "axes[" + ", ".join(["0"] * ax.ndim) + "]"  # axes[0] or axes[0, 0]
        got += f" of {ax.size} Axes: pass one of them, e.g. {first}"
    raise TypeError(
        f"ax must be a matplotlib Axes (one from new_figure() or plt.subplots()); got {got}"
    )


def _as_2d_real(data, name: str = "data") -> np.ndarray:
    if data is None:
        raise TypeError(f"{name} must be a 2-D array of real numbers; got None")
    if isinstance(data, np.ma.MaskedArray):
        raise TypeError(
            f"{name} must not be a numpy masked array (its mask would be lost); pass the plain "
            "array and the masked cells as masked="
        )
    array = np.asarray(data)
    if array.dtype.kind == "c":
        raise TypeError(
            f"{name} must be real; got complex dtype {array.dtype} (plot .real, .imag or abs())"
        )
    if array.dtype.kind not in "biuf":
        raise TypeError(f"{name} must be a 2-D array of real numbers; got dtype {array.dtype}")
    if array.ndim != 2:
        raise ValueError(f"{name} must be 2-D (T, S); got {name}.shape={array.shape}")
    return array.astype(float)


def _check_labels(labels, n: int, name: str) -> list[str] | None:
    if labels is None:
        return None
    labels = [str(x) for x in labels]
    if len(labels) != n:
        raise ValueError(
            f"{name} must have one label per {'row' if name == 'row_labels' else 'column'} ({n}); got {len(labels)}"
        )
    return labels


def heatmap(
    ax,
    data: ArrayLike,
    *,
    kind: str = "weights",
    row_labels: Sequence[str] | None = None,
    col_labels: Sequence[str] | None = None,
    vmin: float | None = None,
    vmax: float | None = None,
    cmap: str | None = None,
    masked: ArrayLike | None = None,
    xlabel: str = "key position j",
    ylabel: str = "query position i",
    colorbar_label: str | None = "attention weight",
    annotate: bool | None = None,
    fmt: str = "{:.2f}",
):
    """Draw a 2-D array as a heatmap with a *fixed* colour range and a labelled colour bar.

    Parameters
    ----------
    ax : matplotlib Axes
        Where to draw.
    data : (T, S) array_like
        Real numbers.
    kind : {"weights", "signed"}, default "weights"
        ``"weights"``: a sequential map over ``[vmin, vmax]`` (default ``[0, 1]``).
        ``"signed"``: a diverging map centred on 0 over ``[-lim, lim]``, where ``lim`` is
        ``max(|vmin|, |vmax|)`` when either is given, else the largest ``|data|``.
    row_labels, col_labels : sequence of str, optional
        Tick labels (for example the tokens), one per row and column.
    vmin, vmax : float, optional
        The colour range; fixed so that two heatmaps can be compared by colour.
    cmap : str, optional
        Overrides the map of ``kind``.
    masked : (T, S) array_like of bool, optional
        ``True`` where a cell is masked out: drawn grey, whatever its value, so that a masked
        zero is not mistaken for a small weight.
    xlabel, ylabel, colorbar_label : str
        Axis and colour-bar labels; ``colorbar_label=None`` draws no colour bar.
    annotate : bool, optional
        Write each value in its cell; default when the array has at most 64 cells.
    fmt : str
        Format of the annotations.

    Returns
    -------
    matplotlib.image.AxesImage
        The image drawn, for a colour bar of one's own.

    Raises
    ------
    TypeError
        If ``ax`` is not a matplotlib Axes, ``data`` is None, complex, a masked array or not
        numeric, or ``masked`` is not boolean.
    ValueError
        If ``data`` is not 2-D, ``kind`` is unknown, ``masked`` or the labels do not match its
        shape, or ``vmin >= vmax``.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa.plotting import new_figure, heatmap
    >>> fig, ax = new_figure()
    >>> im = heatmap(ax, np.eye(3), row_labels=list("abc"), col_labels=list("abc"))
    >>> im.get_clim()
    (0.0, 1.0)
    >>> im = heatmap(ax, [[-2.0, 1.0]], kind="signed", colorbar_label=None)
    >>> im.get_clim()  # centred on zero
    (-2.0, 2.0)
    """
    import matplotlib as mpl

    _check_axes(ax)
    values = _as_2d_real(data)
    if kind not in CMAPS:
        raise ValueError(f"kind must be 'weights' or 'signed'; got {kind!r}")
    if kind == "signed":
        given = [abs(x) for x in (vmin, vmax) if x is not None]
        finite = values[np.isfinite(values)]
        lim = max(given) if given else (float(np.abs(finite).max()) if finite.size else 1.0)
        lim = lim if lim > 0 else 1.0
        vmin, vmax = -lim, lim
    else:
        vmin = 0.0 if vmin is None else float(vmin)
        vmax = 1.0 if vmax is None else float(vmax)
    if not vmin < vmax:
        raise ValueError(f"vmin must be smaller than vmax; got vmin={vmin}, vmax={vmax}")
    hidden = np.zeros(values.shape, dtype=bool)
    if masked is not None:
        hidden = np.asarray(masked)
        if hidden.dtype != bool:
            raise TypeError(
                f"masked must be a boolean array (True = masked); got dtype {hidden.dtype}"
            )
        if hidden.shape != values.shape:
            raise ValueError(
                f"masked must have the shape of data {values.shape}; got masked.shape={hidden.shape}"
            )
    rows = _check_labels(row_labels, values.shape[0], "row_labels")
    cols = _check_labels(col_labels, values.shape[1], "col_labels")
    colormap = mpl.colormaps[cmap or CMAPS[kind]].with_extremes(bad=MASKED_COLOR)
    shown = np.ma.masked_array(values, mask=hidden)
    im = ax.imshow(
        shown, vmin=vmin, vmax=vmax, cmap=colormap, aspect="auto", interpolation="nearest"
    )
    if rows is not None:
        ax.set_yticks(range(values.shape[0]), labels=rows)
    if cols is not None:
        ax.set_xticks(range(values.shape[1]), labels=cols)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if annotate is None:
        annotate = values.size <= 64
    if annotate:
        for (i, j), value in np.ndenumerate(values):
            if hidden[i, j]:
                continue
            r, g, b, _ = colormap((value - vmin) / (vmax - vmin))
            dark = 0.299 * r + 0.587 * g + 0.114 * b < 0.5
            ax.text(
                j,
                i,
                fmt.format(value),
                ha="center",
                va="center",
                fontsize=9,
                color="white" if dark else "black",
            )
    if colorbar_label is not None:
        ax.figure.colorbar(im, ax=ax, label=colorbar_label)
    return im


def mask_plot(
    ax,
    allowed: ArrayLike,
    *,
    row_labels: Sequence[str] | None = None,
    col_labels: Sequence[str] | None = None,
    xlabel: str = "key position j",
    ylabel: str = "query position i",
    labels: tuple[str, str] = ("may attend", "masked"),
    legend: bool = True,
):
    """Draw a boolean mask in two colours, with a legend (``True`` = may attend).

    Parameters
    ----------
    ax : matplotlib Axes
        Where to draw.
    allowed : (T, S) array_like of bool
        The mask, in the package's polarity: ``True`` where query ``i`` may attend key ``j``.
    row_labels, col_labels : sequence of str, optional
        Tick labels, one per row and column.
    xlabel, ylabel : str
        Axis labels.
    labels : (str, str)
        Legend entries for ``True`` and ``False``.
    legend : bool, default True
        Draw the legend (beside the axes, on the right).

    Returns
    -------
    matplotlib.image.AxesImage
        The image drawn, for a colour bar of one's own.

    Raises
    ------
    TypeError
        If ``ax`` is not a matplotlib Axes or ``allowed`` is not boolean.
    ValueError
        If ``allowed`` is not 2-D or the labels do not match it.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa import causal_mask
    >>> from sdpa.plotting import new_figure, mask_plot
    >>> fig, ax = new_figure()
    >>> im = mask_plot(ax, causal_mask(4))
    >>> [t.get_text() for t in ax.get_legend().get_texts()]
    ['may attend', 'masked']
    """
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    _check_axes(ax)
    if allowed is None:
        raise TypeError("allowed must be a 2-D boolean array; got None")
    mask = np.asarray(allowed)
    if mask.dtype != bool:
        raise TypeError(
            f"allowed must be a boolean array (True = may attend); got dtype {mask.dtype}"
        )
    if mask.ndim != 2:
        raise ValueError(f"allowed must be 2-D (T, S); got allowed.shape={mask.shape}")
    rows = _check_labels(row_labels, mask.shape[0], "row_labels")
    cols = _check_labels(col_labels, mask.shape[1], "col_labels")
    colors = [MASKED_COLOR, ALLOWED_COLOR]
    im = ax.imshow(
        mask.astype(int),
        cmap=ListedColormap(colors),
        vmin=0,
        vmax=1,
        aspect="auto",
        interpolation="nearest",
    )
    if rows is not None:
        ax.set_yticks(range(mask.shape[0]), labels=rows)
    if cols is not None:
        ax.set_xticks(range(mask.shape[1]), labels=cols)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if legend:
        handles = [
            Patch(facecolor=colors[1], label=labels[0]),
            Patch(facecolor=colors[0], label=labels[1]),
        ]
        # Beside the axes, where it never meets the tick or axis labels (constrained layout
        # makes room for it).
        ax.legend(
            handles=handles,
            loc="upper left",
            bbox_to_anchor=(1.02, 1.0),
            frameon=False,
            borderaxespad=0.0,
            handlelength=1.2,
        )
    return im
