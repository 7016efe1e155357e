"""sdpa_book.timing: the slope of a log-log fit on power laws, best_time's minimum and checks,
and the L2 cache size read from a sysfs-like folder written here."""

from __future__ import annotations

import numpy as np
import pytest

from sdpa_book import best_time, l2_cache, loglog_slope


def test_loglog_slope_of_power_laws():
    n = np.array([16.0, 32, 64, 128])
    assert loglog_slope(n, 3 * n**1.5) == pytest.approx(1.5, abs=1e-12)
    # last= fits the tail only: a constant then a square
    assert loglog_slope(n, [5, 5, 64**2, 128**2], last=2) == pytest.approx(2.0, abs=1e-12)


def test_loglog_slope_errors():
    with pytest.raises(ValueError, match="one length"):
        loglog_slope([1, 2], [1, 2, 3])
    with pytest.raises(ValueError, match="at least two points"):
        loglog_slope([1, 2], [1, 2], last=1)
    with pytest.raises(ValueError, match="must be positive"):
        loglog_slope([1, 2], [0, 2])


def test_best_time_is_the_minimum_and_validates():
    assert best_time(lambda: None, repeats=2) >= 0.0
    with pytest.raises(TypeError, match="fn must be callable"):
        best_time(3)
    with pytest.raises(ValueError, match="repeats must be at least 1; got 0"):
        best_time(lambda: None, repeats=0)


def test_l2_cache_reads_the_level_2_entry(tmp_path):
    for name, level, kind, size in [
        ("index0", "1", "Data", "32K"),
        ("index1", "2", "Instruction", "64K"),
        ("index2", "2", "Unified", "1024K"),
    ]:
        (tmp_path / name).mkdir()
        for field, text in (("level", level), ("type", kind), ("size", size)):
            (tmp_path / name / field).write_text(text + "\n")
    assert l2_cache(tmp_path) == 2**20
    assert l2_cache(tmp_path / "missing") is None
