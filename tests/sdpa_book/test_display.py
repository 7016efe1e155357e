"""sdpa_book.display: glue inside and outside the build, plain text, tables, rounded bounds."""

from __future__ import annotations

import numpy as np
import pytest

from sdpa_book import (
    Plain,
    glue,
    markdown_table,
    round_down,
    round_up,
    vec,
)
from sdpa_book.display import BUILD_ENV


def test_glue_outside_the_build_shows_no_numbers(monkeypatch, capsys):
    shown = []
    monkeypatch.delenv(BUILD_ENV, raising=False)
    monkeypatch.setattr("IPython.display.display", lambda value: shown.append(value))
    assert glue("x", 1.5) is None
    assert shown == []
    assert capsys.readouterr().out == ""


def test_glue_outside_the_build_shows_figures(monkeypatch):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = []
    monkeypatch.delenv(BUILD_ENV, raising=False)
    monkeypatch.setattr("IPython.display.display", lambda value: shown.append(value))
    fig = plt.figure()
    glue("fig", fig, display=False)
    plt.close(fig)
    assert shown == [fig]


def test_glue_in_the_build_uses_myst_nb(monkeypatch):
    myst_nb = pytest.importorskip("myst_nb")
    calls = []
    monkeypatch.setenv(BUILD_ENV, "1")
    monkeypatch.setattr(
        myst_nb, "glue", lambda name, value, display: calls.append((name, value, display))
    )
    assert glue("n", 3) is None
    assert calls == [("n", 3, False)]


@pytest.mark.parametrize(
    "text", ["100,663,296", "5, 7, 24, 4, 6", "1e3", "0.10", "(T, Dk)", np.str_("verb")]
)
def test_glued_plain_text_reads_back_unchanged_in_the_prose(monkeypatch, text):
    # The prose shows what MyST-NB's {glue:text} makes of the value's text/plain form.
    myst_nb = pytest.importorskip("myst_nb")
    from IPython.core.formatters import PlainTextFormatter
    from myst_nb.core.variables import format_plain_text

    calls = []
    monkeypatch.setenv(BUILD_ENV, "1")
    monkeypatch.setattr(myst_nb, "glue", lambda name, value, display: calls.append(value))
    glue("t", Plain(text))
    (stored,) = calls
    assert format_plain_text(PlainTextFormatter()(stored), "") == text


def test_glue_rejects_a_bad_name():
    with pytest.raises(TypeError, match="name must be a non-empty str; got 3"):
        glue(3, 1.0)


def test_plain_and_vec():
    assert repr(Plain("a b")) == "a b"
    assert repr(vec(np.array([[1.0, 0.25]]))) == "(1, 0.25)"
    with pytest.raises(TypeError, match="text must be a str; got int"):
        Plain(1)


def test_markdown_table_aligns_numbers_right_and_escapes_bars():
    table = markdown_table([["a|b", 1], ["c", 2.5]], ["name", "value"]).data
    assert table.splitlines() == ["| name | value |", "|:--|--:|", "| a\\|b | 1 |", "| c | 2.5 |"]


def test_markdown_table_rejects_a_short_row():
    with pytest.raises(
        ValueError, match="every row must have 2 cells, one per header; row 0 has 1"
    ):
        markdown_table([[1]], ["a", "b"])


def test_markdown_table_rejects_bad_alignment():
    with pytest.raises(ValueError, match="align must have one of l, c, r per column"):
        markdown_table([[1, 2]], ["a", "b"], align="lx")


@pytest.mark.parametrize(
    ("rounding", "x", "digits", "expect"),
    [
        (round_up, 4.3e-16, 1, 5e-16),
        (round_up, 2.2e-16, 1, 3e-16),
        (round_up, 4e-16, 1, 4e-16),
        (round_up, 1e-15, 2, 1e-15),
        (round_up, 9.99e-16, 1, 1e-15),
        (round_up, 0.123, 2, 0.13),
        (round_up, 0.0, 1, 0.0),
        (round_down, 0.9646, 3, 0.964),
        (round_down, 4.9e-16, 1, 4e-16),
        (round_down, 4e-16, 1, 4e-16),
        (round_down, 1e-15, 2, 1e-15),
        (round_down, 0.123, 2, 0.12),
        (round_down, 0.0, 1, 0.0),
    ],
)
def test_rounding_gives_a_bound_that_holds(rounding, x, digits, expect):
    bound = rounding(x, digits)
    assert bound == expect
    assert bound >= x if rounding is round_up else bound <= x


@pytest.mark.parametrize("rounding", [round_up, round_down])
def test_the_rounded_bound_prints_as_it_is(rounding):
    # Formatted with as many significant digits as it was rounded to, the printed number is
    # the bound itself: on the safe side of the value.
    for x in np.random.default_rng(0).uniform(0, 1, 200) * 10.0 ** np.arange(-10, 10, 0.1):
        printed = float(f"{rounding(x, 2):.2g}")
        assert printed >= x if rounding is round_up else printed <= x


def test_round_up_validates():
    with pytest.raises(ValueError, match="non-negative finite"):
        round_up(-1e-16)
    with pytest.raises(ValueError, match="non-negative finite"):
        round_up(float("nan"))
    with pytest.raises(ValueError, match="digits must be an int"):
        round_up(1.0, 0)
    with pytest.raises(ValueError, match="non-negative finite"):
        round_down(-0.5)
