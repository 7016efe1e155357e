"""Figures for attention: heatmaps with fixed colour ranges and labelled axes (needs matplotlib).

matplotlib is an optional dependency (``pip install sdpa[docs]``); it is imported only when a
function here is called. Figures get an opaque white background so that they read the same on
light and dark pages.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["new_figure", "heatmap"]


def new_figure(ncols: int = 1, nrows: int = 1, *, width: float = 4.2, height: float = 3.4, **kwargs):
    """A matplotlib ``(fig, axes)`` pair in the book's style: white background, constrained layout.

    Parameters
    ----------
    ncols, nrows : int
        Grid of axes.
    width, height : float
        Size of *one* panel in inches.
    **kwargs
        Passed to ``matplotlib.pyplot.subplots``.

    Returns
    -------
    fig, axes
        As from ``plt.subplots``.

    Examples
    --------
    >>> from sdpa.plotting import new_figure
    >>> fig, ax = new_figure()
    >>> fig.get_facecolor()
    (1.0, 1.0, 1.0, 1.0)
    """
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        nrows,
        ncols,
        figsize=(width * ncols, height * nrows),
        layout="constrained",
        facecolor="white",
        **kwargs,
    )
    return fig, axes


def heatmap(
    ax,
    data: ArrayLike,
    *,
    row_labels: Sequence[str] | None = None,
    col_labels: Sequence[str] | None = None,
    vmin: float = 0.0,
    vmax: float = 1.0,
    cmap: str = "viridis",
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
    data : (T, S) array_like
    row_labels, col_labels : sequence of str, optional
        Tick labels (for example the tokens).
    vmin, vmax : float
        The colour range; fixed so that two heatmaps can be compared by colour.
    cmap : str
        A perceptually uniform map (the default, viridis, reads in greyscale too).
    xlabel, ylabel, colorbar_label : str
        Axis and colour-bar labels; ``colorbar_label=None`` draws no colour bar.
    annotate : bool, optional
        Write each value in its cell; default when the array has at most 64 cells.
    fmt : str
        Format of the annotations.

    Returns
    -------
    matplotlib.image.AxesImage

    Raises
    ------
    ValueError
        If ``data`` is not 2-D.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa.plotting import new_figure, heatmap
    >>> fig, ax = new_figure()
    >>> im = heatmap(ax, np.eye(3), row_labels=list("abc"), col_labels=list("abc"))
    >>> im.get_clim()
    (0.0, 1.0)
    """
    data = np.asarray(data, dtype=float)
    if data.ndim != 2:
        raise ValueError(f"data must be 2-D (T, S); got data.shape={data.shape}")
    im = ax.imshow(data, vmin=vmin, vmax=vmax, cmap=cmap, aspect="auto", interpolation="nearest")
    if row_labels is not None:
        ax.set_yticks(range(data.shape[0]), labels=list(row_labels))
    if col_labels is not None:
        ax.set_xticks(range(data.shape[1]), labels=list(col_labels))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if annotate is None:
        annotate = data.size <= 64
    if annotate:
        mid = (vmin + vmax) / 2
        for (i, j), value in np.ndenumerate(data):
            ax.text(j, i, fmt.format(value), ha="center", va="center", fontsize=8,
                    color="black" if value > mid else "white")
    if colorbar_label is not None:
        ax.figure.colorbar(im, ax=ax, label=colorbar_label)
    return im
