"""sdpa.plotting: colour ranges, masked cells, boolean masks, sizes and errors."""

from __future__ import annotations

import numpy as np
import pytest

mpl = pytest.importorskip("matplotlib")
mpl.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from sdpa.plotting import MASKED_COLOR, MAX_WIDTH, heatmap, mask_plot, new_figure  # noqa: E402


@pytest.fixture
def ax():
    fig, ax = new_figure()
    yield ax
    plt.close(fig)


def test_new_figure_scales_wide_grids_down_to_the_column():
    fig, _ = new_figure(4, 2, width=3.0, height=2.5)  # 12 x 5 in asked
    np.testing.assert_allclose(fig.get_size_inches(), [MAX_WIDTH, 5 * MAX_WIDTH / 12])
    plt.close(fig)
    fig, _ = new_figure(2, width=3.0, height=2.5)  # 6 x 2.5 fits: unchanged
    np.testing.assert_allclose(fig.get_size_inches(), [6.0, 2.5])
    plt.close(fig)


def test_new_figure_errors():
    with pytest.raises(TypeError, match="ncols must be an int; got 2.0"):
        new_figure(2.0)
    with pytest.raises(ValueError, match="nrows must be at least 1; got 0"):
        new_figure(1, 0)
    with pytest.raises(ValueError, match="width must be a positive number of inches; got -1"):
        new_figure(width=-1)


def test_signed_heatmap_is_centred_on_zero(ax):
    im = heatmap(ax, [[-0.5, 3.0]], kind="signed", colorbar_label=None)
    assert im.get_clim() == (-3.0, 3.0)
    im = heatmap(ax, [[-0.5, 3.0]], kind="signed", vmax=5.0, colorbar_label=None)
    assert im.get_clim() == (-5.0, 5.0)


def test_masked_cells_are_grey_not_a_small_weight(ax):
    weights = np.array([[1.0, 0.0], [0.5, 0.5]])
    masked = np.array([[False, True], [False, False]])
    im = heatmap(ax, weights, masked=masked, colorbar_label=None)
    rgba = im.to_rgba(im.get_array())
    np.testing.assert_allclose(rgba[0, 1], mpl.colors.to_rgba(MASKED_COLOR))
    assert not np.allclose(rgba[0, 1], rgba[1, 0])  # grey, not the colour of a weight
    # a true zero weight (not masked) keeps the colour map's lowest colour
    im = heatmap(ax, weights, colorbar_label=None)
    np.testing.assert_allclose(im.to_rgba(im.get_array())[0, 1], mpl.colormaps["viridis"](0.0))
    # masked cells get no annotation
    assert "0.00" not in [t.get_text() for t in ax.texts[:3]]


def test_annotations_are_legible(ax):
    heatmap(ax, np.eye(2), colorbar_label=None)
    assert min(t.get_fontsize() for t in ax.texts) >= 9


def test_mask_plot_draws_two_colours_with_a_legend(ax):
    allowed = np.tril(np.ones((3, 4), dtype=bool))
    im = mask_plot(ax, allowed, labels=("sees", "hidden"))
    rgba = im.to_rgba(im.get_array())
    assert len({tuple(c) for c in rgba.reshape(-1, 4)}) == 2
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["sees", "hidden"]
    assert not ax.figure.axes[1:]  # no colour bar


@pytest.mark.parametrize(
    ("data", "error", "match"),
    [
        (None, TypeError, "data must be a 2-D array of real numbers; got None"),
        (np.ones((2, 2)) * 1j, TypeError, "data must be real; got complex dtype complex128"),
        (np.ma.masked_array(np.ones((2, 2))), TypeError, "must not be a numpy masked array"),
        (np.array([["a", "b"]]), TypeError, "got dtype <U1"),
        (np.ones(3), ValueError, r"data must be 2-D \(T, S\); got data.shape=\(3,\)"),
    ],
)
def test_heatmap_rejects_bad_data(ax, data, error, match):
    with pytest.raises(error, match=match):
        heatmap(ax, data)


def test_heatmap_rejects_bad_options(ax):
    with pytest.raises(ValueError, match="kind must be 'weights' or 'signed'; got 'log'"):
        heatmap(ax, np.eye(2), kind="log")
    with pytest.raises(ValueError, match="vmin must be smaller than vmax; got vmin=1.0, vmax=0.0"):
        heatmap(ax, np.eye(2), vmin=1.0, vmax=0.0)
    with pytest.raises(TypeError, match="masked must be a boolean array"):
        heatmap(ax, np.eye(2), masked=np.eye(2))
    with pytest.raises(ValueError, match=r"masked must have the shape of data \(2, 2\)"):
        heatmap(ax, np.eye(2), masked=np.ones((2, 3), dtype=bool))
    with pytest.raises(ValueError, match=r"row_labels must have one label per row \(2\); got 3"):
        heatmap(ax, np.eye(2), row_labels=list("abc"))


def test_mask_plot_errors(ax):
    with pytest.raises(TypeError, match="allowed must be a 2-D boolean array; got None"):
        mask_plot(ax, None)
    with pytest.raises(
        TypeError, match=r"allowed must be a boolean array \(True = may attend\); got dtype float64"
    ):
        mask_plot(ax, np.eye(2))
    with pytest.raises(ValueError, match=r"allowed must be 2-D \(T, S\); got allowed.shape=\(2,\)"):
        mask_plot(ax, np.ones(2, dtype=bool))


@pytest.mark.parametrize(
    "bad, got",
    [(None, "NoneType"), (np.eye(2), "numpy.ndarray"), ("ax", "str")],
)
@pytest.mark.parametrize("draw", [heatmap, mask_plot], ids=["heatmap", "mask_plot"])
def test_ax_must_be_a_matplotlib_axes(draw, bad, got):
    with pytest.raises(TypeError, match=rf"ax must be a matplotlib Axes .*; got {got}"):
        draw(bad, np.eye(2, dtype=bool))


def test_an_array_of_axes_names_the_fix():
    """new_figure(2) returns an array of two Axes: the message says to pass one of them."""
    fig, axes = new_figure(2)
    with pytest.raises(
        TypeError, match=r"got numpy.ndarray of 2 Axes: pass one of them, e.g. axes\[0\]"
    ):
        heatmap(axes, np.eye(2))
    plt.close(fig)
