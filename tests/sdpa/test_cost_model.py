"""The ``implementation="auto"`` rule on grouped-query decoding (``enable_gqa``), issue 34.

The expected decisions are measured facts, not values read off the cost model: wall times of
both paths (``make bench``'s auto grid, best of interleaved rounds) and one thread's CPU time
of the reference path, on an Intel Xeon (Sapphire Rapids, 2 cores, AVX-512, OpenBLAS). The
rule is pinned to the 2 cores it was measured on: more cores share the tiled path's work.
"""

from __future__ import annotations

import numpy as np
import pytest

import sdpa.cost_model
import sdpa.tiled
from sdpa.cost_model import auto_path, estimated_times, tiled_threads, worth_tiling
from sdpa.problem import prepare_attention


@pytest.fixture
def two_cores(monkeypatch):
    for module in (sdpa.cost_model, sdpa.tiled):
        monkeypatch.setattr(module, "default_num_threads", lambda: 2)


def grouped(hq, hkv, t, s, d=64):
    """The prepared problem of hq query heads of t rows over hkv key heads of s keys."""
    q = np.zeros((1, hq, t, d), dtype=np.float32)
    k = np.zeros((1, hkv, s, d), dtype=np.float32)
    return prepare_attention(q, k, k, enable_gqa=True)


@pytest.mark.parametrize(
    "t, s",
    [
        # 32 query heads over 8 key heads, width 64, float32, two threads; the tiled path with
        # the heads of a short call folded into one unit (sdpa.tuning.SHORT_CALL_SCORES); best
        # of 25 interleaved rounds on a loaded 2-core Xeon (Sapphire Rapids)
        (1, 2048),  # reference 1.32 ms, tiled 1.59
        (1, 16384),  # reference 15.0 ms, tiled 17.4
    ],
)
def test_grouped_decoding_near_the_crossing_keeps_the_reference_path(two_cores, t, s):
    assert not worth_tiling(grouped(32, 8, t, s))


@pytest.mark.parametrize(
    "hq, hkv, t, s",
    [
        # before the heads of short calls were folded into one unit, auto tiled the first two
        # where the reference path was 1.01 to 1.25 times as fast; folded, the tiled path
        # took 3.5 ms against 5.1 and 2.3 against 3.0 (best of 15 and 25 interleaved rounds)
        (32, 8, 2, 4096),
        (32, 8, 4, 2048),
        (32, 1, 1, 16384),  # one key head: the tiled path 4 to 10 times as fast
        (32, 8, 2, 16384),  # reference 29.5 ms, tiled 20.8
        (32, 8, 4, 4096),  # reference 9.7 ms, tiled 8.3
        (64, 8, 4, 4096),  # reference 15.7 ms, tiled 8.9
    ],
)
def test_grouped_decoding_far_past_the_crossing_tiles(two_cores, hq, hkv, t, s):
    assert worth_tiling(grouped(hq, hkv, t, s))


@pytest.mark.parametrize("t", [1, 2, 4])
def test_reference_estimate_falls_with_the_group_as_measured(t):
    # One thread's CPU time of the reference path, 32 query heads of width 64, S = 2048, over
    # 32, 8, 4 and 1 key heads (ms): the heads of a group read their shared key head from the
    # cache. The estimate must fall in the same order, and what one key head saves against 32
    # (the call and the scores cost the same in both) must be near the measured saving.
    measured = {
        1: [2.51, 1.28, 1.04, 0.76],
        2: [4.97, 3.20, 2.92, 2.68],
        4: [5.54, 3.73, 3.26, 2.82],
    }
    estimates = [estimated_times(grouped(32, hkv, t, 2048))[0] / 1e3 for hkv in (32, 8, 4, 1)]
    assert all(a > b for a, b in zip(estimates, estimates[1:]))
    saving = measured[t][0] - measured[t][-1]
    if t == 1:
        np.testing.assert_allclose(estimates[0] - estimates[-1], saving, rtol=0.3)
    else:
        # The shares of packed reads are fitted to wall times on two threads, where BLAS packs
        # in parallel: the model keeps at least half the saving one thread measures, no more.
        assert 0.5 * saving < estimates[0] - estimates[-1] < 1.3 * saving


@pytest.mark.parametrize(
    "t, is_causal, dtype, threads",
    [
        # one head, width 64, the tiled path on one thread and on two (10 ms idle before each
        # call, medians of 30, 2-core Xeon): worker threads start on cold cores, which a
        # second thread repays only from a few milliseconds of work
        (512, False, np.float32, 1),  # one thread 1.73 ms, two 2.42
        (1024, True, np.float32, 1),  # 3.50, 4.74
        (2048, False, np.float32, 2),  # 13.4, 9.7
        (4096, True, np.float32, 2),  # 26.8, 17.8
        (1024, False, np.float64, 2),  # 9.04, 6.27
        (1024, True, np.float64, 1),  # 5.59, 5.86
        (2048, True, np.float64, 2),  # 16.8, 12.2
    ],
)
def test_tiled_threads_as_measured(two_cores, t, is_causal, dtype, threads):
    x = np.zeros((1, 1, t, 64), dtype)
    assert tiled_threads(prepare_attention(x, x, x, is_causal=is_causal)) == threads


def test_auto_runs_a_short_tiled_call_on_one_thread(two_cores):
    # One causal head of 1024 x 1024 scores, width 64, float32: the reference path took 9.39
    # ms, the tiled path 3.81 on one thread and 4.74 on two; auto tiles it, on one thread. One
    # head of 512 x 512 scores stays on the reference path, chosen against the tiled path on
    # all cores (the reference 2.96 ms, the tiled path 3.13 on two threads, 2.08 on one).
    x = np.zeros((1, 1, 1024, 64), np.float32)
    assert auto_path(prepare_attention(x, x, x, is_causal=True)) == 1
    x = np.zeros((1, 1, 512, 64), np.float32)
    assert auto_path(prepare_attention(x, x, x)) == 0 and not worth_tiling(
        prepare_attention(x, x, x)
    )
    assert auto_path(grouped(32, 8, 1, 2048)) == 0  # the reference path (see above)
    x = np.zeros((1, 8, 2048, 64), np.float32)  # tiled, on both threads
    assert auto_path(prepare_attention(x, x, x)) == 2
