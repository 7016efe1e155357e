"""Timing for the pages that measure: processor time, best of a few runs, and growth rates.

The book is built on shared machines, so the pages time with ``time.process_time`` (the
processor time of this process, which does not count the moments other programs hold the core)
and state ratios and growth rates, never absolute speeds.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from .checks import check_count

__all__ = ["best_time", "l2_cache", "loglog_slope"]

# Where Linux describes the caches of the first processor.
CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def best_time(fn: Callable[[], object], repeats: int = 3) -> float:
    """The smallest processor time, in seconds, of ``repeats`` calls of ``fn()``.

    Raises
    ------
    TypeError
        If ``fn`` is not callable or ``repeats`` is not an int.
    ValueError
        If ``repeats`` is smaller than 1.

    Examples
    --------
    >>> from sdpa_book import best_time
    >>> best_time(lambda: sum(range(1000))) >= 0.0
    True
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable; got {type(fn).__name__}")
    repeats = check_count(repeats, "repeats")
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return min(times)


def loglog_slope(
    sizes: Sequence[float], values: Sequence[float], *, last: int | None = None
) -> float:
    """The least-squares slope of ``log(values)`` against ``log(sizes)``.

    A cost that grows like ``n ** p`` has slope ``p``. ``last`` keeps only the last points,
    where fixed overheads matter least.

    Raises
    ------
    ValueError
        If the two sequences differ in length, fewer than two points remain, or a value is not
        positive.

    Examples
    --------
    >>> from sdpa_book import loglog_slope
    >>> round(loglog_slope([1, 2, 4, 8], [3, 12, 48, 192]), 6)
    2.0
    """
    x = np.asarray(sizes, dtype=float)
    y = np.asarray(values, dtype=float)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"sizes and values must be 1-D of one length; got {x.shape} and {y.shape}")
    if last is not None:
        x, y = x[-last:], y[-last:]
    if x.size < 2:
        raise ValueError(f"need at least two points for a slope; got {x.size}")
    if (x <= 0).any() or (y <= 0).any():
        raise ValueError("sizes and values must be positive for a log-log slope")
    return float(np.polyfit(np.log(x), np.log(y), 1)[0])


def l2_cache(cache_dir: Path | str = CACHE_DIR) -> int | None:
    """The size in bytes of one core's level-2 cache, as Linux reports it; None if it does not.

    The pages that relate a working set to the cache read the size of the machine that builds
    them, never a typical one.

    Parameters
    ----------
    cache_dir : path, default ``/sys/devices/system/cpu/cpu0/cache``
        The folder of ``index*`` entries, each with ``level``, ``type`` and ``size`` files.

    Returns
    -------
    int or None
        The size of the level-2 data (or unified) cache, or None where there is no such entry
        (another system, a container that hides it).

    Examples
    --------
    >>> from sdpa_book import l2_cache
    >>> size = l2_cache()
    >>> size is None or size >= 2**10
    True
    """
    for index in sorted(Path(cache_dir).glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        match = re.fullmatch(r"(\d+)\s*([KMG]?)i?B?", size)
        if level == "2" and kind != "Instruction" and match:
            return int(match.group(1)) * _UNITS[match.group(2)]
    return None
